"""A pack logs like a run (mdl/run/pack.py, ``hydra/launcher=packed``): each run of a pack gets its own W&B run, CSV
and TensorBoard log, holding exactly the series the same run logs alone, after a kill and a relaunch too."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterable

import pytest

from conftest import FAST, compose_config

WANDB_OWN = ("_timestamp", "_runtime", "_step")  # W&B's own bookkeeping: when and in which order, not what


def logged(rows: Iterable[dict[str, Any]], ignored: Iterable[str] = ()) -> list[tuple[str, str, str]]:
    """Every value logged, as (key, the epoch of its row, value), sorted: a run's series whatever the order of the
    calls (a relaunch logs the epochs finished before a kill first); a value logged twice shows twice."""
    def plain(value: Any) -> str:
        if isinstance(value, dict) and "_type" in value:  # media (a table, an image): by type and content
            return f"{value['_type']} {value.get('sha256', '')}"
        return str(value)

    return sorted((key, str(row.get("epoch", "")), plain(value)) for row in rows for key, value in row.items()
                  if key not in ignored and value not in ("", None))


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def csv_series(run_dir: Path) -> list[tuple[str, str, str]]:
    return logged(csv_rows(run_dir), ignored=("step",))  # CSVLogger's own row count


def wandb_file(run_dir: Path) -> Path:
    """The run's one W&B run file (a second one: W&B runs mixed up)."""
    (found,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return found


def wandb_series(run_dir: Path) -> list[tuple[str, str, str]]:
    from wandb_records import history

    return logged(history(wandb_file(run_dir)), ignored=WANDB_OWN)


def tensorboard_values(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar of the run's TensorBoard event files, by tag, in the order logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[str, list[float]] = {}
    for events in sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    return values


def test_runs_logging_in_one_process_each_get_their_own_wandb_run_csv_and_tensorboard(tmp_path: Path, monkeypatch) -> None:
    """Two runs' loggers made in one process (as a pack makes them) and logged to in turns, epoch by epoch: each
    W&B run, CSV and TensorBoard log holds its own run's values only. Before: the second run's W&B logger reused the
    first run's W&B run (W&B's global run), and the first run's close left the second's "finished"."""
    pytest.importorskip("tensorboard")
    from mdl.run.loggers import live_epochs, log_results, make_logger
    from wandb_records import run_record, summary

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    runs = [tmp_path / "seed0", tmp_path / "seed1"]
    loggers = [make_logger(compose_config([*FAST, "logger=[csv,wandb,tensorboard]", f"seed={s}"], tmp_path), run_dir, [f"seed={s}"])
               for s, run_dir in enumerate(runs)]
    hooks = [live_epochs(logger, 2) for logger in loggers]
    for epoch in range(3):
        for s, hook in enumerate(hooks):  # in turns, as a pack's fit finishes its runs' epochs
            hook(0, epoch, 10.0 * s + epoch, 100.0 * s + epoch, 0.5)
    for s, (logger, run_dir) in enumerate(zip(loggers, runs)):
        log_results(logger, {"paper_mdl": float(s), "blocks": []}, run_dir)
    for s, run_dir in enumerate(runs):
        expected = [100.0 * s + epoch for epoch in range(3)]
        assert [float(r["block01/val_loss"]) for r in csv_rows(run_dir) if r.get("block01/val_loss")] == expected
        assert tensorboard_values(run_dir)["block01/val_loss"] == expected
        assert [float(v) for k, _, v in wandb_series(run_dir) if k == "block01/val_loss"] == expected
        assert summary(wandb_file(run_dir))["paper_mdl"] == float(s)
        assert run_record(wandb_file(run_dir)).display_name == f"seed={s}"
