"""A run killed mid-block (node failure) resumes from its checkpoint and ends bit-identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FITS, REPO, python_path, run_launch

SETTINGS = [  # fits of one member, each its own checkpoint (tests/test_stacked.py: fits of several)
    "mdl.members_per_fit=1",
    "mdl.checkpoint_every_s=0",
    "mdl.min_steps_per_pass=1",
    "trainer.kwargs.max_epochs=30",
    "trainer.patience=10",
    "mdl.num_blocks=3",
    "data.first_block=300",
    "width=32",
    "model.base_width=32",
    "seed=3",
]
NUMBERS = ("online_codelength_bits", "paper_mdl", "final_val_loss", "val_loss_curve", "train_loss_curve")


def _results(root: Path) -> dict:
    (path,) = list((root / "runs").rglob("results.json"))
    return json.loads(path.read_text())


def blocks_done(store: Path) -> int:
    try:
        return len(json.loads((store / "progress.json").read_text())["blocks"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def kill_mid_block_and_resume(tmp_path: Path, extra: list[str] = ()) -> None:
    """SIGKILL a run once block 2 has written a checkpoint, re-run it, compare with an uninterrupted run."""
    settings = [*SETTINGS, *extra]
    reference = run_launch([*settings, f"paths.output_root={tmp_path / 'ref'}"], cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]

    root = tmp_path / "killed"
    args = [sys.executable, str(REPO / "launch.py"), *settings, f"paths.output_root={root}"]
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    mid_block = None
    while time.time() < deadline and proc.poll() is None:
        found = [c for c in root.glob("store/*/checkpoints/fit-*.ckpt") if blocks_done(c.parent.parent) == 1]
        if found:  # block 1's checkpoint went when it was recorded: this one is block 2's
            mid_block = found[0]
            break
        time.sleep(0.02)
    assert mid_block is not None, "the run ended before block 2 wrote a checkpoint; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    progress = json.loads((mid_block.parent.parent / "progress.json").read_text())
    assert len(progress["blocks"]) == 1  # killed inside the second block, after the first finished

    resumed = run_launch([*settings, f"paths.output_root={root}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    a, b = _results(tmp_path / "ref"), _results(root)
    for key in NUMBERS:
        assert a[key] == b[key], key
    assert a["blocks"] == b["blocks"]


@pytest.mark.slow
def test_killed_run_resumes_to_identical_results(tmp_path: Path) -> None:
    """End to end: launch.py SIGKILLed mid-block and launched again (the kill points themselves: in process, below)."""
    kill_mid_block_and_resume(tmp_path)


# --- in-process kills at every checkpoint, any patience ---------------------------------------

from conftest import compose_config  # noqa: E402
from mdl.engine.trainer import SaveLastCheckpoint  # noqa: E402
from mdl.run.experiment import run_experiment  # noqa: E402

KILL_SETTINGS = [
    "mdl.members_per_fit=1",
    "mdl.checkpoint_every_s=0",
    "mdl.min_steps_per_pass=1",
    "trainer.kwargs.max_epochs=25",
    "mdl.num_blocks=3",
    "data.first_block=100",
    "width=32",
    "model.base_width=32",
]
EXACT = (
    "paper_mdl",
    "online_codelength_bits",
    "final_val_loss",
    "blocks",
    "val_loss_curve",
    "train_loss_curve",
    "final_epochs",
)


class Killed(Exception):
    """Stands in for SIGKILL right after a checkpoint reached the disk."""


def run_killed_after(cfg, run_dir: Path, saves: int, monkeypatch) -> bool:
    """Run until the ``saves``-th checkpoint is written, then die; False if the run ended first."""
    original = SaveLastCheckpoint.on_train_epoch_end
    count = [0]

    def save_then_maybe_die(self, trainer, module) -> None:
        original(self, trainer, module)
        count[0] += 1
        if count[0] == saves:
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(SaveLastCheckpoint, "on_train_epoch_end", save_then_maybe_die)
        try:
            run_experiment(cfg, run_dir)
        except Killed:
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("patience", [1, pytest.param(2, marks=pytest.mark.slow), 30])  # 2: 25 kills and re-runs
def test_resume_is_exact_at_every_kill_point(patience: int, tmp_path: Path, monkeypatch) -> None:
    """Early-stopping counters, best weights and the stop decision survive a kill at any epoch."""
    settings = [*KILL_SETTINGS, f"trainer.patience={patience}"]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    epochs = sum(b["epochs"] for b in reference["blocks"]) + reference["final_epochs"]
    kill_points = range(1, epochs + 1) if patience < 30 else sorted({1, epochs // 3, epochs // 2, epochs - 1, epochs})
    assert_resumes_exactly(settings, reference, kill_points, tmp_path, monkeypatch)


def assert_resumes_exactly(
    settings: list[str], reference: dict, kill_points, tmp_path: Path, monkeypatch, keys: tuple[str, ...] = EXACT
) -> None:
    """Killed after each of ``kill_points`` checkpoints and re-run, the run equals ``reference`` in ``keys``."""
    for saves in kill_points:
        root = tmp_path / f"kill{saves}"
        cfg = compose_config(settings, root)
        assert run_killed_after(cfg, root / "a", saves, monkeypatch), saves
        resumed = run_experiment(cfg, root / "b")
        for key in keys:
            assert resumed[key] == reference[key], (saves, key)


# --- a resumed run's logger gets the series of the blocks finished before the kill ------------------


def block_series(run_dir: Path) -> dict[str, list[float]]:
    """``block*/val_loss`` per block from a run's CSV log (logger=csv, the default)."""
    import csv

    series: dict[str, list[float]] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith(("block", "final/")) and key.endswith(("/val_loss", "/train_loss")) and value:
                    series.setdefault(key, []).append(float(value))
    return series


def count_saves(cfg, run_dir: Path, monkeypatch) -> int:
    original = SaveLastCheckpoint.on_train_epoch_end
    count = [0]

    def counted(self, trainer, module) -> None:
        original(self, trainer, module)
        count[0] += 1

    with monkeypatch.context() as m:
        m.setattr(SaveLastCheckpoint, "on_train_epoch_end", counted)
        run_experiment(cfg, run_dir)
    return count[0]


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_resumed_run_logs_every_block(engine: str, tmp_path: Path, monkeypatch) -> None:
    """The CSV (and W&B, the same on_block) series of blocks finished before a kill are logged again by the
    resumed run: its log holds every block's curve, equal to an uninterrupted run's."""
    settings = [*KILL_SETTINGS, "trainer.patience=2", FITS[engine]]
    saves = count_saves(compose_config(settings, tmp_path / "ref"), tmp_path / "ref" / "run", monkeypatch)
    reference = block_series(tmp_path / "ref" / "run")
    assert len(reference) == 6  # train and val loss of blocks 1 and 2 and of the final fit

    cfg = compose_config(settings, tmp_path / "kill")
    assert run_killed_after(cfg, tmp_path / "kill" / "a", saves - 1, monkeypatch)
    (progress,) = (tmp_path / "kill" / "store").glob("*/progress.json")
    assert json.loads(progress.read_text())["blocks"], "killed before any block finished; kill later"
    run_experiment(cfg, tmp_path / "kill" / "b")
    assert block_series(tmp_path / "kill" / "b") == reference


@pytest.mark.slow
def test_fits_of_a_few_members_resume_exactly_at_any_kill_point(tmp_path: Path, monkeypatch) -> None:
    """mdl.members_per_fit=2 with 5 members: stacked fits of 2, 2 and a plain fit of the last one. Killed after
    a checkpoint in any of them (blocks of an earlier fit recorded, the fit in progress in its checkpoint) and
    re-run, the run equals an uninterrupted one."""
    settings = [
        "mdl.members_per_fit=2",
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
        "trainer.kwargs.max_epochs=12",
        "trainer.patience=3",
        "mdl.num_blocks=5",
        "data.first_block=100",
        "width=32",
        "model.base_width=32",
        "trainer.torch_threads=1",
    ]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    assert reference["fits"] == "fits of 2"
    saves = count_saves(compose_config(settings, tmp_path / "count"), tmp_path / "count", monkeypatch)
    points = sorted({1, saves // 4, saves // 2, 3 * saves // 4, saves - 1, saves} - {0})
    assert_resumes_exactly(settings, reference, points, tmp_path, monkeypatch)


# --- protocol=original: a fit resumed between two backtracks ------------------------------------------------------


@pytest.mark.slow
def test_a_backtracking_fit_resumed_after_a_backtrack_equals_the_uninterrupted_one(tmp_path: Path, monkeypatch) -> None:
    """After a backtrack the optimizer's tensors are the best epoch's snapshot (``load_state_dict`` keeps tensors of
    the right dtype and device), so training drifts the snapshot until the next improvement, as in the original
    code. A checkpoint restores them as two equal copies: before, a fit killed right after a backtrack and resumed
    backtracked next to the undrifted snapshot (block 0's fourth epoch: 2.302255859 instead of 2.302264811). Kill
    points: each checkpoint written at a backtrack followed by another (patience 3); without the resume's sharing
    the same kills give other numbers, so these points test it."""
    from mdl.engine.stacked_fit import StackedProtocol

    # One order of the pool (no per-block redraw, D10): with the redraw the same rule picks kill points where the
    # unshared copy also resumes to the same numbers (the negative control below did not fail; why is not yet
    # known), so the case this test needs is not reached there. The sharing itself is the same code either way.
    settings = [*KILL_SETTINGS, "protocol=original", "protocol.redraw_per_block=false", "trainer.patience=3"]
    backtracked_at: list[int] = []  # per epoch end, in order: whether it backtracked
    real_end = StackedProtocol._end_epochs

    def recording_end(self, module, ended, trainer) -> list[int]:
        calls = len(backtracked_at)
        with monkeypatch.context() as m:
            m.setattr(StackedProtocol, "_backtrack", lambda *a: (backtracked_at.append(True), real_backtrack(*a)))
            stopping = real_end(self, module, ended, trainer)
        if len(backtracked_at) == calls:
            backtracked_at.append(False)
        return stopping

    real_backtrack = StackedProtocol._backtrack
    with monkeypatch.context() as m:
        m.setattr(StackedProtocol, "_end_epochs", recording_end)
        reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    twice = [i + 1 for i in range(len(backtracked_at) - 1) if backtracked_at[i] and backtracked_at[i + 1]]
    assert twice, "no two backtracks in a row: the case is not reached"
    kill_points = twice[:2]
    assert_resumes_exactly(settings, reference, kill_points, tmp_path / "shared", monkeypatch)

    monkeypatch.setattr(StackedProtocol, "_share_optimizer_tensors", lambda self, optimizer: None)
    with pytest.raises(AssertionError):
        assert_resumes_exactly(settings, reference, kill_points, tmp_path / "copied", monkeypatch)
