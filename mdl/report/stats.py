"""Statistics over seeds: table cells, coverage (partial / missing cells), loss curves, backfiring.

Spread over seeds is always the *sample* standard deviation (ddof = 1); a cell with one seed has
no spread (NaN, shown as "n/a"). Cells are never padded or imputed: a cell with fewer seeds than
the fullest cell of the sweep is listed as partial, an (architecture, row, eraser) combination
with no run at all as missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdl.report.sweep import CONTROL, Run, Sweep, eraser_sort_key

METRICS = {
    # results.json key: (column label, unit)
    "paper_mdl": ("paper MDL", "bits/sample"),
    "online_bits_per_example": ("online code length", "bits/example"),
    "online_codelength_bits": ("online code length", "bits"),
    "final_val_loss": ("final val loss", "nats"),
}


@dataclass
class Cell:
    arch: str
    row: tuple[Any, ...]
    eraser: str
    runs: list[Run] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.runs)

    def values(self, metric: str) -> np.ndarray:
        vals = [r.metric(metric) for r in self.runs]
        return np.array([v for v in vals if v is not None], dtype=float)

    def mean_std(self, metric: str) -> tuple[float, float, int]:
        """Mean, sample std (ddof=1, NaN for one value) and count of runs that report ``metric``."""
        v = self.values(metric)
        if v.size == 0:
            return math.nan, math.nan, 0
        return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else math.nan, int(v.size)


def cell_value(cell: Cell, key: str) -> Any:
    """A config value of a cell's first run (data.source, model.name, ...), decoded; None if absent."""
    encoded = cell.runs[0].flat.get(key) if cell.runs else None
    return json.loads(encoded) if encoded is not None else None


def chance_level(cells: list[Cell], metric: str) -> float | None:
    """What a uniform predictor scores on ``metric`` when every run shares classes and block schedule:
    paper MDL log2 K * sum(t_2..t_S) / N (mdl.run.console.summary), online code log2 K, loss ln K nats."""
    runs = [r.results for c in cells for r in c.runs]
    keys = {(r.get("num_classes"), tuple(r.get("boundaries") or ())) for r in runs}
    if len(keys) != 1:
        return None
    ((k, boundaries),) = keys
    if not k:
        return None
    if metric == "paper_mdl":
        return math.log2(k) * sum(boundaries[1:]) / boundaries[-1] if len(boundaries) > 1 else None
    return {"online_bits_per_example": math.log2(k), "val_loss": math.log(k)}.get(metric)


@dataclass
class Coverage:
    max_seeds: int
    partial: list[tuple[Cell, list[str]]]  # cell, labels of the seeds it lacks
    missing: list[tuple[str, tuple[Any, ...], str]]  # (arch, row, eraser) with no run
    metric_gaps: list[tuple[Cell, str, int]]  # cell, metric, runs lacking it


def build_cells(sweep: Sweep) -> list[Cell]:
    cells: dict[tuple, Cell] = {}
    for run in sweep.runs:
        key = (run.arch, run.row, run.eraser)
        cells.setdefault(key, Cell(run.arch, run.row, run.eraser)).runs.append(run)
    return list(cells.values())


def rows_of(cells: list[Cell]) -> list[tuple[str, tuple[Any, ...]]]:
    return list(dict.fromkeys((c.arch, c.row) for c in cells))


def erasers_of(cells: list[Cell]) -> list[str]:
    return sorted({c.eraser for c in cells}, key=eraser_sort_key)


def coverage(sweep: Sweep, cells: list[Cell]) -> Coverage:
    """Which cells have fewer seeds than the fullest one, which combinations are absent."""
    max_seeds = max((c.n for c in cells), default=0)
    all_reps = sorted({r.replicate for c in cells for r in c.runs}, key=str)
    partial = []
    for c in cells:
        if c.n < max_seeds:
            have = {r.replicate for r in c.runs}
            lacking = [rep for rep in all_reps if rep not in have]
            partial.append((c, [sweep.replicate_label(rep) for rep in lacking]))
    present = {(c.arch, c.row, c.eraser) for c in cells}
    missing = [(a, row, e) for a, row in rows_of(cells) for e in erasers_of(cells) if (a, row, e) not in present]
    gaps = []
    for c in cells:
        for metric in ("paper_mdl", "online_bits_per_example", "final_val_loss"):
            lacking = c.n - c.values(metric).size
            if lacking:
                gaps.append((c, metric, lacking))
    return Coverage(max_seeds, partial, missing, gaps)


def row_differences(cells: list[Cell]) -> list[tuple[str, tuple[Any, ...], str, dict[str, str]]]:
    """Settings (outside model.* and eraser.*) that differ between the erasers of one row, e.g.
    eval_labels set for QLEACE only: the row still compares them, the report says so.
    Returns (arch, row, key, {eraser: value})."""
    out = []
    for arch, row in rows_of(cells):
        members = [c for c in cells if (c.arch, c.row) == (arch, row)]
        keys = sorted({k for c in members for r in c.runs for k in r.flat if not k.startswith(("model.", "eraser."))})
        for key in keys:
            values = {c.eraser: c.runs[0].flat.get(key, "(absent)") for c in members}
            if len(set(values.values())) > 1:
                out.append((arch, row, key, values))
    return out


def with_controls(cells: list[Cell]) -> list[tuple[Cell, Cell]]:
    """(erased cell, the control of its row) for every erased cell whose row has a control, in ``cells``' order."""
    controls = {(c.arch, c.row): c for c in cells if c.eraser == CONTROL}
    return [(c, controls[c.arch, c.row]) for c in cells if c.eraser != CONTROL and (c.arch, c.row) in controls]


# --- loss curves -------------------------------------------------------------------------------


@dataclass
class CurveStats:
    """Per-epoch statistics over the seeds of a cell, on the epochs every seed reached."""

    mean: np.ndarray
    std: np.ndarray  # sample std (ddof=1); NaN with one seed
    low: np.ndarray  # min over seeds
    high: np.ndarray  # max over seeds
    n_seeds: int


def curve_stats(cell: Cell, key: str = "val_loss_curve") -> CurveStats | None:
    curves = [
        np.asarray(r.results[key], dtype=float)
        for r in cell.runs
        if isinstance(r.results.get(key), list) and len(r.results[key]) > 0
    ]
    if not curves:
        return None
    common = min(len(c) for c in curves)
    stack = np.stack([c[:common] for c in curves])
    std = stack.std(axis=0, ddof=1) if len(curves) > 1 else np.full(common, math.nan)
    return CurveStats(stack.mean(0), std, stack.min(0), stack.max(0), len(curves))


# --- backfiring --------------------------------------------------------------------------------


@dataclass
class Backfire:
    early_gap: float  # mean(erased - control) over the early window, nats (> 0 required)
    late_gap: float  # mean(erased - control) over the late window, nats (< 0 required)
    crossing_epoch: int  # 1-based epoch at which erased first drops below control for the last time
    epochs: int  # length T of the compared range


def window(length: int, fraction: float) -> int:
    return max(1, math.ceil(fraction * length))


def detect_backfire(
    control: np.ndarray, erased: np.ndarray, early_fraction: float = 0.25, late_fraction: float = 0.25
) -> Backfire | None:
    """Flag an erased loss curve that starts above the control's and ends below it.

    Both curves are compared on their common epochs 1..T (T = the shorter length).
    With d(t) = erased(t) - control(t):
      early window = epochs 1 .. ceil(early_fraction * T), late window = the last
      ceil(late_fraction * T) epochs; early gap = mean of d over the early window, late gap =
      mean of d over the late window. Backfiring means early gap > 0 and late gap < 0 (needs
      T >= 2 and non-overlapping windows, else nothing is flagged).
    The crossing epoch is the last epoch t (1-based) with d(t-1) >= 0 > d(t): the erased curve
    goes below the control's there and, if it never re-crosses, stays below to the end.
    """
    length = min(len(control), len(erased))
    early, late = window(length, early_fraction), window(length, late_fraction)
    if length < 2 or early + late > length:
        return None
    d = np.asarray(erased[:length], float) - np.asarray(control[:length], float)
    early_gap, late_gap = float(d[:early].mean()), float(d[-late:].mean())
    if not (early_gap > 0 and late_gap < 0):
        return None
    downs = [t for t in range(1, length) if d[t - 1] >= 0 > d[t]]
    return Backfire(early_gap, late_gap, crossing_epoch=downs[-1] + 1, epochs=length)


@dataclass
class BackfireFlag:
    arch: str
    row: tuple[Any, ...]
    eraser: str
    result: Backfire


def backfire_flags(cells: list[Cell], early_fraction: float = 0.25, late_fraction: float = 0.25) -> list[BackfireFlag]:
    """Compare each erased cell's mean val-loss curve with the control of the same row."""
    flags = []
    for c, control in sorted(
        with_controls(cells), key=lambda cc: (cc[0].arch, str(cc[0].row), eraser_sort_key(cc[0].eraser))
    ):
        cs, es = curve_stats(control), curve_stats(c)
        if cs is None or es is None:
            continue
        hit = detect_backfire(cs.mean, es.mean, early_fraction, late_fraction)
        if hit is not None:
            flags.append(BackfireFlag(c.arch, c.row, c.eraser, hit))
    return flags


def mdl_backfire(cells: list[Cell], metric: str = "paper_mdl") -> list[tuple[Cell, float, float]]:
    """Erased cells whose mean MDL is below the control's of the same row (the paper's ConvNeXt
    + QLEACE case): (cell, erased mean, control mean)."""
    out = []
    for c, control in with_controls(cells):
        m, _, n = c.mean_std(metric)
        mc, _, nc = control.mean_std(metric)
        if n and nc and m < mc:
            out.append((c, m, mc))
    return out


# --- Figure 3: MDL increase over the control, per width ---------------------------------------


@dataclass
class Increase:
    """One point of Figure 3: an erased cell's mean minus its row's control mean."""

    arch: str
    row: tuple[Any, ...]  # the cell's row (width included when it is a row key)
    eraser: str
    width: float
    increase: float  # mean(erased) - mean(control), metric units
    se: float  # sqrt(sd_e^2/n_e + sd_c^2/n_c); NaN unless both cells have >= 2 seeds
    relative: float  # increase / mean(control)
    control_mean: float
    n_erased: int
    n_control: int


def _width_of(sweep: Sweep, cell: Cell) -> float | None:
    """The cell's width: its row value when width varies, else the config value of its runs."""
    value = cell.row[sweep.row_keys.index("width")] if "width" in sweep.row_keys else cell_value(cell, "width")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def mdl_increase(sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl") -> list[Increase]:
    """Per erased cell with a control in the same row (same architecture, width and other row
    keys): the increase of the mean ``metric`` over the control's, and its standard error
    (unpaired: seeds of the two cells need not share data splits)."""
    out = []
    for c, control in with_controls(cells):
        width = _width_of(sweep, c)
        if width is None:
            continue
        (m, s, n), (mc, sc, nc) = c.mean_std(metric), control.mean_std(metric)
        if not (n and nc):
            continue
        se = math.sqrt(s**2 / n + sc**2 / nc)  # NaN propagates from a one-seed cell
        out.append(Increase(c.arch, c.row, c.eraser, width, m - mc, se, (m - mc) / mc if mc else math.nan, mc, n, nc))
    return sorted(out, key=lambda i: (i.arch, eraser_sort_key(i.eraser), i.width, str(i.row)))
