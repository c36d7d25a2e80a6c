"""launch.py as a user runs it: single runs, multiruns into distinct directories, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FAST, run_launch


def test_multirun_launches_every_job_into_its_own_directory(tmp_path: Path) -> None:
    proc = run_launch(["-m", "eraser=none,leace", "seed=0,1", f"paths.output_root={tmp_path}", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((tmp_path / "multirun").rglob("results.json"))
    assert len(results) == 4
    assert len({r.parent for r in results}) == 4
    combos = {(json.loads(r.read_text())["config"]["eraser"]["name"], json.loads(r.read_text())["config"]["seed"]) for r in results}
    assert combos == {("none", 0), ("none", 1), ("leace", 0), ("leace", 1)}
    assert "paper MDL" in proc.stdout


def test_unknown_eraser_stops_with_the_available_names(tmp_path: Path) -> None:
    proc = run_launch(["eraser=bogus", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "eraser/bogus" in proc.stderr and "leace" in proc.stderr


def test_unknown_model_name_is_named(tmp_path: Path) -> None:
    proc = run_launch(["model.name=bogus", f"paths.output_root={tmp_path}", *FAST], cwd=tmp_path)
    assert proc.returncode != 0
    assert "unknown model 'bogus'" in proc.stderr


def test_a_sweep_with_one_invalid_job_runs_none_of_them(tmp_path: Path) -> None:
    """Every job is checked before the first runs (the sweep_cost callback), not after hours of the valid ones."""
    proc = run_launch(["-m", *FAST, "depth=2,0", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "depth=0" in proc.stderr and "must be an integer >= 1" in proc.stderr and "no job was run" in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


def test_sweep_cost_refuses_what_launch_refuses_with_one_message(capsys) -> None:
    import pytest

    from mdl.sweep_cost import main as cost_main

    for args, message in ((["model=nope"], "Could not find 'model/nope'"), (["mdl.num_blocks=1"], "mdl.num_blocks=1: must be"),
                          (["model.name=nope"], "unknown model 'nope'")):
        with pytest.raises(SystemExit, match=message):
            cost_main(args)
