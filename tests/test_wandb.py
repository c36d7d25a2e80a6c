"""W&B in offline mode: one run per job, grouped by sweep, typed by eraser, named by overrides."""

from __future__ import annotations

from pathlib import Path

from conftest import FAST, run_launch


def test_offline_runs_carry_group_job_type_and_name(tmp_path: Path) -> None:
    proc = run_launch(
        ["-m", "logger=wandb", "eraser=none,leace", f"paths.output_root={tmp_path}", *FAST],
        cwd=tmp_path, env={"WANDB_MODE": "offline", "WANDB_API_KEY": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = list((tmp_path / "multirun").glob("*/*"))
    run_files = sorted(sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2
    for run_file in run_files:
        job_dir = run_file.parents[2]
        eraser = "leace" if "eraser=leace" in job_dir.name else "none"
        record = run_file.read_bytes()  # protobuf records: strings are stored verbatim
        assert sweep.name.encode() in record  # group: the sweep
        assert f"eraser={eraser}".encode() in record  # name: the job's overrides
        assert eraser.encode() in record  # job type
        for series in (b"block01/val_loss", b"block01/epoch", b"block02/val_loss", b"paper_mdl"):
            assert series in record, series
