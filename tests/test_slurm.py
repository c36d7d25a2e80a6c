"""Sweeps through hydra-submitit-launcher: on a real Slurm (sbatch), through submitit locally,
preemption + requeue + resume, skip-if-done, and the checks that stop a bad sweep early.

Tests marked ``slurm`` need a running cluster: ``sudo bash scripts/slurm_local.sh start``.
Every job they submit carries a unique ``--comment`` so cleanup cancels only its own jobs.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import FITS

from mdl.sweeps.checks import (
    LOCAL_LAUNCHER,
    SLURM_LAUNCHER,
    SweepSetupError,
    accepted_keys,
    check_launcher,
    sbatch_flags,
)

REPO = Path(__file__).resolve().parents[1]
CALLBACK_TARGET = "mdl.sweeps.checks.LauncherChecks"
# Small and fast: 3 prequential blocks, 2 epochs per fit, a narrow MLP on digits.
FAST = ["width=16", "mdl.num_blocks=3", "trainer.kwargs.max_epochs=2", "trainer.patience=1"]
SWEEP = ["seed=0,1", "eraser=none,leace"]
SWEEP_JOBS = {("none", 0), ("leace", 0), ("none", 1), ("leace", 1)}
NUMBERS = ("online_codelength_bits", "online_bits_per_example", "paper_mdl", "final_val_loss")


@functools.lru_cache(maxsize=1)
def slurm_unavailable() -> str | None:
    """Why the cluster tests cannot run here, or None when a controller answers."""
    if shutil.which("sbatch") is None:
        return "sbatch not on PATH: start the local cluster with `sudo bash scripts/slurm_local.sh start`"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"sinfo failed ({err}): is the Slurm controller up? (scripts/slurm_local.sh start)"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mix", "alloc", "comp") for s in states):
        return f"no usable Slurm node (sinfo: {out.stdout.strip() or out.stderr.strip()}): scripts/slurm_local.sh start"
    return None


needs_slurm = pytest.mark.skipif(slurm_unavailable() is not None, reason=str(slurm_unavailable()))


def compose_hydra(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def callback_registered() -> bool:
    cfg = compose_hydra([])
    callbacks = OmegaConf.select(cfg, "hydra.callbacks") or {}
    return any(str(c.get("_target_")) == CALLBACK_TARGET for c in callbacks.values())


def callback_args() -> list[str]:
    """Register the checks on the command line until conf/config.yaml does (see its test)."""
    return [] if callback_registered() else [f"+hydra.callbacks.launcher_checks._target_={CALLBACK_TARGET}"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Outputs and the finished-run store in a fresh folder; jobs sized for a 2-core CI machine."""
    e = dict(os.environ)
    e["SLOWING_OUTPUT_ROOT"] = str(tmp_path / "out")
    e["HYDRA_FULL_ERROR"] = "0"
    for key, value in {
        "MDL_SLURM_GPUS_PER_NODE": "0",
        "MDL_SLURM_CPUS_PER_TASK": "1",
        "MDL_SLURM_MEM_GB": "2",
        "MDL_SLURM_TIMEOUT_MIN": "60",  # > 50 min: a USR2 counts as preemption, not time-out
        "MDL_LOCAL_CPUS_PER_TASK": "1",
        "MDL_LOCAL_TIMEOUT_MIN": "20",
    }.items():
        e.setdefault(key, value)
    return e


@pytest.fixture
def tag():
    """A unique sbatch --comment; afterwards cancel whatever jobs of this test are left."""
    value = f"pytest-{uuid.uuid4().hex[:12]}"
    yield value
    for job in own_jobs(value):
        subprocess.run(["scancel", job], capture_output=True)


def own_jobs(tag: str) -> list[str]:
    """This test's jobs in Slurm's queue; none where no cluster answers (squeue would wait 10 s for it to say so)."""
    if slurm_unavailable() is not None:
        return []
    out = subprocess.run(["squeue", "-h", "-o", "%i|%k"], capture_output=True, text=True).stdout
    return [line.split("|", 1)[0] for line in out.splitlines() if line.endswith(f"|{tag}")]


def launch(args: list[str], env: dict[str, str], timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def sweep_results(out_root: Path) -> dict[Path, list[dict]]:
    """results.json of every sweep under out_root, by sweep directory, in sweep order."""
    sweeps: dict[Path, list[dict]] = {}
    for path in sorted((out_root / "multirun").glob("*/*/*/results.json")):
        sweeps.setdefault(path.parent.parent, []).append(json.loads(path.read_text()))
    return dict(sorted(sweeps.items()))


def job_keys(results: list[dict]) -> set[tuple[str, int]]:
    return {(r["config"]["eraser"]["name"], r["config"]["seed"]) for r in results}


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"launch.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


# --- the checks themselves (no cluster needed) -------------------------------------------------


def test_callback_registered_in_config():
    assert callback_registered(), (
        "conf/config.yaml does not register the pre-submission checks; add under `hydra:`\n"
        "  callbacks:\n    launcher_checks:\n      _target_: mdl.sweeps.checks.LauncherChecks"
    )


def test_launcher_configs_use_only_plugin_keys():
    for name, target in (("slurm", SLURM_LAUNCHER), ("local", LOCAL_LAUNCHER)):
        launcher = compose_hydra([f"hydra/launcher={name}"]).hydra.launcher
        assert launcher._target_ == target
        assert set(launcher.keys()) <= set(accepted_keys(target))
        raw = OmegaConf.to_container(launcher, resolve=False)
        assert str(raw["submitit_folder"]).startswith("${hydra.sweep.dir}/")  # lives in the sweep dir


def test_slurm_resources_come_from_environment(monkeypatch):
    monkeypatch.setenv("MDL_SLURM_PARTITION", "gpu-long")
    monkeypatch.setenv("MDL_SLURM_GPUS_PER_NODE", "4")
    monkeypatch.setenv("MDL_SLURM_MEM_GB", "64")
    monkeypatch.setenv("MDL_SLURM_TIMEOUT_MIN", "90")
    launcher = compose_hydra(["hydra/launcher=slurm"]).hydra.launcher
    assert (launcher.partition, launcher.gpus_per_node, launcher.mem_gb, launcher.timeout_min) == (
        "gpu-long",
        4,
        64,
        90,
    )
    flags = sbatch_flags({k: launcher[k] for k in ("partition", "gpus_per_node", "mem_gb", "timeout_min")})
    assert flags == {"partition": "gpu-long", "gpus_per_node": 4, "mem": "64GB", "time": 90}


def test_unknown_launcher_key_is_named_with_the_accepted_ones():
    launcher = compose_hydra(["hydra/launcher=slurm", "+hydra.launcher.gpus=2"]).hydra.launcher
    with pytest.raises(SweepSetupError, match=r"unknown option\(s\) 'gpus'.*gpus_per_node"):
        check_launcher(launcher, test_submission=False)


def test_hydra_itself_rejects_unknown_key_override():
    """Without '+', Hydra's structured config stops the command line at compose time."""
    with pytest.raises(Exception, match=r"Could not override 'hydra.launcher.gpus'"):
        compose_hydra(["hydra/launcher=slurm", "hydra.launcher.gpus=2"])


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("MDL_SLURM_MEM_GB", "lots")
    launcher = compose_hydra(["hydra/launcher=slurm"]).hydra.launcher
    with pytest.raises(SweepSetupError, match=r"hydra.launcher.mem_gb is invalid.*'lots'"):
        check_launcher(launcher, test_submission=False)


def test_missing_sbatch_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no Slurm commands
    launcher = compose_hydra(["hydra/launcher=slurm"]).hydra.launcher
    with pytest.raises(SweepSetupError, match=r"sbatch.*not on PATH.*slurm_local.sh start.*hydra/launcher=local"):
        check_launcher(launcher)
    check_launcher(compose_hydra(["hydra/launcher=local"]).hydra.launcher)  # local needs no sbatch
    check_launcher(compose_hydra([]).hydra.launcher)  # Hydra's basic launcher: nothing to check


@pytest.mark.parametrize("case", ["unknown_key", "no_sbatch"])
def test_launch_stops_before_submission(case, env, tmp_path, tag):
    """The real entry point exits 1 with the message, creates no sweep folder, submits nothing."""
    args = ["-m", "hydra/launcher=slurm", *SWEEP, *FAST, f"hydra.launcher.comment={tag}", *callback_args()]
    if case == "unknown_key":
        args.append("+hydra.launcher.gpus=1")
        expected = "unknown option(s) 'gpus'"
    else:
        bin_dir = tmp_path / "bin"  # python only: sbatch and every other Slurm command are gone
        bin_dir.mkdir()
        (bin_dir / "python").symlink_to(sys.executable)
        env["PATH"] = str(bin_dir)
        expected = "`sbatch`, which is not on PATH"
    proc = launch(args, env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Nothing was submitted" in proc.stderr
    assert not (Path(env["SLOWING_OUTPUT_ROOT"]) / "multirun").exists()
    assert own_jobs(tag) == []


@pytest.mark.slurm
@needs_slurm
def test_impossible_request_rejected_by_slurm_before_submission(env, tag):
    env["MDL_SLURM_CPUS_PER_TASK"] = "100000"
    proc = launch(
        ["-m", "hydra/launcher=slurm", "seed=0", *FAST, f"hydra.launcher.comment={tag}", *callback_args()], env, 120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Slurm rejects the sweep's job request" in proc.stderr and "cpus_per_task=100000" in proc.stderr
    assert own_jobs(tag) == []


# --- real sweeps --------------------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
def test_slurm_sweep_then_relaunch_skips_all(env, tag):
    """4 jobs as one sbatch array write 4 results; the same sweep again skips all 4."""
    args = ["-m", "hydra/launcher=slurm", *SWEEP, *FAST, f"hydra.launcher.comment={tag}", *callback_args()]
    assert_ok(launch(args, env))
    out_root = Path(env["SLOWING_OUTPUT_ROOT"])
    [(sweep_dir, results)] = sweep_results(out_root).items()
    assert len(results) == 4 and job_keys(results) == SWEEP_JOBS
    assert not any(r.get("skipped") for r in results)
    [script] = sweep_dir.glob(".submitit/*/*_submission.sh")  # one array, submitted with sbatch
    assert "#SBATCH --array=0-3%" in script.read_text()
    assert len(list(sweep_dir.glob(".submitit/*/*_result.pkl"))) == 4

    again = launch(args, env)
    assert_ok(again)
    sweeps = sweep_results(out_root)
    assert len(sweeps) == 2, "the re-launch must get its own sweep directory"
    relaunched = sweeps[max(sweeps)]
    assert job_keys(relaunched) == SWEEP_JOBS and all(r.get("skipped") for r in relaunched)
    first = {(r["config"]["eraser"]["name"], r["config"]["seed"]): r for r in results}
    for r in relaunched:
        assert r["paper_mdl"] == first[(r["config"]["eraser"]["name"], r["config"]["seed"])]["paper_mdl"]
    assert "0 run, 4 skipped" in again.stdout + again.stderr


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
def test_packed_slurm_sweep_is_one_array_task_per_pack_with_the_packed_numbers(env, tag, tmp_path):
    """hydra/launcher=packed_slurm: 2 erasers x 2 seeds are one pack, so one array task; each job its own
    results.json with the numbers the local packed launcher gives it."""
    fast = [*SWEEP, *FAST, "trainer.torch_threads=1"]  # the node's CPU count must not change the runs
    assert_ok(
        launch(["-m", "hydra/launcher=packed_slurm", *fast, f"hydra.launcher.comment={tag}", *callback_args()], env)
    )
    [(sweep_dir, results)] = sweep_results(Path(env["SLOWING_OUTPUT_ROOT"])).items()
    assert len(results) == 4 and job_keys(results) == SWEEP_JOBS
    [script] = sweep_dir.glob(".submitit/*/*_submission.sh")  # one sbatch (an array of one task is a plain job)
    assert "--array" not in script.read_text() and "srun" in script.read_text()
    assert len(list(sweep_dir.glob(".submitit/*/*_result.pkl"))) == 1  # one task: the pack
    local = launch(["-m", "hydra/launcher=packed", *fast, f"paths.output_root={tmp_path / 'local'}"], env)
    assert_ok(local)
    [(_, expected)] = sweep_results(tmp_path / "local").items()
    paper = lambda rs: {(r["config"]["eraser"]["name"], r["config"]["seed"]): r["paper_mdl"] for r in rs}  # noqa: E731
    assert paper(results) == paper(expected)


@pytest.mark.slow
def test_local_launcher_runs_the_same_sweep(env):
    proc = launch(["-m", "hydra/launcher=local", *SWEEP, *FAST, *callback_args()], env)
    assert_ok(proc)
    [(sweep_dir, results)] = sweep_results(Path(env["SLOWING_OUTPUT_ROOT"])).items()
    assert len(results) == 4 and job_keys(results) == SWEEP_JOBS
    assert len(list(sweep_dir.glob(".submitit/*/*_result.pkl"))) == 4  # went through submitit


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
@pytest.mark.parametrize(
    ("interrupt", "engine"), [("usr2", "sequential"), ("requeue", "sequential"), ("requeue", "stacked")]
)
def test_preempted_job_resumes_and_matches_uninterrupted_run(interrupt, engine, env, tmp_path, tag):
    """Interrupted mid-fit, the job is requeued, resumes from its checkpoint and ends with the
    numbers of an uninterrupted run. usr2: submitit's preemption/time-out signal (it requeues
    the job itself); requeue: `scontrol requeue`, a hard kill + requeue by Slurm (node failure,
    preemption without warning)."""
    job = [
        "seed=0",
        "eraser=leace",
        "width=16",
        "mdl.num_blocks=3",
        "trainer.kwargs.max_epochs=40",
        "trainer.patience=40",
        FITS[engine],
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
    ]
    ref_env = dict(env, SLOWING_OUTPUT_ROOT=str(tmp_path / "reference"))
    reference = subprocess.Popen(  # uninterrupted, Hydra's basic launcher, alongside
        [sys.executable, "launch.py", *job],
        cwd=REPO,
        env=ref_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    out_root = Path(env["SLOWING_OUTPUT_ROOT"])
    sweep = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "-m",
            "hydra/launcher=slurm",
            *job,
            f"hydra.launcher.comment={tag}",
            *callback_args(),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        # a finished block on record and a fit in progress with a checkpoint
        while not (list(out_root.glob("store/*/progress.json")) and list(out_root.glob("store/*/checkpoints/*.ckpt"))):
            assert sweep.poll() is None and time.monotonic() < deadline, "job never got past its first block"
            time.sleep(0.1)
        [job_id] = own_jobs(tag)
        command = ["scancel", "--signal=USR2", job_id] if interrupt == "usr2" else ["scontrol", "requeue", job_id]
        subprocess.run(command, check=True)
        out, _ = sweep.communicate(timeout=360)
        assert sweep.returncode == 0, out[-5000:]
        _, ref_err = reference.communicate(timeout=360)
        assert reference.returncode == 0, ref_err[-5000:]
    finally:
        for proc in (sweep, reference):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)

    [(sweep_dir, [resumed])] = sweep_results(out_root).items()
    log = "".join(p.read_text() for p in sweep_dir.glob(".submitit/*/*_log.*"))
    # usr2: submitit logs "Requeued job" after its `scontrol requeue`, unless Slurm's SIGTERM for that requeue
    # ends the process first (our checkpoint-and-exit handler); Slurm's own line says so either way
    requeued = (
        ("Requeued job" in log or "DUE TO JOB REQUEUE" in log) if interrupt == "usr2" else "DUE TO JOB REQUEUE" in log
    )
    assert requeued, "the job was not requeued"
    assert "resuming" in log, "the requeued job started over instead of resuming"
    [ref_path] = (tmp_path / "reference").glob("runs/*/*/results.json")
    expected = json.loads(ref_path.read_text())
    for key in NUMBERS:
        assert resumed[key] == pytest.approx(expected[key], rel=1e-9), key
    assert [b["eval_bits"] for b in resumed["blocks"]] == pytest.approx(
        [b["eval_bits"] for b in expected["blocks"]], rel=1e-9
    )
    assert resumed["val_loss_curve"] == pytest.approx(expected["val_loss_curve"], rel=1e-9)
