"""Tables of the report: Markdown, CSV and LaTeX text from cells (shared by build.py and paper.py)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from mdl.report.sweep import Sweep
from mdl.report.stats import METRICS, Cell, erasers_of, rows_of

PARTIAL_MARK = "†"


def fmt(mean: float, std: float, n: int, digits: int = 2) -> str:
    if n == 0 or math.isnan(mean):
        return "—"
    spread = "n/a" if math.isnan(std) else f"{std:.{digits}f}"
    return f"{mean:.{digits}f} ± {spread} (n={n})"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def grid(sweep: Sweep, cells: list[Cell], text: Callable[[Cell], str]) -> str:
    """Architecture (and row keys) down, erasers across: ``text(cell)`` per cell, ``missing`` where there is none."""
    by_key = {(c.arch, c.row, c.eraser): c for c in cells}
    erasers = erasers_of(cells)
    body = [
        [
            arch,
            *map(str, row),
            *(text(by_key[arch, row, e]) if (arch, row, e) in by_key else "missing" for e in erasers),
        ]
        for arch, row in rows_of(cells)
    ]
    return markdown_table(["architecture", *sweep.row_names(), *erasers], body)


def pivot(sweep: Sweep, cells: list[Cell], metric: str, max_seeds: int, digits: int = 2) -> str:
    """'mean ± std (n)' of ``metric`` per cell (``grid``), marked when the cell has fewer seeds than the fullest."""
    return grid(
        sweep,
        cells,
        lambda c: fmt(*c.mean_std(metric), digits=digits) + (f" {PARTIAL_MARK}" if c.n < max_seeds else ""),
    )


# --- CSV ---------------------------------------------------------------------------------------


def write_csv(path: Path, header: list[str], rows: Iterable[Sequence[Any]]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _num(x: Any) -> str:
    """CSV text of a number: ints as ints, floats in full precision, missing / NaN as empty."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and math.isnan(x)):
        return ""
    return str(x) if isinstance(x, int) else repr(float(x))


LATEX_METRICS = ("paper_mdl", "online_bits_per_example", "final_val_loss")


LATEX_SPECIAL = {
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "\\": r"\textbackslash{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
    "\n": " ",
}  # < > |: other glyphs in OT1


def latex_escape(text: Any) -> str:
    """Text as LaTeX prints it literally: every character LaTeX reads as markup replaced by its escape."""
    return "".join(LATEX_SPECIAL.get(ch, ch) for ch in str(text))


def write_latex_table(path: Path, sweep: Sweep, cells: list[Cell]) -> Path:
    """The table as a plain LaTeX tabular (no package needed: rules are \\hline): mean ± sample std over
    seeds, n when seeds are missing, erasers under the paper's names."""
    from mdl.report.style import display_name

    keys = list(sweep.row_keys)
    header = ["architecture", *keys, "eraser", *(f"{METRICS[m][0]} ({METRICS[m][1]})" for m in LATEX_METRICS)]
    max_n = max((c.n for c in cells), default=0)
    lines = [
        f"\\begin{{tabular}}{{{'l' * (len(keys) + 2)}{'r' * len(LATEX_METRICS)}}}",
        "\\hline",
        " & ".join(map(latex_escape, header)) + " \\\\",
        "\\hline",
    ]
    for c in cells:
        values = []
        for metric in LATEX_METRICS:
            mean, std, n = c.mean_std(metric)
            text = "--" if n == 0 else f"{mean:.3f}" + (f" $\\pm$ {std:.3f}" if n > 1 else "")
            values.append(text + (f" ($n$={n})" if 0 < n < max_n else ""))
        lines.append(
            " & ".join([latex_escape(c.arch), *map(latex_escape, c.row), latex_escape(display_name(c.eraser)), *values])
            + " \\\\"
        )
    lines += ["\\hline", "\\end{tabular}", ""]
    path.write_text("\n".join(lines))
    return path


def _triple(cell: Cell, metric: str) -> list[str]:
    mean, std, n = cell.mean_std(metric)
    return [_num(mean), _num(std), str(n)]
