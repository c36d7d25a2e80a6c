"""Every logger on one step axis that advances: TensorBoard's event steps, the CSV's step column and W&B's
trainer/global_step are the same count of logged rows, and ``epoch`` is each member's own epoch."""

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


def test_tensorboard_csv_and_wandb_share_one_advancing_step(small_sweep) -> None:
    pytest.importorskip(
        "tensorboard", reason="logger=tensorboard needs the tensorboard extra: pip install -e '.[tensorboard]'"
    )
    from wandb_records import history

    assert SWEEP_LOGGERS == "logger=[csv,tensorboard,wandb]"  # the shared sweep logs with all three
    run_dir = small_sweep.run_dirs[0]

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    for tag in ("final/val_loss", "block01/val_loss", "epoch"):
        steps = scalars[tag]
        assert len(steps) > 1 and steps == sorted(set(steps)), (tag, steps)  # one event per step, advancing
    assert max(scalars["final/val_loss"]) > max(scalars["block01/val_loss"])  # the final fit after the blocks

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    csv_steps = [int(r["step"]) for r in rows]
    assert csv_steps == sorted(set(csv_steps))
    csv_final = [int(r["step"]) for r in rows if r.get("final/val_loss")]
    assert csv_final == scalars["final/val_loss"]  # the same x for the same row in both files

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb_final = [int(r["trainer/global_step"]) for r in history(run_file) if "final/val_loss" in r]
    assert wandb_final == csv_final
    epochs = [int(float(r["epoch"])) for r in rows if r.get("final/val_loss")]
    assert epochs == list(range(len(epochs)))  # epoch: the fit's own epoch, from 0
