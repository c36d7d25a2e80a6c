"""Quiet by default: a run prints its overrides and the path of its resolved config (print_config=full: all of it),
Python warnings as one line each and once, and W&B no history block of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from conftest import FAST, REPO, compose_config, python_path, run_launch
from mdl.run.console import show_config


def test_a_run_prints_its_overrides_and_the_path_of_its_config(tmp_path: Path) -> None:
    proc = run_launch(
        [*FAST, "eraser=none", f"paths.output_root={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("config:")]
    assert line.startswith("config: debug=fast eraser=none") and "print_config=full prints it" in line
    assert "\neraser:\n" not in proc.stdout  # not the whole config
    (run_dir,) = tmp_path.glob("runs/*/*")
    assert f"{run_dir / 'config.yaml'}" in line and OmegaConf.load(run_dir / "config.yaml").eraser.name == "none"
    assert "${" not in (run_dir / "config.yaml").read_text()  # resolved


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


def test_wandb_prints_no_history_block(tmp_path: Path) -> None:
    proc = run_launch(
        [*FAST, "logger=wandb", f"paths.output_root={tmp_path}"],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_API_KEY": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "Run history" not in text and "Run summary" not in text
    assert list(tmp_path.glob("runs/*/*/wandb/offline-run-*/run-*.wandb"))  # the run is still written
