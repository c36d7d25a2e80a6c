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
import torch

from conftest import FAST, FITS, REPO, python_path
from datamodules.cache import read_checked
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


def test_a_job_a_launcher_started_names_launch_py_with_its_overrides(monkeypatch, capsys) -> None:
    """In a job of hydra/launcher=local or slurm the process's command line is submitit's: the chaos run saw
    'Command: python .../submitit/core/_submit.py ...'. The command that resumes the run is launch.py with the job's
    overrides."""
    from mdl.run import exits

    monkeypatch.setattr(
        sys, "argv", ["/venv/lib/python3.11/site-packages/submitit/core/_submit.py", "/sweep/.submitit"]
    )
    monkeypatch.setattr(exits, "job_overrides", lambda: ["eraser=leace", "seed=1"])
    with pytest.raises(SystemExit):
        with ends_like_a_run():
            raise Preempted("SIGTERM received")
    assert capsys.readouterr().err.endswith("Command: python launch.py eraser=leace seed=1\n")


def test_a_full_disk_no_folder_named_yet_is_named(capsys) -> None:
    """The chaos run saw a bare 'error: [Errno 28] No space left on device'."""
    import errno

    with pytest.raises(SystemExit):
        with ends_like_a_run():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/store/abc/progress.json")
    err = capsys.readouterr().err
    assert (
        err.startswith("error: [Errno 28] cannot write to /out/store/abc: the disk is full")
        and "paths.output_root=" in err
    )


def test_other_exits_pass_through_unchanged(capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        with ends_like_a_run():
            sys.exit(2)
    assert ended.value.code == 2 and not capsys.readouterr().err


# A QLEACE fit on CIFAR-10's image shape (3x32x32: 3072 x 3072 statistics, eigendecompositions and maps) that CI can
# afford: 2 classes and 2 barycenter iterations (5 eighs of 3072 x 3072, 10-50 s each on 2 cores), a save at every step.
QLEACE_FIT = [
    *FAST,
    "data=synthetic",
    "data.options.shape=[3,32,32]",
    "data.options.n_train=4200",
    "data.options.n_test=200",
    "data.options.num_classes=2",
    "data.val_size=200",
    "data.diagnostics=false",
    "eraser=qleace",
    "eraser.options.max_iter=2",
    "eraser.options.batch_size=2048",
    "eraser.checkpoint_every_s=0",
]


def saved_iteration(cache: Path) -> int | None:
    """The barycenter iteration the cache's partial eraser fit holds (None: no file, or none before the iterations)."""
    from safetensors import safe_open

    for path in cache.glob("*.partial.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            if "barycenter.iteration" in f.keys():
                return int(f.get_tensor("barycenter.iteration"))
    return None


@pytest.mark.slow
def test_sigterm_during_a_qleace_fit_keeps_its_progress_and_the_rerun_resumes_it_bit_identical(tmp_path: Path) -> None:
    """Before: the re-run fitted the eraser again from nothing (8.5 minutes under load at CIFAR-10's size)."""
    caches = {name: tmp_path / f"{name}-cache" for name in ("ref", "preempted")}
    reference = launch([*QLEACE_FIT, f"data.cache_dir={caches['ref']}"], tmp_path / "ref")
    assert reference.wait(timeout=1800) == 0, reference.communicate()[1][-2000:]

    root, args = tmp_path / "preempted", [*QLEACE_FIT, f"data.cache_dir={caches['preempted']}"]
    run = launch(args, root)
    deadline = time.monotonic() + 1800
    while saved_iteration(caches["preempted"]) is None:  # the first iteration saved: the second one is running
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-2000:]
        time.sleep(0.05)
    code, err, _ = terminate(run)
    assert code == EXIT_CODE and "preempted: SIGTERM received" in err, err[-2000:]
    assert saved_iteration(caches["preempted"]) == 1, "the fit's progress is not kept"
    assert not list(caches["preempted"].glob("*.eraser.safetensors")), "the fit ended before the signal"

    rerun = launch(args, root)
    _, err = rerun.communicate(timeout=1800)
    assert rerun.returncode == 0, err[-2000:]
    logs = " ".join(p.read_text(errors="replace") for p in root.glob("runs/**/*.log"))
    assert "resuming the eraser fit after its step" in logs
    assert not list(caches["preempted"].glob("*.partial.safetensors")), "the partial fit outlived the eraser"
    resumed, uninterrupted = results_of(root), results_of(tmp_path / "ref")
    for key in EXACT:
        assert resumed[key] == uninterrupted[key], key
    for kind in ("eraser", "data"):  # the fitted eraser and the erased splits, bit for bit (safetensors orders its
        # header's metadata as it likes: the files' bytes may differ)
        (mine, my_meta), (theirs, their_meta) = (
            read_checked(next(caches[name].glob(f"*.{kind}.safetensors"))) for name in ("preempted", "ref")
        )
        assert my_meta == their_meta and mine.keys() == theirs.keys(), kind
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), kind
