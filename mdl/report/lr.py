"""The learning-rate search's answer: per architecture, other settings and eraser, the swept
``optimizer.lr`` with the lowest mean paper MDL, and whether it lies at the edge of the grid (then
the grid should be extended). Written into report.md when a sweep varies ``optimizer.lr``
(``+experiment=lr_search``). muP's premise is that an lr tuned at the base width transfers to every
width (Yang et al. 2021, Tensor Programs V), so the search runs at ``model.base_width``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mdl.report.runs import Sweep
from mdl.report.stats import Cell

LR_KEY = "optimizer.lr"


@dataclass(frozen=True)
class LrChoice:
    arch: str
    setting: str  # the other row keys, described
    eraser: str
    lr: float
    mean: float
    n: int
    grid: tuple[float, ...]

    @property
    def at_edge(self) -> bool:
        return len(self.grid) > 1 and self.lr in (self.grid[0], self.grid[-1])


def best_learning_rates(sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl") -> list[LrChoice]:
    if LR_KEY not in sweep.row_keys:
        return []
    i = sweep.row_keys.index(LR_KEY)
    groups: dict[tuple[str, tuple[Any, ...], str], list[tuple[float, float, int]]] = {}
    for c in cells:
        mean, _, n = c.mean_std(metric)
        if n and isinstance(c.row[i], (int, float)) and not math.isnan(mean):
            groups.setdefault((c.arch, c.row[:i] + (None,) + c.row[i + 1:], c.eraser), []).append((float(c.row[i]), mean, n))
    choices = []
    for (arch, other, eraser), points in sorted(groups.items(), key=lambda kv: str(kv[0])):
        lr, mean, n = min(points, key=lambda p: p[1])
        choices.append(LrChoice(arch, sweep.describe(other, skip=LR_KEY), eraser, lr, mean, n,
                                tuple(sorted(p[0] for p in points))))
    return choices


def lr_section(sweep: Sweep, cells: list[Cell]) -> list[str]:
    choices = best_learning_rates(sweep, cells)
    if not choices:
        return []
    md = ["## Learning rate\n",
          f"The swept `{LR_KEY}` with the lowest mean paper MDL, per architecture, setting and eraser (muP: tuned at "
          "the base width, it transfers to the others). Use it with `optimizer.lr=<value>` (or the data set's "
          "`data.lr`) in the real sweep.\n",
          "| architecture | setting | eraser | best lr | paper MDL | n | grid |", "|---|---|---|---|---|---|---|"]
    for c in choices:
        edge = " (at the edge of the grid: extend it)" if c.at_edge else ""
        md.append(f"| {c.arch} | {c.setting or '-'} | {c.eraser} | {c.lr:g}{edge} | {c.mean:.4f} | {c.n} | "
                  f"{', '.join(f'{g:g}' for g in c.grid)} |")
    return [*md, ""]
