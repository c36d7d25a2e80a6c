"""Quiet by default: a run prints its overrides and the path of its resolved config (print_config=full: all of it),
Python warnings as one line each and once, and W&B no history block of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from conftest import FAST, REPO, compose_config, python_path
from mdl.run.console import show_config


def test_a_run_prints_its_overrides_and_the_path_of_its_config(finished_run) -> None:
    run = finished_run
    (line,) = [x for x in run.proc.stdout.splitlines() if x.startswith("config:")]
    assert (
        line.startswith(f"config: debug=fast paths.output_root={run.root} ") and "print_config=full prints it" in line
    )
    assert "\neraser:\n" not in run.proc.stdout  # not the whole config
    config = OmegaConf.load(run.run_dir / "config.yaml")
    assert f"{run.run_dir / 'config.yaml'}" in line and config.paths.output_root == str(run.root)  # the override
    assert config.mdl.num_blocks == 3  # debug=fast's
    assert "${" not in (run.run_dir / "config.yaml").read_text()  # resolved


def test_print_config_full_and_false(tmp_path: Path, capsys) -> None:
    cfg = compose_config([*FAST, "print_config=full"])
    show_config(cfg, ["debug=fast"], tmp_path / "a")
    assert "\neraser:\n" in capsys.readouterr().out
    show_config(compose_config([*FAST, "print_config=false"]), ["debug=fast"], tmp_path / "b")
    assert capsys.readouterr().out == "" and not (tmp_path / "b").exists()


def test_warnings_are_one_line_each_and_printed_once() -> None:
    code = (
        "from mdl.run.console import one_line_warnings; one_line_warnings(); import warnings\n"
        "for _ in range(3):\n    warnings.warn('covariance has rank 60 of 64', RuntimeWarning)\n"
        "warnings.warn('a temporary left behind', ResourceWarning)\n"
    )  # hidden by Python's defaults: still hidden
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "", "PYTHONPATH": python_path()},
    )
    assert proc.stderr == "warning: covariance has rank 60 of 64 (RuntimeWarning)\n"


def test_wandb_prints_no_history_block(small_sweep) -> None:
    text = small_sweep.output
    assert "Run history" not in text and "Run summary" not in text
    for job in small_sweep.run_dirs:
        assert list(job.glob("wandb/offline-run-*/run-*.wandb"))  # each run is still written
