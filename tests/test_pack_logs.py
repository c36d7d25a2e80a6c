"""A pack logs like a run (mdl/run/pack.py, ``hydra/launcher=packed``): each run of a pack gets its own W&B run, CSV
and TensorBoard log, holding exactly the series the same run logs alone, after a kill and a relaunch too."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

from conftest import FAST, compose_config

WANDB_OWN = ("_timestamp", "_runtime", "_step", "_wandb")  # W&B's own bookkeeping: when and in which order, not what
# W&B copies the last value of a step metric into rows logged without it (define_metric's step_sync) as its threads get to
# them: in one launch or another. The rows' epochs are those of the CSV, which gets the same calls (LoggerGroup).
STEPS = ("epoch", "trainer/global_step")
# A logged table's summary entry is W&B's record of the file it wrote (type, size, columns), filled in by its writer
# thread as it gets there: some fields in one launch, others in another. The tables' rows are the blocks of
# results.json, compared with the series.
TABLES = ("blocks",)
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the tensorboard extra
LOGGERS = "logger=[csv,wandb,tensorboard]" if TENSORBOARD else "logger=[csv,wandb]"
MEDIA_PLACES = (
    "path",
    "artifact_path",
    "_latest_artifact_path",
)  # where W&B put a table or image: by step or a random id


def logged(
    rows: Iterable[dict[str, Any]], ignored: Callable[[str], bool], epochs: bool = True
) -> list[tuple[str, str, str]]:
    """Every value logged, as (key, the epoch of its row, value), sorted: a run's series whatever the order of the
    calls (a relaunch logs the epochs finished before a kill first); a value logged twice shows twice."""
    return sorted(
        (key, str(row.get("epoch", "")) if epochs else "", str(value))
        for row in rows
        for key, value in row.items()
        if not ignored(key) and value not in ("", None)
    )


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def csv_series(run_dir: Path) -> list[tuple[str, str, str]]:
    return logged(csv_rows(run_dir), ignored=lambda key: key == "step")  # CSVLogger's own row count


def wandb_file(run_dir: Path) -> Path:
    """The run's one W&B run file (a second one: W&B runs mixed up)."""
    (found,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return found


def wandb_series(run_dir: Path) -> list[tuple[str, str, str]]:
    from wandb_records import history

    return logged(history(wandb_file(run_dir)), ignored=lambda key: wandb_own(key) or key in STEPS, epochs=False)


def wandb_own(key: str) -> bool:
    return key in WANDB_OWN or key.split("/", 1)[0] in WANDB_OWN or key.rsplit("/", 1)[-1] in MEDIA_PLACES


def wandb_summary(run_dir: Path) -> dict[str, Any]:
    """The run's W&B summary, less the last step logged (the last call's, whichever series it was)."""
    from wandb_records import summary

    return {
        k: v
        for k, v in summary(wandb_file(run_dir)).items()
        if not wandb_own(k) and k not in STEPS and k.split("/", 1)[0] not in TABLES
    }


def tensorboard_series(run_dir: Path) -> list[tuple[str, float]]:
    """Every scalar of the run's one TensorBoard event file, as (tag, value), sorted."""
    (_,) = (run_dir / "tensorboard").rglob("events.out.tfevents.*")
    return sorted((tag, value) for tag, values in tensorboard_values(run_dir).items() for value in values)


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


@pytest.mark.slow
def test_runs_logging_in_one_process_each_get_their_own_wandb_run_csv_and_tensorboard(
    tmp_path: Path, monkeypatch
) -> None:
    """Two runs' loggers made in one process (as a pack makes them) and logged to in turns, epoch by epoch: each
    W&B run, CSV and TensorBoard log (if installed) holds its own run's values only. Before: the second run's W&B
    logger reused the first run's W&B run (W&B's global run), and the first run's close left the second's "finished"."""
    from mdl.run.loggers import live_epochs, log_results, make_logger
    from wandb_records import run_record, summary

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    runs = [tmp_path / "seed0", tmp_path / "seed1"]
    loggers = [
        make_logger(compose_config([*FAST, LOGGERS, f"seed={s}"], tmp_path), run_dir, [f"seed={s}"])
        for s, run_dir in enumerate(runs)
    ]
    hooks = [live_epochs(logger, 2) for logger in loggers]
    for epoch in range(3):
        for s, hook in enumerate(hooks):  # in turns, as a pack's fit finishes its runs' epochs
            hook(0, epoch, 10.0 * s + epoch, 100.0 * s + epoch, 0.5)
    for s, (logger, run_dir) in enumerate(zip(loggers, runs)):
        log_results(logger, {"paper_mdl": float(s), "blocks": []}, run_dir)
    for s, run_dir in enumerate(runs):
        expected = [100.0 * s + epoch for epoch in range(3)]
        assert [float(r["block01/val_loss"]) for r in csv_rows(run_dir) if r.get("block01/val_loss")] == expected
        assert not TENSORBOARD or tensorboard_values(run_dir)["block01/val_loss"] == expected
        assert [float(v) for k, _, v in wandb_series(run_dir) if k == "block01/val_loss"] == expected
        assert summary(wandb_file(run_dir))["paper_mdl"] == float(s)
        assert run_record(wandb_file(run_dir)).display_name == f"seed={s}"


# --- a packed sweep against the same runs launched alone ---------------------------------------------------------

SWEEP = [
    "-m",
    "seed=0,1",
    "eraser=none,leace",
    LOGGERS,
    *FAST,
    "trainer.torch_threads=1",
    "mdl.checkpoint_every_s=0",
    "mdl.min_steps_per_pass=1",
    "trainer.kwargs.max_epochs=40",
    "trainer.patience=40",
]  # every member 40 epochs:
# block 1 (one batch an epoch) ends long before the final fit (ten): a kill finds finished and unfinished members
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_API_KEY": ""}


def sweep_jobs(root: Path) -> dict[str, Path]:
    """The job folders of the one sweep under ``root``, by their overrides (the folder's name less the job number)."""
    (sweep,) = root.glob("multirun/*/*")
    return {job.name.split("_", 1)[1]: job for job in sweep.iterdir() if (job / "results.json").is_file()}


def killed_once_blocks_finished(args: list[str], root: Path) -> None:
    """Launch the sweep and SIGKILL it (a node failure) once every run has finished a block and the pack's
    checkpoint, written since, holds them finished and the others mid-fit."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO, python_path

    def blocks_done(progress: Path) -> int:
        try:
            return len(json.loads(progress.read_text())["block_index"])
        except (OSError, ValueError, KeyError):
            return 0

    with open(root / "killed.err", "w") as err:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "launch.py"), *args],
            cwd=root,
            stdout=err,
            stderr=err,
            env={**os.environ, "PYTHONPATH": python_path(), **WANDB_ENV},
        )
        deadline = time.time() + 600
        while time.time() < deadline and process.poll() is None:
            progress = list(root.glob("store/*/progress.json"))
            checkpoint = list(root.glob("store/packs/*/checkpoints/stacked.ckpt"))
            if (
                len(progress) == 4
                and all(map(blocks_done, progress))
                and checkpoint
                and checkpoint[0].stat().st_mtime > max(p.stat().st_mtime for p in progress)
            ):
                process.send_signal(signal.SIGKILL)
                process.wait()
                assert not list(root.glob("multirun/*/*/*/results.json")), "killed after the pack finished: kill sooner"
                return
            time.sleep(0.02)
    raise AssertionError(f"not killed mid-fit: {(root / 'killed.err').read_text()[-3000:]}")


@pytest.mark.slow
def test_a_packed_sweep_logs_each_run_as_the_run_alone_uninterrupted_and_killed_and_relaunched(tmp_path: Path) -> None:
    """``logger=[csv,wandb]`` (and TensorBoard, if installed), 2 seeds x 2 erasers: launched with Hydra's basic
    launcher (each run alone), packed (one fit), and packed, killed mid-fit and launched again (a new sweep folder
    resuming the pack's checkpoint): every packed job has one W&B run, one CSV (and one TensorBoard log), each with
    the values the same run logs alone. Before: the four runs logged into one W&B run, three CSVs were cut short,
    and the relaunch lacked the validation accuracy of the blocks finished before the kill."""
    from conftest import run_launch

    alone = run_launch([*SWEEP, f"paths.output_root={tmp_path / 'alone'}"], cwd=tmp_path, env=WANDB_ENV)
    assert alone.returncode == 0, alone.stderr[-3000:]
    packed = run_launch(
        [*SWEEP, "hydra/launcher=packed", f"paths.output_root={tmp_path / 'packed'}"], cwd=tmp_path, env=WANDB_ENV
    )
    assert packed.returncode == 0, packed.stderr[-3000:]
    relaunched = tmp_path / "relaunched"
    relaunched.mkdir()
    args = [*SWEEP, "hydra/launcher=packed", f"paths.output_root={relaunched}"]
    killed_once_blocks_finished(args, relaunched)
    for sweep in relaunched.glob("multirun/*"):  # the killed attempt's sweep: its W&B runs are cut short
        sweep.rename(tmp_path / f"killed-{sweep.name}")
    again = run_launch(args, cwd=tmp_path, env=WANDB_ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming fit from" in again.stdout + again.stderr

    reference = sweep_jobs(tmp_path / "alone")
    assert len(reference) == 4
    for root in (tmp_path / "packed", relaunched):
        jobs = sweep_jobs(root)
        assert jobs.keys() == reference.keys(), root
        for name, job in jobs.items():
            assert csv_series(job) == csv_series(reference[name]), (root.name, name)
            assert wandb_series(job) == wandb_series(reference[name]), (root.name, name)
            assert wandb_summary(job) == wandb_summary(reference[name]), (root.name, name)
            if TENSORBOARD:
                assert tensorboard_series(job) == tensorboard_series(reference[name]), (root.name, name)


@pytest.mark.slow  # a packed sweep through launch.py (its logs in process: the tests around it)
def test_a_packed_sweep_names_each_run_on_its_lines_prints_its_summary_and_keeps_its_own_launch_log(
    tmp_path: Path,
) -> None:
    """Each run's block lines carry its label, each run ends with its own ``paper MDL`` summary (as launch.py prints a
    run's), and each job folder's launch.log holds that job's lines and none of the other job's. Before: unlabelled
    block lines of both runs, no summary, and a launch.log holding the next job's launch line (the last one empty);
    then the second job's log held the first job's start line, and every line of the pack was labelled ``[HYDRA]``."""
    from conftest import run_launch

    proc = run_launch(
        ["-m", "seed=0,1", *FAST, "trainer.torch_threads=1", "hydra/launcher=packed", f"paths.output_root={tmp_path}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert (
        "] block 1/" not in out and "] final fit" not in out and "] block 1, " not in out
    )  # every run's lines are named
    jobs = {f"seed {s}": job for s in (0, 1) for job in tmp_path.glob(f"multirun/*/*/{s}_*")}
    for label, job in jobs.items():
        other = next(name for name in jobs if name != label)
        results = json.loads((job / "results.json").read_text())
        assert f"{label}: block 1/2: trained on" in out and f"{label}: final fit on" in out
        assert f"{label}: paper MDL: {results['paper_mdl']:.4f} bits/example" in out
        assert f"{label}: results: {job / 'results.json'}" in out
        own = (job / "launch.log").read_text()
        assert f"{label}: block 1/2: trained on" in own and f"{label}: paper MDL: {results['paper_mdl']:.4f}" in own
        assert "data digits: train" in own  # the data the two runs share: in both logs
        assert f"{other}:" not in own and "\t#" not in own  # nothing of the other job, nor the next one's launch line
        other_key = json.loads((jobs[other] / "results.json").read_text())["config_hash"]
        assert f"run {other_key}" not in own  # the other job's start line (the two share their data)
        assert f"[mdl.engine.ledger][INFO] - {label}: block 1/2" in out  # named by its logger, as in a run alone


def test_each_jobs_log_file_gets_its_own_lines_and_the_packs(tmp_path: Path) -> None:
    """mdl/run/job_logs.py: a line goes to the files of the jobs it belongs to (``own_lines``, a hook wrapped with
    ``owned_by``), a line of no job in particular to every job's; the files are closed when the pack ends."""
    import logging

    from mdl.run.job_logs import LogFile, job_log_files, own_lines, owned_by

    log = logging.getLogger("test_pack_logs")
    log.setLevel(logging.INFO)
    files = {job: (LogFile(tmp_path / f"{job}.log", logging.Formatter("%(message)s")),) for job in ("a", "b", "c")}
    with job_log_files(files):
        log.info("the pack")
        with own_lines("a"):
            log.info("a's line")
        owned_by(["b"], log.info)("b's line")
        with own_lines("a", "c"):
            log.info("data of a and c")
    log.info("after the pack")
    lines = {job: (tmp_path / f"{job}.log").read_text().splitlines() for job in files}
    assert lines == {
        "a": ["the pack", "a's line", "data of a and c"],
        "b": ["the pack", "b's line"],
        "c": ["the pack", "data of a and c"],
    }


def test_a_packs_shared_data_is_logged_to_each_run_it_serves_and_each_runs_start_to_its_own(
    tmp_path: Path, monkeypatch
) -> None:
    """mdl.run.pack._prepare_sharing_data: the lines of data that two runs share (made in the data-preparation worker
    thread, datamodules.interrupts) go to both runs' logs, each run's start line to its own only. Before: the worker
    lost the line owners (a context variable), so one data module's eraser lines went to every job of the pack, and
    the first run's start line ("run <key>") went to the log of the other run sharing its data too."""
    import logging
    from types import SimpleNamespace

    import mdl.run.pack as pack
    from conftest import FAST, compose_config
    from datamodules.interrupts import interruptible
    from mdl.run.job_logs import LogFile, job_log_files

    log = logging.getLogger("test_pack_logs")
    log.setLevel(logging.INFO)

    def job_data(job: Any) -> Any:
        interruptible(lambda: log.info("data of %s's eraser", job.key))  # as the eraser fit logs, in the worker
        log.info("data of %s", job.key)
        return SimpleNamespace(made_for=job.key)

    def prepare_run(job: Any, dm: Any) -> Any:
        log.info("run %s", job.key)
        return SimpleNamespace(job=job, data=dm)

    monkeypatch.setattr(pack, "job_data", job_data)
    monkeypatch.setattr(pack, "prepare_run", prepare_run)
    jobs = [
        SimpleNamespace(key=key, cfg=compose_config([*FAST, *overrides]))
        for key, overrides in (("a", ["seed=0"]), ("b", ["seed=1"]), ("c", ["eraser=none"]))
    ]  # a and b share their data (they differ only in the seed), c has its own
    files = {job.key: (LogFile(tmp_path / f"{job.key}.log", logging.Formatter("%(message)s")),) for job in jobs}
    with job_log_files(files):
        prepared = pack._prepare_sharing_data(jobs)
    assert [run.data.made_for for run in prepared] == ["a", "a", "c"]
    assert {key: (tmp_path / f"{key}.log").read_text().splitlines() for key in files} == {
        "a": ["data of a's eraser", "data of a", "run a"],
        "b": ["data of a's eraser", "data of a", "run b"],
        "c": ["data of c's eraser", "data of c", "run c"],
    }


def test_a_pack_logs_its_lines_under_their_loggers_names_then_the_launchers_again(capsys) -> None:
    """hydra_plugins.mdl_packed.packed_launcher.lines_named_as_in_a_job: while a pack trains, a line shows its logger's
    name and level as a single run's does (Hydra's job_logging); after, the launcher's own format again, and no file
    was opened by job_logging's file handler (the pack writes each job's log itself). Before: every line of a pack
    read ``[HYDRA] ...`` (the launcher's hydra_logging, left configured by the jobs' checks)."""
    import logging

    from hydra import compose, initialize_config_dir
    from hydra.core.utils import configure_log

    from conftest import CONF, FAST
    from hydra_plugins.mdl_packed.packed_launcher import lines_named_as_in_a_job

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra_cfg = compose("config", overrides=[*FAST, "hydra/launcher=packed"], return_hydra_config=True)
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        configure_log(hydra_cfg.hydra.hydra_logging, hydra_cfg.hydra.verbose)  # as the launcher leaves it
        with lines_named_as_in_a_job(hydra_cfg):
            logging.getLogger("datamodules.datamodule").info("data digits")
            assert not any(isinstance(h, logging.FileHandler) for h in root.handlers)
        logging.getLogger("mdl.sweeps.x").info("sweep done")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(before[0])
        for handler in before[1]:
            root.addHandler(handler)
    out = capsys.readouterr().out
    assert "][datamodules.datamodule][INFO] - data digits" in out and "[HYDRA] data digits" not in out
    assert "][HYDRA] sweep done" in out


def test_a_failing_wandb_run_leaves_the_csv_complete(tmp_path: Path) -> None:
    """W&B failing at a run's end (before: a finished W&B run in a pack, "UsageError: Run ... is finished"; or W&B
    down) must not cut the other loggers' series short: the CSV still gets every row (CSVLogger writes them when
    closed). Before: the rows since its last flush were lost."""
    from lightning.pytorch.loggers import CSVLogger

    from mdl.run.loggers import LoggerGroup, log_epoch, log_results

    class FailingWandb:
        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            pass

        def finalize(self, status: str) -> None:
            pass

        @property
        def experiment(self) -> Any:
            raise RuntimeError("Run (abc) is finished")

    failing = FailingWandb()
    group = LoggerGroup([CSVLogger(save_dir=str(tmp_path), name="csv", version=""), failing], failing)
    for epoch in range(3):
        log_epoch(group, "block01", epoch, 1.0, 2.0 + epoch)
    with pytest.raises(RuntimeError, match="is finished"):
        log_results(group, {"paper_mdl": 1.5, "blocks": []}, tmp_path)
    assert [float(r["block01/val_loss"]) for r in csv_rows(tmp_path) if r.get("block01/val_loss")] == [2.0, 3.0, 4.0]
