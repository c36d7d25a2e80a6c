"""The lr report names a best lr only where a cell tried enough values to have one (issue 44.4): a folder of runs
whose optimizer.lr differs between architectures or widths (one value per cell) is no lr search."""

from __future__ import annotations

import json
import math
from pathlib import Path

from test_report import write_run

from mdl.report.lr import best_learning_rates, best_lr_by_width, lr_section
from mdl.report.sweep import load_sweep
from mdl.report.stats import build_cells
from mdl.results import write_checked_json

# (eraser, width) -> the lrs its runs tried: one point, two points, and a real three-point search
GRIDS = {
    ("none", 64): (1e-3,),
    ("none", 128): (3e-3,),
    ("leace", 64): (1e-3, 3e-3),
    ("leace", 128): (1e-3, 3e-3),
    ("qleace", 64): (1e-3, 3e-3, 1e-2),
    ("qleace", 128): (1e-3, 3e-3, 1e-2),
}


def write_folder(root: Path) -> Path:
    """Runs of one architecture at two widths whose lr grids have one, two and three points per eraser."""
    job = 0
    for (eraser, width), lrs in GRIDS.items():
        for lr in lrs:
            run = write_run(root, job, "mlp", eraser, width, 2, seed=0)
            job += 1
            results = json.loads((run / "results.json").read_text())
            results["config"]["optimizer"] = {"lr": lr}
            results["paper_mdl"] = (math.log10(lr) + 2.5) ** 2 + width / 1e3
            write_checked_json(run / "results.json", results)
    return root


def test_cells_with_one_or_two_lrs_name_no_best_lr_and_no_transfer_verdict(tmp_path: Path) -> None:
    """Before: every cell got a "best lr" (the one value it tried) and the widths' different one-point lrs read as
    "transfers: no"."""
    sweep = load_sweep([write_folder(tmp_path / "runs")])
    cells = build_cells(sweep)
    text = "\n".join(lr_section(sweep, cells, tmp_path / "out"))
    named = {c.eraser for c in best_learning_rates(sweep, cells) if c.named}
    assert named == {"qleace"}
    assert "| mlp | width=64 | none | one point | " in text
    assert "| mlp | width=128 | leace | two points | " in text
    assert "| mlp | width=64 | qleace | 0.003 | " in text  # the three-point grid's minimum (10^-2.5 lies between)
    assert "4 of 6 cells tried fewer than 3 values of `optimizer.lr` (2 with one point, 2 with two points)" in text
    # the transfer verdict only from widths with a best lr
    assert best_lr_by_width(sweep, cells) == {("mlp", "", "qleace"): {64: 3e-3, 128: 3e-3}}
    assert "| mlp | - | none | 64: one point, 128: one point | n/a (0 of 2 widths tried 3+ lrs) |" in text
    assert "| mlp | - | leace | 64: two points, 128: two points | n/a (0 of 2 widths tried 3+ lrs) |" in text
    assert "| mlp | - | qleace | 64: 0.003, 128: 0.003 | yes |" in text
    assert "| no |" not in text


def test_a_folder_of_one_point_cells_writes_no_best_lrs(tmp_path: Path) -> None:
    """Runs whose lr differs only between architectures or widths: the section says there is no search to read, and
    no lr/best.yaml is written for a later sweep to pick up."""
    job = 0
    for (eraser, width), lrs in GRIDS.items():
        run = write_run(tmp_path / "runs", job, "mlp", eraser, width, 2, seed=0)
        job += 1
        results = json.loads((run / "results.json").read_text())
        results["config"]["optimizer"] = {"lr": lrs[0] * width / 64}
        write_checked_json(run / "results.json", results)
    sweep = load_sweep([tmp_path / "runs"])
    text = "\n".join(lr_section(sweep, build_cells(sweep), tmp_path / "out"))
    assert "no best lr is named and none is written" in text
    assert not (tmp_path / "out" / "lr" / "best.yaml").exists()
    assert "+lr=best" not in text
    assert "| yes |" not in text and "| no |" not in text
