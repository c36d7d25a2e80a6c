"""Every logger puts a fit's curves against its own epoch: TensorBoard's event steps, the CSV's step column and W&B's
trainer/global_step of a per-epoch row are that fit's epoch, from 0, also in a stacked fit where blocks train at
once (a shared count of rows interleaved them)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import SWEEP_LOGGERS


def tensorboard_scalars(folder: Path) -> dict[str, list[int]]:
    """Each scalar tag of the event files under ``folder`` -> its events' steps, in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = folder.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_csv_and_wandb_put_each_fit_against_its_own_epochs(small_sweep) -> None:
    pytest.importorskip(
        "tensorboard", reason="logger=tensorboard needs the tensorboard extra: pip install -e '.[tensorboard]'"
    )
    from wandb_records import history

    assert SWEEP_LOGGERS == "logger=[csv,tensorboard,wandb]"  # the shared sweep logs with all three
    run_dir = small_sweep.run_dirs[0]

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    series = [t for t in scalars if t.endswith(("/val_loss", "/train_loss")) and "best" not in t and "last" not in t]
    assert {"final/val_loss", "block01/val_loss", "block02/val_loss"} <= set(series)
    for tag in series:
        assert scalars[tag] == list(range(len(scalars[tag]))), (tag, scalars[tag])  # its own epochs, from 0

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for name in ("final", "block01", "block02"):
        csv_rows = [r for r in rows if r.get(f"{name}/val_loss")]
        assert [int(r["step"]) for r in csv_rows] == [int(float(r["epoch"])) for r in csv_rows]
        assert [int(r["step"]) for r in csv_rows] == scalars[f"{name}/val_loss"]  # the same x in both files

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb_final = [int(r["trainer/global_step"]) for r in history(run_file) if "final/val_loss" in r]
    assert wandb_final == scalars["final/val_loss"]


def test_a_stacked_fits_blocks_each_log_against_their_own_epochs(tmp_path: Path) -> None:
    """The blocks of a stacked fit train at once; each block's rows still carry its own epochs as their step (the
    default's CSV had block01 on steps 0..91 and block09 on 23..746 while they shared one count of rows)."""
    from conftest import FAST, compose_config
    from mdl.run.experiment import run_experiment

    cfg = compose_config([*FAST, "mdl.members_per_fit=all", "mdl.num_blocks=4", "logger=csv"], tmp_path)
    run_experiment(cfg, tmp_path / "run")
    (metrics,) = (tmp_path / "run").rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    for name in ("block01", "block02", "block03", "final"):  # num_blocks boundaries: 3 blocks and the final fit
        steps = [int(r["step"]) for r in rows if r.get(f"{name}/val_loss")]
        assert steps == list(range(len(steps))) and len(steps) > 1, (name, steps)
