"""A pack fails like a run (issue 34): every error of a packed job gets launch.py's handling (mdl/run/exits.py: a
user error is one line and exit 2, a preemption the ``preempted:`` line and exit 143), SIGTERM to a packed sweep
checkpoints, starts no further pack and resumes bit-identical, and every key is checked before the data load."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from conftest import FAST, compose_config
from mdl.engine.preemption import EXIT_CODE, Preempted, sigterm_guard, sigterm_requested
from mdl.run.config_checks import validate_config
from mdl.run.experiment import Job
from mdl.run.storage import NotEnoughRoom, StalledLockHolder


def _checked(root: Path) -> list[JobReturn]:
    job = Job.checked(compose_config([*FAST, "seed=0"], root), root / "run0")
    return [
        JobReturn(
            overrides=["seed=0"],
            cfg=job.cfg,
            hydra_cfg=None,
            working_dir=str(root),
            task_name="launch",
            status=JobStatus.COMPLETED,
            _return_value=job,
        )
    ]


@pytest.mark.parametrize(
    "error, code, line",
    [
        (ValueError("data.val_size=0: too small"), 2, "error: data.val_size=0: too small"),
        (
            NotEnoughRoom(28, "not enough room in /x: this run's checkpoints need about 4.1 MiB"),
            2,
            "error: [Errno 28] not enough room",
        ),
        (PermissionError(13, "read-only store"), 2, "error: [Errno 13] read-only store"),
        (StalledLockHolder("the holder of /x stopped renewing its lease"), 2, "error: the holder of /x"),
        (
            Preempted("SIGTERM received"),
            EXIT_CODE,
            "preempted: SIGTERM received. Run the same command again to resume.",
        ),
    ],
)
def test_an_error_of_a_pack_ends_the_process_as_launch_py_ends_a_run(
    tmp_path: Path, monkeypatch, capsys, error, code, line
) -> None:
    """Before, ``train_checked`` recorded every error as the pack's jobs' failure and Hydra re-raised it: exit 1 and
    a traceback for what launch.py reports in one line."""
    import mdl.run.pack
    from hydra_plugins.mdl_packed.packed_launcher import train_checked

    def fail(jobs):
        raise error

    monkeypatch.setattr(mdl.run.pack, "run_pack", fail)
    monkeypatch.delenv("MDL_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as ended:
        train_checked(_checked(tmp_path))
    assert ended.value.code == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) == 1, err


def test_a_bug_in_a_pack_still_fails_its_jobs_with_the_traceback(tmp_path: Path, monkeypatch) -> None:
    import mdl.run.pack
    from hydra_plugins.mdl_packed.packed_launcher import train_checked

    def fail(jobs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(mdl.run.pack, "run_pack", fail)
    (ret,) = train_checked(_checked(tmp_path))
    assert ret.status == JobStatus.FAILED and isinstance(ret._return_value, RuntimeError)


def test_a_repeated_sigterm_is_the_same_request() -> None:
    """A process group's kill and a launcher passing it on send a job SIGTERM two or three times: the first stops the
    run, the next ones must not raise again inside the stop's own clean-up."""
    with sigterm_guard():
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # nothing raised: the run is already stopping
        assert sigterm_requested()


def test_a_sigterm_to_the_local_launcher_is_passed_on_to_its_running_jobs() -> None:
    """Before, a plain ``kill <pid>`` of a hydra/launcher=local sweep was recorded by the launcher and the jobs trained
    on: only a process group's kill stopped them. Here two children of this process stand in for submitit's job
    controllers (the same command line); a third child, not a controller, is left alone."""
    import subprocess
    import sys

    from hydra_plugins.mdl_local.local_launcher import sigterm_recorded

    sleep = "import time; time.sleep(60)"
    controller = [sys.executable, "-c", sleep, "-m", "submitit.local._local"]  # what /proc/<pid>/cmdline shows
    jobs = [subprocess.Popen(controller) for _ in range(2)]
    other = subprocess.Popen([sys.executable, "-c", sleep])
    try:
        with sigterm_recorded() as requested:
            signal.raise_signal(signal.SIGTERM)
        assert requested == [signal.SIGTERM]
        assert [job.wait(timeout=30) for job in jobs] == [-signal.SIGTERM] * 2 and other.poll() is None
    finally:
        for process in (*jobs, other):
            process.kill()
            process.wait()


def test_a_sigterm_in_a_sweeps_guard_is_not_cleared_by_the_next_run() -> None:
    """Before, every run's ``sigterm_guard`` cleared the request: the packed launcher's next pack started and trained."""
    with sigterm_guard():
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGTERM)
        assert sigterm_requested()
        with pytest.raises(Preempted, match="before this run started"):
            with sigterm_guard():
                pass  # a pack's run_pack: never started
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler) or callable(
        signal.getsignal(signal.SIGTERM)
    )


@pytest.mark.parametrize("value", ["0", "x", "nan", "inf", "-0.5", "true"])
def test_pack_data_gb_is_refused_before_the_data_load_in_every_run(tmp_path: Path, value: str) -> None:
    """A single run does not use the key, but a value a packed sweep would refuse is refused in every run, so no
    run records it; the retired share of the device's memory names its replacement."""
    with pytest.raises(ValueError, match="mdl.pack_data_gb=.*a number > 0"):
        validate_config(compose_config([*FAST, f"mdl.pack_data_gb={value}"], tmp_path))
    validate_config(compose_config([*FAST, "mdl.pack_data_gb=0.001"], tmp_path))
    with pytest.raises(ValueError, match="mdl.pack_data_fraction is gone.*mdl.pack_data_gb"):
        validate_config(compose_config([*FAST, "+mdl.pack_data_fraction=0.5"], tmp_path))


@pytest.mark.parametrize(
    "args, named",
    [
        (["-m", "seed=abc"], "seed='abc'"),
        (["-m", "seed=0,1", "mdl.pack_data_gb=0"], "mdl.pack_data_gb=0"),
        (["-m", "seed=0,1", "data_seed=x"], "data_seed='x'"),
    ],
)
def test_the_cost_estimate_refuses_what_launch_py_refuses(capsys, args, named) -> None:
    """Seed and bookkeeping keys do not change a job's cost, so the estimate used to leave them unchecked."""
    from mdl.sweeps.cost import main

    with pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == 2 and named in capsys.readouterr().err


# --- SIGTERM, a real signal to a real packed sweep (as tests/test_preemption.py does for single runs) ----------------

PACKED_RUN = [
    "-m",
    "hydra/launcher=packed",
    "trainer.kwargs.max_epochs=100",
    "trainer.patience=100",
    "mdl.checkpoint_every_s=1000",
    "mdl.num_blocks=3",
    "data.first_block=100",
    "model.base_width=32",
    "trainer.torch_threads=1",
]
EXACT = ("paper_mdl", "online_codelength_bits", "final_val_loss", "val_loss_curve", "blocks")


def _sweep_results(root: Path) -> dict[str, dict]:
    """The sweep's results by job folder name (its overrides)."""
    return {p.parent.name.split("_", 1)[1]: json.loads(p.read_text()) for p in root.glob("multirun/*/*/*/results.json")}


def _checkpointed_after_results(root: Path) -> bool:
    """A pack checkpoint newer than every results.json of the sweep: a later pack's (the first pack's own checkpoint,
    written before its results, stays a moment after them, until its folder is removed)."""
    try:
        results = [p.stat().st_mtime_ns for p in root.glob("multirun/*/*/*/results.json")]
        saved = [p.stat().st_mtime_ns for p in root.glob("store/packs/*/checkpoints/*.ckpt")]
    except FileNotFoundError:  # removed between the listing and its stat
        return False
    return bool(results) and any(t > max(results) for t in saved)


def _wait_for(condition, process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"the sweep ended first: {process.communicate()[1][-3000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sweep, killed_in",
    [
        (["seed=0,1", "width=16,32"], "first of two packs"),
        (["seed=0,1", "eraser=none,leace", "mdl.pack_data_gb=1e-9"], "first of two packs"),  # a pack per data set
        (["seed=0,1", "eraser=none,leace", "mdl.pack_data_gb=1e-9"], "second of two packs"),
    ],
    ids=["two-packs", "data-1", "data-2"],
)
def test_sigterm_to_a_packed_sweep_checkpoints_starts_nothing_more_exits_143_and_resumes_exactly(
    tmp_path: Path, sweep: list[str], killed_in: str
) -> None:
    """Before: exit 1 with Hydra's "Error executing job" and a Preempted traceback, and the launcher started the next
    pack two seconds later and trained it to the end."""
    from test_preemption import launch, terminate

    args = [*PACKED_RUN, *sweep]
    reference = launch(args, tmp_path / "ref")
    assert reference.wait(timeout=900) == 0, reference.communicate()[1][-3000:]
    expected = _sweep_results(tmp_path / "ref")

    root = tmp_path / "preempted"
    run = launch(args, root)
    checkpoints = lambda: list(root.glob("store/packs/*/checkpoints/*.ckpt"))  # noqa: E731
    if killed_in == "second of two packs":  # the first pack's results are written, the second has checkpointed
        _wait_for(lambda: _checkpointed_after_results(root), run)
    else:
        _wait_for(checkpoints, run)
    before = len(_sweep_results(root))
    time.sleep(0.5)  # into later epochs
    code, err, _ = terminate(run)
    assert code == EXIT_CODE, err[-3000:]
    assert "preempted: SIGTERM received" in err and "Run the same command again to resume" in err
    assert "Traceback" not in err and "Error executing job" not in err
    assert checkpoints(), "no checkpoint left to resume from"
    assert len(_sweep_results(root)) == before, "the sweep went on after the signal"
    if killed_in == "first of two packs":
        assert len(list(root.glob("store/*/progress.json"))) == 2, "the second pack started"

    rerun = launch(args, root)
    _, rerun_err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, rerun_err[-3000:]
    resumed = _sweep_results(root)
    assert resumed.keys() == expected.keys() and len(expected) == 4
    for job, result in expected.items():
        for key in EXACT:
            assert resumed[job][key] == result[key], (job, key)


# --- a pack's own records and room -------------------------------------------------------------------------------

SHORT = [*FAST, "trainer.kwargs.max_epochs=2", "trainer.torch_threads=1"]


def _pack_jobs(root: Path) -> list[Job]:
    variants = [["eraser=none"], ["eraser=none", "seed=1"], ["eraser=leace"], ["eraser=leace", "seed=1"]]
    return [Job.checked(compose_config([*SHORT, *v], root), root / f"run{i}") for i, v in enumerate(variants)]


@pytest.mark.slow
def test_the_packs_room_check_counts_every_runs_checkpoints(tmp_path: Path, monkeypatch) -> None:
    """Room for one run's checkpoints but not for the pack's (they live in the pack's folder, all runs' members in
    one file): refused before training, not seconds into the fit."""
    import shutil
    from collections import namedtuple

    from mdl.run.components import make_model_factory
    from mdl.run.experiment import checkpoint_bytes, job_data
    from mdl.run.pack import run_pack

    jobs = _pack_jobs(tmp_path)
    dm = job_data(jobs[0])
    one_run = checkpoint_bytes(jobs[0].cfg, make_model_factory(jobs[0].cfg, dm.num_classes, dm.input_shape))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * one_run, 8 * one_run, int(1.5 * one_run)))
    with pytest.raises(NotEnoughRoom, match=r"this pack's checkpoints \(4 runs\) need about"):
        run_pack(jobs)
    assert not list(tmp_path.glob("**/*.ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize("to", ["job", "launcher"])
def test_sigterm_to_a_job_of_the_local_launcher_ends_the_sweep_with_the_preempted_line(tmp_path: Path, to: str) -> None:
    """hydra/launcher=local (submitit): the job checkpoints and exits 143; its launcher used to die with submitit's
    UncompletedJobError traceback and exit 1. A plain ``kill <pid>`` of the launcher (not its process group) used to
    leave the job training on."""
    import os

    from test_preemption import LONG_RUN, first_checkpoint, launch

    run = launch(["-m", "hydra/launcher=local", "seed=0", *LONG_RUN], tmp_path)
    first_checkpoint(tmp_path, run, timeout=300)
    (holder,) = tmp_path.glob("store/*/run.lock.holder.json")
    job = json.loads(holder.read_text())["pid"]
    os.kill(job if to == "job" else run.pid, signal.SIGTERM)  # the job, as Slurm's preemption signals it; or `kill`
    _, err = run.communicate(timeout=300)
    assert run.returncode == EXIT_CODE, err[-3000:]
    assert "preempted: SIGTERM received" in err and "Traceback" not in err and "UncompletedJobError" not in err


# --- SIGTERM during the data's preparation at CIFAR-10's size ------------------------------------------------------

# A synthetic data set of CIFAR-10's size and shape (3x32x32, 50000 + 10000 images, 10 classes): the eraser's
# statistics and maps are 3072 x 3072, as on CIFAR-10 (conf/data/synthetic.yaml).
CIFAR_SIZED = [
    "data=synthetic",
    "data.options.shape=[3,32,32]",
    "data.options.n_train=50000",
    "data.options.n_test=10000",
    "data.options.num_classes=10",
    "data.val_size=5000",
]
SLURM_GRACE_S = 30  # Slurm's usual KillWait between SIGTERM and SIGKILL


@pytest.mark.slow
def test_sigterm_during_a_cifar_sized_eraser_fit_is_honoured_within_slurms_grace_and_the_rerun_finishes(
    tmp_path: Path,
) -> None:
    """Before: honoured 435 s later on a busy 2-core machine (one eigh of a 3072 x 3072 matrix took 77-160 s there, one
    uninterruptible call); Slurm would have killed the job mid-write."""
    from test_preemption import launch

    # LEACE: a 3072 x 3072 eigh as QLEACE's, without its dozens more (hours on a busy 2-core machine for the re-run)
    args = [*FAST, *CIFAR_SIZED, "eraser=leace", f"data.cache_dir={tmp_path / 'cache'}"]
    run = launch(args, tmp_path / "out")
    logs = lambda: " ".join(p.read_text(errors="replace") for p in (tmp_path / "out").glob("runs/**/*.log"))  # noqa: E731
    _wait_for(lambda: "fitting eraser" in logs(), run, timeout=1200)
    time.sleep(5)  # into the fit
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=600)
    took = time.monotonic() - sent
    assert run.returncode == EXIT_CODE and "preempted: SIGTERM received" in err, err[-3000:]
    assert took < SLURM_GRACE_S, f"honoured {took:.0f} s after SIGTERM"
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".")], "a partial cache file was left"

    rerun = launch(args, tmp_path / "out")
    _, err = rerun.communicate(timeout=3600)
    assert rerun.returncode == 0, err[-3000:]
    assert list((tmp_path / "out").glob("runs/**/results.json"))


def test_data_work_is_interruptible_and_otherwise_the_same(monkeypatch) -> None:
    """datamodules/interrupts.py: the work's value and errors as in the main thread; a signal handler's exception
    ends the wait at once (the work, a LAPACK call of minutes at CIFAR-10's size, is abandoned)."""
    import threading

    import datamodules.interrupts as interrupts

    assert interrupts.interruptible(lambda: 41 + 1) == 42
    with pytest.raises(ValueError, match="bad"):
        interrupts.interruptible(lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert not interrupts.abandoned()

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGUSR1)).start()  # from a thread: as a kill arrives
        start = time.monotonic()
        with pytest.raises(Stop):
            interrupts.interruptible(lambda: time.sleep(20))
        assert time.monotonic() - start < 5
        assert interrupts.abandoned()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        interrupts._abandoned.clear()  # this process goes on: its later tests must not be ended at once


# submitit's message for a job of hydra/launcher=local killed with SIGKILL (as the chaos run saw it: scripts/chaos_sweep.py)
KILLED_JOB = """Job 8696 (task: 0) with path /out/multirun/d/t/.submitit/8696/8696_0_result.pkl
has not produced any output (state: FINISHED)
No error stream produced. Look at stdout: /out/multirun/d/t/.submitit/8696/8696_0_log.out
----------------------------------------
submitit INFO (2026-11-28 01:48:58,292) - Starting with JobEnvironment(job_id=8696, hostname=vm, local_rank=0(1))
run: /out/multirun/d/t/0_debug=fast,eraser=none,seed=0 (loading torch and lightning)
"""


def test_a_job_of_the_local_launcher_killed_outright_ends_the_sweep_with_one_error_line() -> None:
    """Before: the launcher re-raised submitit's UncompletedJobError, a traceback and exit 1 for a job the
    out-of-memory killer (or a node's SIGKILL) ended; a job's own last words still win."""
    from hydra_plugins.mdl_local.local_launcher import job_ending

    line, code = job_ending(KILLED_JOB, sigterm=False)
    assert code == 1 and len(line.splitlines()) == 1
    assert line.startswith("error: job 8696 of the sweep ended without a result or a message: it was killed")
    assert "/out/multirun/d/t/.submitit/8696" in line and "Run the same command again" in line
    own = KILLED_JOB.replace("No error stream", "Error stream produced:\nerror: the disk is full\nNo error stream")
    assert job_ending(own, sigterm=False) == ("error: the disk is full", 2)
    assert job_ending("a message of another kind", sigterm=False) is None
