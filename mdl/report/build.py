"""``python -m mdl.report SWEEP_DIR... [--out DIR]``: the paper's table and figures from a sweep.

Reads every ``results.json`` below the given directories, groups runs into conditions (the
resolved config minus seeds and paths, see ``mdl.report.sweep``) and writes into ``--out``
(default ``<first SWEEP_DIR>/report``) a Markdown report with its PNG figures beside it plus CSVs:

    report.md          the Appendix-C table, the comparison with the paper's published values,
                       coverage, backfiring flags, figures (Figure 3 included), notes
    table.csv          one line per cell (architecture x row keys x eraser), n = 0 for missing ones
    paper_comparison.csv  ours vs the paper per matched cell: difference, in paper sds, flag
    mdl_increase.csv   Figure 3's data: each erased cell's MDL minus its row's control
    runs.csv           one line per run (the numbers the table averages; blocks at the untrained model)
    loss_curves.csv    per-epoch mean / std / min / max of the final fit's validation loss
    backfiring.csv     flagged (architecture, row, eraser) with early / late gaps and crossing epoch

Runs of several designs (runs that do not share their config keys: a paper preset beside a plain sweep, say)
get a report each, in a folder ``design<i>_<name>`` of ``--out``, and report.md puts their tables one after the
other. Row keys are the keys the sweeps varied, or those named by ``--rows``. A sweep over ``protocol`` (the
training loop) also gets the protocols side by side, each with the paper's values and its blocks left at the
untrained model (``mdl.report.protocols``).

Spread is the sample standard deviation over seeds (ddof = 1). Cells with fewer seeds than the
fullest cell are marked and listed, never silently averaged with the others. Runs of different code
versions (results.json ``code_version``, else ``git_sha``) go to different cells, told apart by a
``code_version`` column, unless ``--merge-code-versions``; when the runs come from more than one
version, a console line and report.md say how many and whether cells were split or merged.

The paper's published values ship in ``mdl/paper_values`` (``mdl.report.paper``): a table whose
data set the runs share is compared automatically; ``--compare-to NAME`` compares with a named
table whatever the data set (matching architecture x eraser; the section says the data sets differ).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from mdl.report.claims import claims_section
from mdl.report.csvs import write_csvs
from mdl.report.erasure import erasure_section
from mdl.report.figure1 import ImageLoader, default_image_loader, figure1
from mdl.report.figures import FigureFile, figure3, loss_figures, probe_figures, scaling_figures, slug
from mdl.report.protocols import protocol_section
from mdl.report.paper import available_tables, load_paper_table, paper_section, write_comparison_csv
from mdl.report.sweep import CONTROL, UNKNOWN_VERSION, Sweep, load_sweeps
from mdl.report.lr import lr_figures, lr_section, lr_transfer_figures
from mdl.run.sweep_jobs import MissingJob, missing_jobs
from mdl.report.tables import PARTIAL_MARK, markdown_table, pivot
from mdl.report.stats import (
    METRICS,
    BackfireFlag,
    Cell,
    Coverage,
    backfire_flags,
    build_cells,
    coverage,
    erasers_of,
    mdl_backfire,
    row_differences,
    with_controls,
)


# --- the report --------------------------------------------------------------------------------


def build_report(
    dirs: Sequence[str | Path],
    out: str | Path | None = None,
    image_loader: ImageLoader | None = default_image_loader,
    ignore: Sequence[str] = (),
    early_fraction: float = 0.25,
    late_fraction: float = 0.25,
    n_images: int = 4,
    merge_code_versions: bool = False,
    echo: Callable[[str], Any] | None = print,
    compare_to: str | None = None,
    rows: Sequence[str] | None = None,
) -> Path:
    """Write the report for the sweeps below ``dirs`` into ``out``; return the Markdown file.

    ``compare_to`` names a shipped paper table (``mdl.report.paper.available_tables()``) to compare
    with whatever the runs' data set; None compares with the tables of the runs' own data set.
    ``rows`` names the row keys (default: the keys the sweeps varied, ``mdl.report.sweep.choose_row_keys``).

    Runs of different code versions land in different cells unless ``merge_code_versions``; when
    the runs come from more than one version, ``echo`` (print; None: silent) gets one line saying
    how many and whether cells were split or merged, and report.md says the same.

    Runs of several designs (``mdl.report.sweep.design_groups``) get a report each, in a folder of ``out``
    named after the design, and ``out``/report.md puts their tables one after the other and links them.
    """
    if not dirs:
        raise ValueError("give at least one sweep directory (e.g. multirun/2025-01-01/12-00-00)")
    if not (0 < early_fraction < 1 and 0 < late_fraction < 1 and early_fraction + late_fraction <= 1):
        raise ValueError(
            f"backfiring windows must be fractions in (0, 1) summing to at most 1, got early="
            f"{early_fraction}, late={late_fraction}"
        )
    if compare_to:
        load_paper_table(compare_to)  # an unknown name fails before any file is read
    sweeps = load_sweeps(dirs, ignore, merge_code_versions=merge_code_versions, rows=rows)
    if not any(s.runs for s in sweeps):
        raise FileNotFoundError(
            f"no readable results.json below {', '.join(map(str, dirs))}; "
            f"{len(sweeps[0].problems)} unreadable. Did the jobs finish?"
        )
    skipped = [p for p in sweeps[0].problems if p.reason.startswith("unreadable")]  # every design's, read once
    if skipped and echo is not None:
        echo(
            f"note: {len(skipped)} results.json left out (truncated, or edited by hand: a checksum that no longer "
            f"matches); report.md lists them: " + "; ".join(f"{p.path}: {p.reason}" for p in skipped[:3])
        )
    missing = missing_jobs(dirs)
    if missing and echo is not None:
        echo(
            f"note: {len(missing)} planned job(s) have no results.json (interrupted, failed or still running); "
            f"report.md lists them: "
            + "; ".join(m.describe() for m in missing[:3])
            + ("; ..." if len(missing) > 3 else "")
        )
    out = Path(out) if out is not None else Path(dirs[0]) / "report"
    options = dict(
        image_loader=image_loader,
        early_fraction=early_fraction,
        late_fraction=late_fraction,
        n_images=n_images,
        compare_to=compare_to,
        echo=echo,
    )
    if len(sweeps) == 1:
        return write_report(sweeps[0], dirs, out, missing=missing, **options)
    if echo is not None:
        echo(
            f"note: the runs follow {len(sweeps)} designs (they do not share their config keys): a report each, "
            f"in {', '.join(design_folder(i, s) for i, s in enumerate(sweeps, 1))} of {out}"
        )
    reports = [write_report(s, dirs, out / design_folder(i, s), **options) for i, s in enumerate(sweeps, 1)]
    path = out / "report.md"
    path.write_text(render_designs(sweeps, reports, dirs, out, missing))
    return path


def design_folder(index: int, sweep: Sweep) -> str:
    """``design1_paper``: the folder of a design's report (numbered: two designs' names may share a slug)."""
    return f"design{index}_{slug(sweep.design.replace('.*', ''))}"


def write_report(
    sweep: Sweep,
    dirs,
    out: Path,
    image_loader: ImageLoader | None,
    early_fraction: float,
    late_fraction: float,
    n_images: int,
    compare_to: str | None,
    echo: Callable[[str], Any] | None,
    missing: Sequence[MissingJob] = (),
) -> Path:
    """One design's report (tables, figures, CSVs) into ``out``; return its Markdown file."""
    where = f" ({sweep.design})" if sweep.design else ""
    if sweep.mixed_versions and echo is not None:
        echo(f"note{where}: {sweep.code_version_line().replace('`', '')}")
    if len({r.environment for r in sweep.runs}) > 1 and echo is not None:
        echo(f"note{where}: {environments_line(sweep, build_cells(sweep)).replace('**', '')}")
    out.mkdir(parents=True, exist_ok=True)
    cells = build_cells(sweep)
    cov = coverage(sweep, cells)
    flags = backfire_flags(cells, early_fraction, late_fraction)
    figures: list[FigureFile] = []
    notes: list[str] = []
    for make in (
        lambda: scaling_figures(sweep, cells, out, cov.max_seeds),
        lambda: figure3(sweep, cells, out),
        lambda: loss_figures(sweep, cells, out),
        lambda: probe_figures(sweep, cells, out),
        lambda: lr_figures(sweep, cells, out),
        lambda: lr_transfer_figures(sweep, cells, out),
        lambda: figure1(sweep, out, image_loader, n_images),
    ):
        f, n = make()
        figures += f
        notes += n
    paper_md, paper_rows = paper_section(sweep, cells, compare_to)
    csvs = write_csvs(sweep, cells, cov, flags, out)
    if paper_rows:
        csvs.append(write_comparison_csv(out / "paper_comparison.csv", sweep, paper_rows))
    text = render(
        sweep,
        cells,
        cov,
        flags,
        figures,
        notes,
        csvs,
        dirs,
        out,
        early_fraction,
        late_fraction,
        [
            *claims_section(sweep, cells),
            *erasure_section(cells),
            *protocol_section(sweep, cells, cov.max_seeds, compare_to),
            *paper_md,
            *lr_section(sweep, cells, out),
            *_missing(list(missing)),
        ],
    )
    path = out / "report.md"
    path.write_text(text)
    return path


def render_designs(sweeps: list[Sweep], reports: list[Path], dirs, out: Path, missing: list[MissingJob]) -> str:
    """The report over several designs: each design's paper-MDL table under its name, with a link to its report."""
    md = [
        "# Sweep report\n",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from {', '.join(f'`{d}`' for d in dirs)}: "
        f"{sum(len(s.runs) for s in sweeps)} runs of {len(sweeps)} designs. Runs that do not share their config keys "
        "(a preset's lookup tables, an option group's settings) are reported apart, a table per design named by the "
        "keys only its runs have; each design's full report (tables, figures, CSVs, coverage) is in its folder.",
        "",
    ]
    for i, (sweep, report) in enumerate(zip(sweeps, reports), 1):
        cells = build_cells(sweep)
        md += [
            f"## Design {i}: {sweep.design}\n",
            f"{len(sweep.runs)} runs in {len(cells)} cells; architectures {sorted({c.arch for c in cells})}, erasers "
            f"{erasers_of(cells)}; row keys {[*sweep.row_keys] or 'none'}. "
            f"[Full report]({report.relative_to(out).as_posix()})\n",
            "**Paper-compatible prequential MDL, bits per sample:**\n",
            pivot(sweep, cells, "paper_mdl", coverage(sweep, cells).max_seeds),
            "",
        ]
    return "\n".join([*md, *_missing(missing)])


def _missing(missing: list[MissingJob]) -> list[str]:
    """The jobs a sweep planned that wrote no results: the table above averages only what is there."""
    if not missing:
        return []
    return [
        "## Missing jobs\n",
        f"{len(missing)} job(s) of the sweep(s) have no results.json (interrupted, failed or still running); the "
        "tables leave them out. Launch the same command again to run them (finished jobs are skipped):\n",
        *[f"- {m.describe()}" for m in missing],
        "",
    ]


def render(
    sweep: Sweep,
    cells: list[Cell],
    cov: Coverage,
    flags: list[BackfireFlag],
    figures: list[FigureFile],
    notes: list[str],
    csvs: list[Path],
    dirs,
    out: Path,
    early_fraction: float,
    late_fraction: float,
    paper: Sequence[str] = (),
) -> str:
    """report.md's text for one design: the header, tables, the paper comparison, coverage, backfiring,
    figures, notes and the files beside it. Figures and files are linked relative to ``out``, so the report folder
    can be moved or archived whole."""
    md = [
        *_header(sweep, cells, dirs),
        *_tables(sweep, cells, cov),
        *paper,
        *_coverage(sweep, cells, cov),
        *_backfiring(sweep, cells, flags, early_fraction, late_fraction),
        "## Figures\n",
    ]
    for f in figures:
        md += [f"### {f.title}\n", f"![{f.title}]({f.path.relative_to(out).as_posix()})\n", f.caption, ""]
    if notes:
        md += ["## Notes\n", *[f"- {n}" for n in notes], ""]
    units = ", ".join(f"`{m}` {unit}" for m, (_, unit) in METRICS.items())
    md += [
        "## Files\n",
        *[f"- [`{p.name}`]({p.name})" for p in csvs],
        "",
        f"Units: {units}; `<metric>_std` is the sample std over seeds (ddof = 1); `<metric>_n` the seeds that "
        "reported it. Loss curves are in nats, epochs 1-based.",
        "",
    ]
    return "\n".join(md)


def _header(sweep: Sweep, cells: list[Cell], dirs) -> list[str]:
    counts = {v: sum(r.code_version == v for r in sweep.runs) for v in sweep.code_versions}
    versions = ", ".join(
        f"`{v}`"
        + (f" ({n} runs)" if len(counts) > 1 else "")
        + (" (no code_version or git_sha recorded: not a git checkout?)" if v == UNKNOWN_VERSION else "")
        for v, n in counts.items()
    )
    return [
        "# Sweep report\n",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from {', '.join(f'`{d}`' for d in dirs)}: "
        f"{len(sweep.runs)} runs in {len(cells)} cells; architectures {sorted({c.arch for c in cells})}, "
        f"erasers {erasers_of(cells)}; row keys {[*sweep.row_keys] or 'none'} (config keys that vary within an "
        f"architecture x eraser pair: runs that differ in them are never averaged together; pass `--ignore KEY` "
        f"for a key that should not split cells"
        + (
            "; `code_version` is the code version that computed a run, not a config key"
            if sweep.mixed_versions and sweep.split_code_versions
            else ""
        )
        + f"); seeds grouped by {sweep.replicate_keys or ['seed']}.",
        f"Code version{'s' if len(counts) > 1 else ''} (results.json `code_version`, else `git_sha`): {versions}"
        + (f" — **{sweep.code_version_line()}**" if sweep.mixed_versions else "."),
        environments_line(sweep, cells),
        "",
    ]


def environments_line(sweep: Sweep, cells: list[Cell]) -> str:
    """Which environments computed the runs (results.json `environment`), and the cells whose seeds mix them:
    their means average numbers of different torch builds, CPUs or GPUs."""
    counts = Counter(run.environment for run in sweep.runs)
    line = (
        "Environment"
        + ("s" if len(counts) > 1 else "")
        + ": "
        + ", ".join(f"`{env}`" + (f" ({n} runs)" if len(counts) > 1 else "") for env, n in counts.items())
    )
    mixed = [
        f"{c.arch} / {c.eraser}" + (f" {c.row}" if c.row else "")
        for c in cells
        if len({r.environment for r in c.runs}) > 1
    ]
    if mixed:
        return (
            line
            + f" — **{len(mixed)} cell(s) mix environments: {'; '.join(mixed[:6])}{'; ...' if len(mixed) > 6 else ''}**"
        )
    return line + "."


def _paper_losses(sweep: Sweep) -> str:
    """Which estimate of L(c_i) the runs' paper MDL is (mdl.paper_loss; runs from before it: val_min)."""
    from mdl.codelength import PAPER_LOSSES

    used = sorted({str(run.results.get("paper_loss", "val_min")) for run in sweep.runs})
    return " and ".join(f"`{u}` ({PAPER_LOSSES.get(u, 'unknown')})" for u in used) + (
        ": mixed estimates, compare cells of one estimate only" if len(used) > 1 else ""
    )


def _tables(sweep: Sweep, cells: list[Cell], cov: Coverage) -> list[str]:
    return [
        "## Table (the paper's Appendix C)\n",
        "Each cell: mean ± sample standard deviation over seeds (ddof = 1; n/a with one seed), n = number of "
        f"seeds. {PARTIAL_MARK}: fewer seeds than the fullest cell ({cov.max_seeds}); `missing`: no run.\n",
        "**Paper-compatible prequential MDL, bits per sample** (the number in the paper's table; "
        f"L(c_i) measured as {_paper_losses(sweep)}):\n",
        pivot(sweep, cells, "paper_mdl", cov.max_seeds),
        "",
        "**Online code length (Voita & Titov), bits per example** (total bits in `table.csv`; a uniform "
        "predictor scores log2 K):\n",
        pivot(sweep, cells, "online_bits_per_example", cov.max_seeds),
        "",
        "**Final validation loss of the full-data fit (best epoch), nats:**\n",
        pivot(sweep, cells, "final_val_loss", cov.max_seeds, digits=3),
        "",
    ]


def _coverage(sweep: Sweep, cells: list[Cell], cov: Coverage) -> list[str]:
    md = [
        "## Coverage\n",
        *(
            f"- partial: {_where(sweep, c.arch, c.row)} **{c.eraser}**: n={c.n} of {cov.max_seeds}"
            f" (lacks {', '.join(lacking) or 'seeds'})"
            for c, lacking in cov.partial
        ),
        *(f"- missing: {_where(sweep, arch, row)} **{eraser}**: no run" for arch, row, eraser in cov.missing),
        *(
            f"- {_where(sweep, c.arch, c.row)} {c.eraser}: {lacking} run(s) lack `{metric}`; its mean uses the rest"
            for c, metric, lacking in cov.metric_gaps
        ),
        *(
            f"- {_where(sweep, arch, row)}: `{key}` differs between the erasers compared in this row ("
            + "; ".join(f"{e}: {v}" for e, v in values.items())
            + ")"
            for arch, row, key, values in row_differences(cells)
        ),
        *(f"- skipped `{p.path}`: {p.reason}" for p in sweep.problems),
        *(
            f"- duplicate seed with different numbers: `{dropped.path}` has the same config and seed as the "
            f"newer `{kept.path}`; only the newer one is used"
            for kept, dropped in sweep.duplicates
        ),
    ]
    if sweep.mixed_versions and not sweep.split_code_versions:
        for c in cells:
            versions = sorted({r.code_version for r in c.runs})
            if len(versions) > 1:
                md.append(
                    f"- {_where(sweep, c.arch, c.row)} **{c.eraser}**: averages runs of code versions "
                    + ", ".join(f"`{v}`" for v in versions)
                )
    if sweep.copies:
        md.append(
            f"- {sweep.copies} results.json file(s) were copies of a run already read (same config, seed and "
            "numbers: the run store or a re-launch's skipped jobs); each run counted once"
        )
    if not (cov.partial or cov.missing):
        md.append(f"Every cell has {cov.max_seeds} seed(s).")
    return [*md, ""]


def _backfiring(
    sweep: Sweep, cells: list[Cell], flags: list[BackfireFlag], early_fraction: float, late_fraction: float
) -> list[str]:
    md = [
        "## Backfiring\n",
        "An erased condition *backfires* when its validation loss starts above the control's and ends below it. "
        "Mean curves over seeds are compared on their common epochs 1..T (epoch t = t-th entry of "
        "`val_loss_curve`); with d(t) = erased − control: early gap = mean of d over epochs "
        f"1..ceil({early_fraction}·T), late gap = mean of d over the last ceil({late_fraction}·T) epochs; flagged "
        "when early gap > 0 and late gap < 0. Crossing epoch: the last t with d(t−1) ≥ 0 > d(t).\n",
    ]
    erased = [c for c in cells if c.eraser != CONTROL]
    compared = with_controls(cells)
    if not erased:
        return [*md, "The sweep has no erased condition: nothing to check.", ""]
    md.append(
        f"{len(compared)} of {len(erased)} erased cell(s) had a control (eraser `{CONTROL}`) in the same row "
        "to compare with" + ("." if compared else ": nothing could be checked; add `eraser=none` to the sweep.") + "\n"
    )
    if flags:
        md.append(
            markdown_table(
                [
                    "architecture",
                    *sweep.row_names(),
                    "eraser",
                    "early gap (nats)",
                    "late gap (nats)",
                    "crossing epoch",
                    "T",
                ],
                (
                    [
                        f.arch,
                        *map(str, f.row),
                        f.eraser,
                        f"{f.result.early_gap:+.3f}",
                        f"{f.result.late_gap:+.3f}",
                        f.result.crossing_epoch,
                        f.result.epochs,
                    ]
                    for f in flags
                ),
            )
        )
    elif compared:
        md.append("No loss-curve backfiring found.")
    if compared:
        md += [
            "",
            "MDL below the control's (erasure made the code *shorter*, as for ConvNeXt + QLEACE in the paper):",
            "",
        ]
        md += [
            f"- {_where(sweep, c.arch, c.row)} **{c.eraser}**: {m:.3f} < control {mc:.3f} bits/sample"
            for c, m, mc in mdl_backfire(cells)
        ] or ["- none"]
    return [*md, ""]


def _where(sweep: Sweep, arch: str, row: tuple[Any, ...]) -> str:
    return f"{arch} {sweep.describe(row)}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mdl.report``: build the report of the given sweep folders. A setting or folder to change
    (no results, a bad key, an unwritable ``--out``) ends with one ``error:`` line and exit 2, not a traceback."""
    parser = argparse.ArgumentParser(prog="python -m mdl.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR", help="directories searched for results.json")
    parser.add_argument("--out", default=None, help="report directory (default: <first SWEEP_DIR>/report)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY",
        help="config key (prefix) that must not split conditions, e.g. trainer.max_time; repeatable",
    )
    parser.add_argument(
        "--rows",
        default=None,
        metavar="KEY,KEY",
        help="the table's row keys, in order (full config keys or unambiguous last parts, e.g. "
        "width,depth,optimizer.lr; default: the keys the sweeps varied); a key that varies "
        "within an architecture x eraser pair and is not named must be --ignore'd",
    )
    parser.add_argument(
        "--early-fraction", type=float, default=0.25, help="backfiring: early window, fraction of epochs"
    )
    parser.add_argument("--late-fraction", type=float, default=0.25, help="backfiring: late window, fraction of epochs")
    parser.add_argument("--images", type=int, default=4, help="Figure 1: number of images (rows)")
    parser.add_argument(
        "--merge-code-versions",
        action="store_true",
        help="average runs of different code versions in one cell (default: a cell per version)",
    )
    parser.add_argument(
        "--compare-to",
        default=None,
        choices=available_tables(),
        metavar="TABLE",
        help="compare with this paper table whatever the runs' data set, by architecture x eraser "
        f"(shipped: {', '.join(available_tables())}; default: the tables of the runs' data set)",
    )
    parser.add_argument(
        "--claims",
        action="store_true",
        help="print only the paper's claims tested on the sweeps (mdl/report/claims.py); write nothing",
    )
    args = parser.parse_args(argv)
    rows = [k for k in args.rows.split(",") if k] if args.rows is not None else None
    if args.claims:
        return print_claims(args.sweep_dirs, args.ignore, args.merge_code_versions, rows)
    try:
        path = build_report(
            args.sweep_dirs,
            args.out,
            ignore=args.ignore,
            early_fraction=args.early_fraction,
            late_fraction=args.late_fraction,
            n_images=args.images,
            merge_code_versions=args.merge_code_versions,
            compare_to=args.compare_to,
            rows=rows,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # --out read-only, full or a file
        where = args.out or Path(args.sweep_dirs[0]) / "report"
        print(
            f"error: cannot write the report to {where} ({err.strerror or err}); choose a writable folder with "
            f"--out DIR",
            file=sys.stderr,
        )
        return 2
    print(f"report: {path}")
    return 0


def print_claims(dirs: Sequence[str], ignore: Sequence[str], merge_code_versions: bool, rows) -> int:
    """``--claims``: the claims section of each design's runs on stdout, without figures or files."""
    try:
        sweeps = [s for s in load_sweeps(dirs, ignore, merge_code_versions=merge_code_versions, rows=rows) if s.runs]
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not sweeps:
        print(
            f"error: no readable results.json below {', '.join(map(str, dirs))}; did the jobs finish?", file=sys.stderr
        )
        return 2
    for sweep in sweeps:
        if sweep.design:
            print(f"# design: {sweep.design}\n")
        print("\n".join(claims_section(sweep, build_cells(sweep))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
