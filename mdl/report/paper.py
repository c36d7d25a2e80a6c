"""Compare a sweep's cells with the numbers the paper publishes (shipped in ``mdl/paper_values``).

Why: a reproduction is judged against the paper's own table, so the report puts ours next to
theirs and says, with one explicit rule, which cells disagree beyond the error bars.

Cells are matched by (data set, architecture, eraser): ``data.source`` (``+zscore`` when
``data.zscore`` is on), ``model.name`` and ``eraser.name`` of our runs against the ``dataset``, ``architecture`` and ``eraser`` columns of a
paper table. Every row of ours (width, depth, option labels, ...) is compared with the same paper
cell, because the paper does not say at which width and depth its table was measured.
A paper table is compared automatically with the cells of its data set; ``compare_to`` names a
table to compare regardless of data set (the CI smoke runs on digits), and the section then says
in its header that the data sets differ.

Flag rule (``FLAG_SIGMAS`` = 2): a cell is flagged when
``|ours - paper| > 2 * sqrt(sd_paper^2 + se_ours^2 + r^2)``, where sd_paper is the paper's
seed-to-seed standard deviation, se_ours = sd_ours / sqrt(n_ours) (0 with one seed) and r half a
unit of the paper's last printed digit. See ``RULE_TEXT`` for the reasons.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from mdl.report.sweep import Sweep, eraser_sort_key, sortable
from mdl.report.stats import Cell, cell_value
from mdl.report.tables import _num, fmt, markdown_table, write_csv

FLAG_SIGMAS = 2.0
PAPER_VALUES = "paper_values"
RULE_TEXT = (
    "Flagged (**yes**) when |Δ| > {k:g}·σ with σ = √(sd_paper² + se_ours² + r²): sd_paper is the paper's "
    "standard deviation over its seeds, se_ours = sd_ours/√n_ours our mean's standard error (0 with one seed: "
    "our spread is then unknown), r = half a unit of the paper's last printed digit (its values are rounded; "
    "MLP × QLEACE prints ± 0.00). The tolerance uses the paper's sd, not its standard error sd/√5, because the "
    "question is whether our mean lies where one more run of the paper's experiment could land: settings a "
    "reproduction cannot pin down (per-seed data splits, bf16, hardware) move a result at least as much as a "
    "seed does, and an sd estimated from 5 seeds is itself uncertain. With normal errors about 1 cell in 20 "
    "that agrees is flagged by chance (about one of Appendix C's 20): a flag is a reason to look, not a verdict."
)


@dataclass(frozen=True)
class PaperCell:
    """One published number: mean ± sd over n_seeds, in ``unit``, of results.json key ``metric``."""

    table: str
    location: str  # where in the paper (section, table, row / column)
    dataset: str  # this project's data.source
    dataset_paper: str
    arch: str  # this project's model.name
    arch_paper: str
    eraser: str  # this project's eraser.name
    eraser_paper: str
    metric: str
    unit: str
    mean: float
    sd: float
    n_seeds: int
    printed: str  # as the paper prints it

    @property
    def rounding(self) -> float:
        """Half a unit of the last printed digit of the mean (0.005 for '7.14')."""
        decimals = len(self.printed.split("±")[0].strip().partition(".")[2])
        return 0.5 * 10.0**-decimals


@dataclass(frozen=True)
class PaperTable:
    name: str
    cells: tuple[PaperCell, ...]
    notes: tuple[str, ...]  # the file's comment lines: source, units, caveats

    @property
    def datasets(self) -> list[str]:
        return sorted({c.dataset for c in self.cells})

    def title(self) -> str:
        return f"`{self.name}` ({', '.join(sorted({c.dataset_paper for c in self.cells}))})"

    def get(self, dataset: str | None, arch: str, eraser: str) -> PaperCell | None:
        return next(
            (c for c in self.cells if c.arch == arch and c.eraser == eraser and dataset in (None, c.dataset)), None
        )


def _values_dir():
    return resources.files("mdl") / PAPER_VALUES


def available_tables() -> list[str]:
    """Names of the shipped paper tables (file names without .csv)."""
    return sorted(p.name[:-4] for p in _values_dir().iterdir() if p.name.endswith(".csv"))


def load_paper_table(name: str) -> PaperTable:
    """Read ``mdl/paper_values/<name>.csv``: '#' comment lines, then a CSV header and one line per cell."""
    if name not in available_tables():
        raise ValueError(f"no paper table {name!r}; shipped: {', '.join(available_tables())}")
    lines = (_values_dir() / f"{name}.csv").read_text(encoding="utf-8").splitlines()
    notes = tuple(line[1:].strip() for line in lines if line.startswith("#"))
    rows = csv.DictReader(line for line in lines if line.strip() and not line.startswith("#"))
    cells = tuple(
        PaperCell(
            table=r["table"],
            location=r["paper_location"],
            dataset=r["dataset"],
            dataset_paper=r["dataset_paper"],
            arch=r["architecture"],
            arch_paper=r["architecture_paper"],
            eraser=r["eraser"],
            eraser_paper=r["eraser_paper"],
            metric=r["metric"],
            unit=r["unit"],
            mean=float(r["mean"]),
            sd=float(r["sd"]),
            n_seeds=int(r["n_seeds"]),
            printed=r["printed"],
        )
        for r in rows
    )
    keys = [(c.dataset, c.arch, c.eraser) for c in cells]
    if not cells:
        raise ValueError(f"paper table {name}: no cells")
    if len(set(keys)) != len(keys):
        raise ValueError(f"paper table {name}: a (data set, architecture, eraser) cell appears twice")
    return PaperTable(name, cells, notes)


# --- matching and the flag rule ---------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    cell: Cell
    paper: PaperCell
    dataset: str  # ours
    mean: float  # ours
    sd: float  # ours, sample std (NaN with one seed)
    n: int  # ours: seeds reporting the metric

    @property
    def se(self) -> float:
        """Standard error of our mean; 0 with one seed (no spread to estimate from)."""
        return 0.0 if self.n < 2 or math.isnan(self.sd) else self.sd / math.sqrt(self.n)

    @property
    def delta(self) -> float:
        return self.mean - self.paper.mean

    @property
    def sigma(self) -> float:
        return math.sqrt(self.paper.sd**2 + self.se**2 + self.paper.rounding**2)

    @property
    def z_paper(self) -> float:
        """Δ in units of the paper's sd; NaN when the paper prints sd 0.00 (its sd rounds to zero, so no unit to count
        in: σ, which adds the rounding, still measures the difference)."""
        return self.delta / self.paper.sd if self.paper.sd > 0 else math.nan

    @property
    def z(self) -> float:
        return self.delta / self.sigma

    @property
    def flagged(self) -> bool:
        return abs(self.delta) > FLAG_SIGMAS * self.sigma

    @property
    def same_dataset(self) -> bool:
        return self.dataset == self.paper.dataset


def cell_dataset(cell: Cell) -> str:
    """The data set a cell's runs trained on as the paper tables name it: ``data.source``, with
    ``+zscore`` when the data was z-scored before erasure (``data.zscore``; Figure 16's condition)."""
    return str(cell_value(cell, "data.source")) + ("+zscore" if cell_value(cell, "data.zscore") else "")


def compare(cells: Sequence[Cell], table: PaperTable, any_dataset: bool = False) -> list[Comparison]:
    """Our cells that have a paper cell: same data set (any data set with ``any_dataset``), model
    and eraser. With several paper data sets and ``any_dataset``, the first one is used."""
    out = []
    for c in cells:
        dataset, arch, eraser = cell_dataset(c), cell_value(c, "model.name"), cell_value(c, "eraser.name")
        paper = table.get(dataset, str(arch), str(eraser))
        if paper is None and any_dataset:
            paper = table.get(None, str(arch), str(eraser))
        if paper is None:
            continue
        mean, sd, n = c.mean_std(paper.metric)
        if n:
            out.append(Comparison(c, paper, str(dataset), mean, sd, n))
    return sorted(
        out,
        key=lambda x: (table.cells.index(x.paper), x.cell.arch, sortable(x.cell.row), eraser_sort_key(x.cell.eraser)),
    )


def tables_to_compare(cells: Sequence[Cell], compare_to: str | None) -> list[tuple[PaperTable, bool]]:
    """(table, any_dataset) pairs: ``compare_to`` forced across data sets, else every shipped table
    holding one of our cells' data sets."""
    if compare_to:
        return [(load_paper_table(compare_to), True)]
    ours = {cell_dataset(c) for c in cells}
    tables = [load_paper_table(name) for name in available_tables()]
    return [(t, False) for t in tables if ours & set(t.datasets)]


# --- the report section ------------------------------------------------------------------------


ZERO_PAPER_SD = "n/a (paper sd 0.00)"  # the Δ / sd_paper cell of a paper value printed ± 0.00 (see Δ / σ)


def signed(x: float, digits: int = 2) -> str:
    """A difference with its sign (+0.05, −∞, n/a): the comparison tables' Δ columns."""
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "+∞" if x > 0 else "−∞"
    return f"{x:+.{digits}f}"


def paper_section(sweep: Sweep, cells: Sequence[Cell], compare_to: str | None) -> tuple[list[str], list[list[Any]]]:
    """Markdown lines of the 'Comparison with the paper' section and the rows of paper_comparison.csv."""
    md = ["## Comparison with the paper\n"]
    rows: list[list[Any]] = []
    pairs = tables_to_compare(cells, compare_to)
    if not pairs:
        ours = sorted({str(cell_value(c, "data.source")) for c in cells})
        shipped = "; ".join(f"{n} ({', '.join(load_paper_table(n).datasets)})" for n in available_tables())
        return [
            *md,
            f"No paper table covers the data set(s) of these runs ({', '.join(ours)}); shipped tables: "
            f"{shipped}. Pass `--compare-to NAME` (config: `report=NAME` / "
            "`hydra.callbacks.report.compare_to=NAME`) to compare anyway.",
            "",
        ], rows
    for table, any_dataset in pairs:
        found = compare(cells, table, any_dataset)
        md += _table_section(sweep, table, found, any_dataset)
        for x in found:
            rows.append(
                [
                    table.name,
                    x.paper.location,
                    x.dataset,
                    x.paper.dataset,
                    x.cell.arch,
                    *x.cell.row,
                    x.cell.eraser,
                    x.paper.metric,
                    x.paper.unit,
                    x.mean,
                    x.sd,
                    x.n,
                    x.se,
                    x.paper.mean,
                    x.paper.sd,
                    x.paper.n_seeds,
                    x.paper.rounding,
                    x.delta,
                    x.z_paper,
                    x.sigma,
                    x.z,
                    int(x.flagged),
                ]
            )
    return md, rows


def comparison_header(sweep: Sweep) -> list[str]:
    """The columns of paper_comparison.csv: the cell (with the sweep's row keys), ours, the paper's and the
    differences in both units, so the CSV can be read without the report."""
    return [
        "table",
        "paper_location",
        "dataset",
        "paper_dataset",
        "architecture",
        *sweep.row_keys,
        "eraser",
        "metric",
        "unit",
        "ours_mean",
        "ours_std",
        "ours_n",
        "ours_se",
        "paper_mean",
        "paper_std",
        "paper_n_seeds",
        "paper_rounding",
        "delta",
        "delta_over_paper_std",
        "sigma",
        "delta_over_sigma",
        "flagged",
    ]


def _table_section(sweep: Sweep, table: PaperTable, found: list[Comparison], any_dataset: bool) -> list[str]:
    theirs = ", ".join(sorted({c.dataset_paper for c in table.cells}))
    ours = sorted({x.dataset for x in found})
    differ = any(not x.same_dataset for x in found)
    md = [f"### Paper table {table.title()}: ours vs the paper's\n"]
    if differ:
        md.append(
            f"**Data sets differ: ours {', '.join(ours)}, the paper's {theirs}.** Compared on request "
            f"(`compare_to={table.name}`) by architecture × eraser only: the differences below say nothing about "
            "agreement with the paper; the section shows the comparison works.\n"
        )
    first = table.cells[0]
    md += [
        f"Metric `{first.metric}` ({first.unit}); source: the paper's {first.location.split(':')[0]} (values, "
        f"units and caveats in `mdl/paper_values/{table.name}.csv`). Cells matched by (data set, "
        "architecture, eraser); each of our rows is compared with the same paper cell (the paper gives no width or "
        "depth for this table). Ours: mean ± sample std (ddof = 1) over seeds (n); Δ = ours − paper.\n",
        RULE_TEXT.format(k=FLAG_SIGMAS) + "\n",
    ]
    if not found:
        md += [
            f"No cell of ours matches this table's architectures × erasers "
            f"({', '.join(sorted({c.arch for c in table.cells}))} × {', '.join(sorted({c.eraser for c in table.cells}))}).",
            "",
        ]
        return md
    header = [
        "data (ours → paper)",
        "architecture",
        *sweep.row_names(),
        "eraser",
        "ours",
        "paper",
        "Δ",
        "Δ / sd_paper",
        "Δ / σ",
        f"beyond {FLAG_SIGMAS:g}σ",
    ]
    md += [markdown_table(header, [comparison_row(x) for x in found]), ""]
    flagged = [x for x in found if x.flagged]
    md.append(
        f"{len(flagged)} of {len(found)} compared cell(s) beyond {FLAG_SIGMAS:g}σ"
        + (
            f": {', '.join(f'{x.cell.arch} {sweep.describe(x.cell.row)} {x.cell.eraser}'.replace('  ', ' ') for x in flagged)}."
            if flagged
            else "."
        )
    )
    matched = {(x.paper.arch, x.paper.eraser) for x in found}
    unmatched = [c for c in table.cells if (c.arch, c.eraser) not in matched]
    if unmatched:
        md.append(
            f"Paper cells with no run here: {', '.join(f'{c.arch_paper} × {c.eraser_paper}' for c in unmatched)}."
        )
    return [*md, ""]


def comparison_row(x: Comparison, z_paper: bool = True) -> list[str]:
    """A Markdown row comparing a cell with the paper: data sets, cell, ours, the paper's, Δ, Δ / sd_paper (unless
    ``z_paper`` is false), Δ / σ and the flag."""
    return [
        x.dataset if x.same_dataset else f"{x.dataset} → {x.paper.dataset}",
        x.cell.arch,
        *map(str, x.cell.row),
        x.cell.eraser,
        fmt(x.mean, x.sd, x.n),
        f"{x.paper.printed} (n={x.paper.n_seeds})",
        signed(x.delta),
        *([signed(x.z_paper, 1) if x.paper.sd > 0 else ZERO_PAPER_SD] if z_paper else []),
        signed(x.z, 1),
        "**yes**" if x.flagged else "no",
    ]


def write_comparison_csv(path: Path, sweep: Sweep, rows: list[list[Any]]) -> Path:

    return write_csv(
        path, comparison_header(sweep), ([_num(v) if isinstance(v, float) else v for v in r] for r in rows)
    )
