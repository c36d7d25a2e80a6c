"""A sweep that ran both training loops (``protocol=original,sound``): a table per protocol, side by side.

Why: the paper's numbers were made by the original loop (docs/differences-from-original.md), whose
backtracking can leave a fit at the untrained model (a uniform predictor, chance level), so a protocol's
paper MDL is read beside the paper's value and beside how many of its prefix fits never left the untrained
model: a cell at chance because nothing was learnable and one at chance because the loop stuck look alike
otherwise. A block is at the untrained model when its kept weights had no training behind them
(results.json ``blocks[i].best_after_epochs`` = 0); runs from before that key show "n/a".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from mdl.report.paper import FLAG_SIGMAS, compare, comparison_row, tables_to_compare
from mdl.report.sweep import CODE_VERSION_KEY, PROTOCOL_KEY, Run, Sweep, sortable
from mdl.report.stats import Cell, erasers_of
from mdl.report.tables import fmt, grid, markdown_table, pivot


def untrained_blocks(run: Run) -> tuple[int, int] | None:
    """(blocks whose kept weights are the untrained model, blocks) of one run; None if a block lacks the record."""
    blocks = run.results.get("blocks") or []
    kept = [b.get("best_after_epochs") for b in blocks]
    if not blocks or any(not isinstance(k, int) or isinstance(k, bool) for k in kept):
        return None
    return sum(k == 0 for k in kept), len(kept)


def untrained_text(cell: Cell) -> str:
    """'12 of 27 (5, 3, 4)': a cell's blocks at the untrained model in total and per seed, 'n/a' if unrecorded."""
    counts = [untrained_blocks(r) for r in cell.runs]
    if not counts or any(c is None for c in counts):
        return "n/a"
    stuck, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return f"{stuck} of {total}" + (f" ({', '.join(str(c[0]) for c in counts)})" if len(counts) > 1 else "")


def protocols_of(sweep: Sweep) -> list[str]:
    """The protocols a sweep's row key ``protocol.name`` takes; [] when it is not a row key (one protocol)."""
    if PROTOCOL_KEY not in sweep.row_keys:
        return []
    at = sweep.row_keys.index(PROTOCOL_KEY)
    return sorted({str(r.row[at]) for r in sweep.runs})


def split_by_protocol(sweep: Sweep, cells: Sequence[Cell]) -> list[tuple[str, Sweep, list[Cell]]]:
    """Per protocol: the sweep and its cells with ``protocol.name`` taken out of the row keys."""
    if not protocols_of(sweep):
        return []
    at = sweep.row_keys.index(PROTOCOL_KEY)
    sub = replace(sweep, row_keys=[k for k in sweep.row_keys if k != PROTOCOL_KEY])
    out = []
    for name in protocols_of(sweep):
        mine = [Cell(c.arch, c.row[:at] + c.row[at + 1 :], c.eraser, c.runs) for c in cells if str(c.row[at]) == name]
        out.append((name, replace(sub, runs=[r for c in mine for r in c.runs]), mine))
    return out


def paper_values(cells: Sequence[Cell], compare_to: str | None) -> dict[tuple[str, str], str]:
    """(architecture, eraser) -> the paper's printed value of the first paper table that matches, as printed."""
    found: dict[tuple[str, str], str] = {}
    for table, any_dataset in tables_to_compare(cells, compare_to):
        for x in compare(cells, table, any_dataset):
            found.setdefault((x.cell.arch, x.cell.eraser), f"{x.paper.printed} ({x.paper.dataset_paper})")
    return found


def protocol_section(sweep: Sweep, cells: Sequence[Cell], max_seeds: int, compare_to: str | None) -> list[str]:
    """Markdown: the protocols side by side with the paper's values and the blocks at the untrained model, then
    each protocol's own paper-MDL table; [] when the sweep ran one protocol."""
    parts = split_by_protocol(sweep, cells)
    if not parts:
        return []
    names = [name for name, _, _ in parts]
    base, version_at = _aligned_on_versions(parts)
    by_key = {(name, c.arch, _drop(c.row, version_at), c.eraser): c for name, _, mine in parts for c in mine}
    every = [c for _, _, mine in parts for c in mine]
    order = {e: i for i, e in enumerate(erasers_of(every))}
    rows = sorted({(a, r, e) for _, a, r, e in by_key}, key=lambda k: (k[0], sortable(k[1]), order[k[2]]))
    paper = paper_values(every, compare_to)
    body = []
    for arch, row, eraser in rows:
        line: list[Any] = [arch, *map(str, row), eraser]
        for name in names:
            cell = by_key.get((name, arch, row, eraser))
            version = "" if cell is None or version_at is None else f" [{cell.row[version_at]}]"
            line += (
                ["missing", ""] if cell is None else [fmt(*cell.mean_std("paper_mdl")) + version, untrained_text(cell)]
            )
        line.append(paper.get((arch, eraser), "—"))
        body.append(line)
    header = ["architecture", *base.row_names(), "eraser"]
    for name in names:
        header += [f"paper MDL, {name}", f"blocks at the untrained model, {name}"]
    md = [
        "## Protocols side by side\n",
        f"The runs trained under {len(names)} protocols ({', '.join(f'`{n}`' for n in names)}; conf/protocol/, "
        "docs/differences-from-original.md). Paper MDL in bits per sample, mean ± sample std over seeds (n). "
        "Blocks at the untrained model: of all prefix fits of a cell's runs, those whose kept weights had no "
        "training behind them (results.json `blocks[i].best_after_epochs` = 0; per seed in brackets): such a fit "
        "scores as a uniform predictor, at chance. Paper: the printed value of the paper's table for the same "
        "architecture and eraser"
        + (
            " (data set as named)"
            if paper
            else "; none matches these runs' data set (`--compare-to NAME` compares anyway)"
        )
        + "."
        + (
            " Each protocol's runs come from one code version, shown in brackets: the rows line up across versions "
            "(the cells below keep them apart)."
            if version_at is not None
            else ""
        )
        + "\n",
        markdown_table([*header, "paper"], body),
        "",
    ]
    for name, sub, mine in parts:
        md += [
            f"### protocol={name}\n",
            "**Paper-compatible prequential MDL, bits per sample:**\n",
            pivot(sub, mine, "paper_mdl", max_seeds),
            "",
            "**Blocks at the untrained model** (of the cell's prefix fits; per seed in brackets):\n",
            grid(sub, mine, untrained_text),
            "",
            *_against_paper(sub, mine, compare_to),
        ]
    return md


def _aligned_on_versions(parts: list[tuple[str, Sweep, list[Cell]]]) -> tuple[Sweep, int | None]:
    """The side-by-side table's rows: without the ``code_version`` row key when each protocol's cell of a row has
    one version (runs of one protocol made now beside the other's made earlier and reused), so the protocols line
    up; returns the row keys' sweep and the version's index in a cell's row (None: rows keep it)."""
    base = parts[0][1]
    if CODE_VERSION_KEY not in base.row_keys:
        return base, None
    at = base.row_keys.index(CODE_VERSION_KEY)
    keys = [(name, c.arch, _drop(c.row, at), c.eraser) for name, _, mine in parts for c in mine]
    if len(set(keys)) < len(keys):  # a protocol's row holds cells of several versions: keep them apart
        return base, None
    return replace(base, row_keys=[k for k in base.row_keys if k != CODE_VERSION_KEY]), at


def _drop(row: tuple[Any, ...], at: int | None) -> tuple[Any, ...]:
    return row if at is None else row[:at] + row[at + 1 :]


def _against_paper(sweep: Sweep, cells: list[Cell], compare_to: str | None) -> list[str]:
    """One protocol's cells against the paper's (the flag rule of the section "Comparison with the paper")."""
    md = []
    for table, any_dataset in tables_to_compare(cells, compare_to):
        found = compare(cells, table, any_dataset)
        if not found:
            continue
        body = [comparison_row(x, z_paper=False) for x in found]
        md += [
            f"**Against the paper's table {table.title()}** (Δ = ours − paper; σ and the flag as in \"Comparison with "
            'the paper" below):\n',
            markdown_table(
                [
                    "data (ours → paper)",
                    "architecture",
                    *sweep.row_names(),
                    "eraser",
                    "ours",
                    "paper",
                    "Δ",
                    "Δ / σ",
                    f"beyond {FLAG_SIGMAS:g}σ",
                ],
                body,
            ),
            "",
        ]
    return md


def untrained_count(run: Run) -> int | None:
    """A run's blocks at the untrained model (runs.csv's column); None when unrecorded."""
    counts = untrained_blocks(run)
    return None if counts is None else counts[0]
