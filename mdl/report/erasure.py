"""How much each eraser erased, beside the numbers that depend on it: held-out probes before and after erasure.

Why: a cell's paper MDL says how hard the erased data were to learn only if the eraser removed what it claims.
The gradient eraser stops by its own rule (L-BFGS tolerances, a step budget) and may leave class information
(docs/differences-from-original.md D3); the quadratic erasers leave it where class covariances are singular. Each
run records the probes in results.json ``data_diagnostics.erasure`` (datamodules/erasure_checks.py); this table
averages them per eraser over the sweep's runs, with the paper's criterion where the run judged it
(``data_diagnostics.erasure_criterion``: the gradient eraser's "almost no quadratically available information").
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mdl.report.sweep import Run
from mdl.report.stats import Cell, erasers_of
from mdl.report.tables import markdown_table

PROBES = (("linear_probe_acc", "linear probe"), ("qda_acc", "QDA"))


def _diagnostics(run: Run) -> dict[str, Any]:
    found = run.results.get("data_diagnostics")
    return found if isinstance(found, dict) else {}


def _mean(values: list[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return float(np.mean(numbers)) if numbers else None


def erasure_row(eraser: str, runs: Sequence[Run]) -> list[str] | None:
    """'leace | 0.96 → 0.24 | 0.94 → 0.90 | 0.10 | n/a (12 runs)'; None when no run recorded the probes."""
    records = [_diagnostics(r).get("erasure") or {} for r in runs]
    cells = []
    for key, _ in PROBES:
        before, after = (
            _mean([x.get(f"{key}_before") for x in records]),
            _mean([x.get(f"{key}_after") for x in records]),
        )
        cells.append(
            "n/a" if after is None else f"{before:.2f} → {after:.2f}" if before is not None else f"{after:.2f}"
        )
    chance = _mean([x.get("chance") for x in records])
    if chance is None:
        return None
    judged = [_diagnostics(r).get("erasure_criterion") or {} for r in runs]
    judged = [j for j in judged if j.get("checked")]
    met = f"{sum(bool(j.get('met')) for j in judged)} of {len(judged)} runs" if judged else "not judged"
    return [eraser, *cells, f"{chance:.2f}", met, str(len(runs))]


def erasure_section(cells: Sequence[Cell]) -> list[str]:
    """Markdown: per eraser, the held-out probes before → after erasure (means over runs); [] without records."""
    rows = []
    for eraser in erasers_of(list(cells)):
        row = erasure_row(eraser, [r for c in cells if c.eraser == eraser for r in c.runs])
        if row is not None:
            rows.append(row)
    if not rows:
        return []
    header = ["eraser", *(f"{label}, before → after" for _, label in PROBES), "chance", "criterion met", "runs"]
    return [
        "### Erasure achieved",
        "",
        "Held-out accuracy of a linear probe and a QDA trained on the training split, before → after erasure, "
        "averaged over the runs (results.json `data_diagnostics.erasure`); the criterion is the paper's \"almost no "
        'quadratically available information" (Sec. 2.4), judged for the gradient eraser (probes within '
        "`eraser.checks.criterion_points` of chance).",
        "",
        markdown_table(header, rows),
        "",
    ]
