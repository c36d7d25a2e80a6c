"""SIGTERM, as Slurm sends it on preemption and at the time limit, sent to a real launch.py process:
the run checkpoints, says so and exits non-zero (it used to exit 0 with no message and no
checkpoint), and re-running the same command finishes with the numbers of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FITS, REPO, python_path
from mdl.engine.preemption import EXIT_CODE, Preempted
from mdl.run.exits import ends_like_a_run

# Long enough to be interrupted (hundreds of epochs), checkpointing only at the first epoch end
# unless a SIGTERM forces one: a checkpoint newer than the signal proves it was written for it.
LONG_RUN = [
    "trainer.kwargs.max_epochs=300",
    "trainer.patience=300",
    "mdl.checkpoint_every_s=1000",
    "mdl.num_blocks=3",
    "data.first_block=100",
    "width=32",
    "model.base_width=32",
]
EXACT = ("paper_mdl", "online_codelength_bits", "final_val_loss", "val_loss_curve", "blocks")


def launch(args: list[str], root: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": python_path(), "SLOWING_OUTPUT_ROOT": str(root)}
    return subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=root.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_checkpoint(root: Path, process: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(root.glob("store/*/checkpoints/*.ckpt"))
        if found:
            return found[0]
        if process.poll() is not None:
            raise AssertionError(f"the run ended before its first checkpoint: {process.communicate()[1][-2000:]}")
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def terminate(process: subprocess.Popen) -> tuple[int, str, float]:
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    return process.returncode, err, sent


def results_of(root: Path) -> dict:
    (path,) = root.glob("runs/*/*/results.json")
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_sigterm_checkpoints_exits_nonzero_and_the_rerun_finishes_as_if_uninterrupted(
    tmp_path: Path, engine: str
) -> None:
    args = [*LONG_RUN, FITS[engine]]
    reference = launch(args, tmp_path / "ref")
    assert reference.wait(timeout=600) == 0, reference.communicate()[1][-2000:]

    root = tmp_path / "preempted"
    run = launch(args, root)
    first = first_checkpoint(root, run)
    time.sleep(0.5)  # into later epochs
    code, err, sent = terminate(run)
    assert code == EXIT_CODE, err[-2000:]
    assert "preempted: SIGTERM received" in err and "Run the same command again to resume" in err
    checkpoints = sorted(root.glob("store/*/checkpoints/*.ckpt"))
    assert checkpoints, "no checkpoint left to resume from"
    assert max(p.stat().st_mtime for p in checkpoints) >= sent or checkpoints != [first], (
        "no checkpoint written for the signal"
    )
    assert not list(root.glob("runs/*/*/results.json")), "a preempted run must not write results"

    rerun = launch(args, root)
    _, rerun_err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, rerun_err[-2000:]
    resumed, uninterrupted = results_of(root), results_of(tmp_path / "ref")
    for key in EXACT:
        assert resumed[key] == uninterrupted[key], key


@pytest.mark.slow
def test_a_preempted_multirun_fails_instead_of_reporting_success(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    run = launch(["-m", *LONG_RUN, "seed=0,1"], root)
    first_checkpoint(root, run)
    code, err, _ = terminate(run)
    assert code == EXIT_CODE, err[-2000:]
    assert "preempted" in err
    assert not list(root.glob("multirun/*/*/1_*/results.json")), "the sweep went on to its next job"


def _ctrl_c_in_a_fit() -> None:
    """What Lightning raises for a Ctrl-C in a fit (lightning.pytorch.trainer.call._call_and_handle_interrupt)."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        sys.exit(1)


def _ctrl_c() -> None:
    raise KeyboardInterrupt


def _preempted() -> None:
    raise Preempted("SIGTERM received (preemption or time limit): stopped; finished blocks are saved")


@pytest.mark.parametrize(
    "stop, status, line",
    [
        (_ctrl_c_in_a_fit, 130, "interrupted: Ctrl-C: "),
        (_ctrl_c, 130, "interrupted: Ctrl-C: "),
        (_preempted, 143, "preempted: "),
    ],
)
def test_an_interrupt_ends_with_one_line_naming_the_command_that_resumes_it(
    monkeypatch, capsys, stop, status, line
) -> None:
    """A Ctrl-C ended launch.py with exit status 1 and no message (Lightning's SystemExit), or a traceback."""
    monkeypatch.setattr(sys, "argv", ["launch.py", "eraser=qleace", "tags=[a,b]"])
    with pytest.raises(SystemExit) as ended:
        with ends_like_a_run(), ends_like_a_run():  # a packed launcher's, around each pack's: said once
            stop()
    err = capsys.readouterr().err
    assert ended.value.code == status and err.count("\n") == 1 and err.startswith(line), err
    assert err.endswith("Run the same command again to resume. Command: python launch.py eraser=qleace 'tags=[a,b]'\n")


def test_other_exits_pass_through_unchanged(capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        with ends_like_a_run():
            sys.exit(2)
    assert ended.value.code == 2 and not capsys.readouterr().err
