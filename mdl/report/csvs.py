"""The report's CSV files: one line per cell (table.csv), per run (runs.csv), Figure 3's data, the loss curves and
the backfiring flags; what report.md shows, as numbers a script reads."""

from __future__ import annotations

from pathlib import Path

from mdl.report.protocols import untrained_count
from mdl.report.sweep import Sweep
from mdl.report.stats import METRICS, BackfireFlag, Cell, Coverage, curve_stats, mdl_increase
from mdl.report.tables import _num, _triple, write_csv, write_latex_table


def write_csvs(sweep: Sweep, cells: list[Cell], cov: Coverage, flags: list[BackfireFlag], out: Path) -> list[Path]:
    """Write the report's CSVs (and table.tex) into ``out``; return their paths. Missing cells get a line with
    n = 0, so a script that reads table.csv sees what the sweep lacks."""
    keys = list(sweep.row_keys)
    metric_cols = [f"{m}_{s}" for m in METRICS for s in ("mean", "std", "n")]
    partial = {id(c): lacking for c, lacking in cov.partial}
    table_rows = [
        [
            c.arch,
            *c.row,
            c.eraser,
            c.n,
            " ".join(sweep.replicate_label(r.replicate) for r in c.runs),
            " ".join(partial.get(id(c), [])),
            *(v for m in METRICS for v in _triple(c, m)),
        ]
        for c in cells
    ] + [[arch, *row, eraser, 0, "", "all", *([""] * len(metric_cols))] for arch, row, eraser in cov.missing]
    run_metrics = [*METRICS, "uniform_codelength_bits", "n_train", "num_classes"]
    width = [] if "width" in keys else ["width"]  # a column of its own when it is not a row key
    curve_rows = []
    for c in cells:
        stats = curve_stats(c)
        if stats is None:
            continue
        for t in range(len(stats.mean)):
            curve_rows.append(
                [
                    c.arch,
                    *c.row,
                    c.eraser,
                    t + 1,
                    _num(stats.mean[t]),
                    _num(stats.std[t]),
                    _num(stats.low[t]),
                    _num(stats.high[t]),
                    stats.n_seeds,
                ]
            )
    return [
        write_csv(
            out / "table.csv",
            ["architecture", *keys, "eraser", "n_seeds", "seeds", "missing_seeds", *metric_cols],
            table_rows,
        ),
        write_latex_table(out / "table.tex", sweep, cells),
        write_csv(
            out / "runs.csv",
            [
                "architecture",
                *keys,
                "eraser",
                "seed",
                *run_metrics,
                "epochs",
                "blocks_at_untrained",
                "git_sha",
                "code_version_full",
                "path",
            ],
            (
                [
                    r.arch,
                    *r.row,
                    r.eraser,
                    sweep.replicate_label(r.replicate),
                    *(_num(r.results.get(m)) for m in run_metrics),
                    len(r.results.get("val_loss_curve") or []),
                    _num(untrained_count(r)),
                    r.results.get("git_sha") or "",
                    r.code_version,
                    str(r.path),
                ]
                for r in sweep.runs
            ),
        ),
        write_csv(
            out / "mdl_increase.csv",
            [
                "architecture",
                *keys,
                "eraser",
                *width,
                "increase_bits_per_sample",
                "increase_se",
                "increase_relative",
                "control_mean",
                "n_erased",
                "n_control",
            ],
            (
                [
                    i.arch,
                    *i.row,
                    i.eraser,
                    *([_num(i.width)] if width else []),
                    _num(i.increase),
                    _num(i.se),
                    _num(i.relative),
                    _num(i.control_mean),
                    i.n_erased,
                    i.n_control,
                ]
                for i in mdl_increase(sweep, cells)
            ),
        ),
        write_csv(
            out / "loss_curves.csv",
            [
                "architecture",
                *keys,
                "eraser",
                "epoch",
                "val_loss_mean_nats",
                "val_loss_std_nats",
                "val_loss_min_nats",
                "val_loss_max_nats",
                "n_seeds",
            ],
            curve_rows,
        ),
        write_csv(
            out / "backfiring.csv",
            ["architecture", *keys, "eraser", "early_gap_nats", "late_gap_nats", "crossing_epoch", "compared_epochs"],
            (
                [
                    f.arch,
                    *f.row,
                    f.eraser,
                    _num(f.result.early_gap),
                    _num(f.result.late_gap),
                    f.result.crossing_epoch,
                    f.result.epochs,
                ]
                for f in flags
            ),
        ),
    ]
