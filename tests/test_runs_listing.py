"""`python -m mdl.runs` lists the run store: finished, running, interrupted, failed and damaged runs, debug runs apart,
filters by column or config key, rows in reading order, CSV export."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import FAST, compose_config
from mdl.engine.trainer import SaveLastCheckpoint
from mdl.results import (
    FAILURE_FILE,
    PROGRESS_FILE,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    atomic_write_json,
    write_checked_json,
)
from mdl.run.experiment import run_experiment
from mdl.run.storage import HOLDER_FILE
from mdl.runs import list_runs, main, read_run
from test_resume import KILL_SETTINGS, run_killed_after


def test_lists_finished_and_partial_runs_with_filters(tmp_path: Path, monkeypatch, capsys) -> None:
    finished = run_experiment(compose_config(FAST + ["eraser=none"], tmp_path), tmp_path / "a")
    partial_cfg = compose_config([*KILL_SETTINGS, "trainer.patience=2", "eraser=leace"], tmp_path)
    assert run_killed_after(partial_cfg, tmp_path / "b", 6, monkeypatch)
    for record in (tmp_path / "store").glob(f"*/{FAILURE_FILE}"):
        record.unlink()  # killed (SIGKILL, a node lost): no exception recorded a failure

    runs = {r.values["eraser"]: r for r in list_runs(tmp_path / "store")}
    assert runs["none"].status == "finished" and runs["none"].values["paper_mdl"] == finished["paper_mdl"]
    assert runs["leace"].status == "interrupted" and runs["leace"].values["paper_mdl"] is None  # killed: resumable
    assert [r.values["eraser"] for r in list_runs(tmp_path / "store", where=["eraser.name=leace"])] == ["leace"]
    assert [r.values["eraser"] for r in list_runs(tmp_path / "store", status="finished")] == ["none"]

    out = tmp_path / "runs.csv"
    assert main([f"paths.output_root={tmp_path}", "--where", "width=32", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 run(s): 0 finished, 0 running, 1 interrupted" in printed  # the killed run (KILL_SETTINGS: not debug=fast)
    assert "1 debug run(s): 1 finished" in printed and finished["config_hash"] in printed
    rows = list(csv.DictReader(out.open()))
    assert {(r["eraser"], r["debug_run"]) for r in rows} == {("none", "fast"), ("leace", "")}


def test_missing_store_is_one_message(tmp_path: Path, capsys) -> None:
    assert main([f"paths.output_root={tmp_path / 'nowhere'}"]) == 2
    assert "no run store at" in capsys.readouterr().err


def test_a_failed_run_is_listed_as_failed_with_its_error_until_it_runs_again(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import mdl.run.experiment as experiment

    def broken(job, dm=None):
        raise RuntimeError("the data broke\nsecond line of the message")

    cfg = compose_config(FAST + ["eraser=none"], tmp_path)
    with monkeypatch.context() as m:
        m.setattr(experiment, "prepare_run", broken)
        with pytest.raises(RuntimeError):
            run_experiment(cfg, tmp_path / "a")
    (run,) = list_runs(tmp_path / "store")
    assert run.status == "failed" and run.values["error"] == "RuntimeError: the data broke"
    assert run.values["path"] == str((tmp_path / "a").resolve())
    assert main([f"paths.output_root={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("hash "))
    assert "RuntimeError: the data broke" in printed and "1 failed" in printed and "error" in header.split()

    run_experiment(cfg, tmp_path / "b")  # the next attempt clears the failure
    assert read_run(run.folder).status == "finished"


def test_columns_show_lr_tags_date_path_and_swept_keys_and_csv_keeps_full_precision(tmp_path: Path, capsys) -> None:
    results = {
        act: run_experiment(
            compose_config(FAST + [f"model.options.activation={act}", "tags=[v2]"], tmp_path), tmp_path / act
        )
        for act in ("relu", "gelu")
    }
    out = tmp_path / "runs.csv"
    assert main([f"paths.output_root={tmp_path}", "--csv", str(out)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("hash ")).split()
    for column in ("lr", "activation", "tags", "date", "path", "paper_mdl"):
        assert column in header, header
    assert "error" not in header and "seed" in header
    rows = {r["activation"]: r for r in csv.DictReader(out.open())}
    for act, result in results.items():
        assert float(rows[act]["paper_mdl"]) == result["paper_mdl"]  # every digit, not 4
        assert rows[act]["path"] == str((tmp_path / act).resolve()) and rows[act]["tags"] == "v2"
        assert float(rows[act]["lr"]) == result["config"]["optimizer"]["lr"]


@pytest.mark.parametrize(
    "key, hint", [("eraser.nmae", "eraser.name"), ("erasr", "eraser"), ("model.options", "model.options.activation")]
)
def test_where_refuses_a_key_no_run_has_naming_the_nearest(tmp_path: Path, capsys, key: str, hint: str | None) -> None:
    run_experiment(compose_config(FAST + ["eraser=none"], tmp_path), tmp_path / "a")
    assert main([f"paths.output_root={tmp_path}", "--where", f"{key}=leace"]) == 2
    err = capsys.readouterr().err
    assert f"--where {key}:" in err and (hint is None or f"did you mean --where {hint}=" in err), err


def test_a_failed_pack_lists_its_unfinished_runs_as_failed(tmp_path: Path, monkeypatch) -> None:
    """hydra/launcher=packed(_slurm): an exception in a pack's training marks each of its unfinished runs failed."""
    from hydra.core.utils import JobReturn, JobStatus

    import mdl.run.pack as pack
    from hydra_plugins.mdl_packed.packed_launcher import train_checked
    from mdl.run.experiment import Job

    cfgs = [compose_config(FAST + [f"seed={seed}"], tmp_path) for seed in (0, 1, 2)]
    run_experiment(cfgs[0], tmp_path / "0")  # finished before the pack

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory\nTried to allocate 2 GiB")

    monkeypatch.setattr(pack, "_fit_pack", out_of_memory)
    checked = [
        JobReturn(status=JobStatus.COMPLETED, _return_value=Job.checked(cfg, tmp_path / f"pack{i}"))
        for i, cfg in enumerate(cfgs)
    ]
    assert {r.status for r in train_checked(checked)} == {JobStatus.FAILED}
    listed = {r.values["seed"]: (r.status, r.values["error"]) for r in list_runs(tmp_path / "store")}
    assert listed == {
        0: ("finished", None),
        1: ("failed", "RuntimeError: CUDA out of memory"),
        2: ("failed", "RuntimeError: CUDA out of memory"),
    }


def test_a_run_with_a_truncated_record_is_listed_as_damaged(tmp_path: Path, capsys) -> None:
    """A config.json cut short (a full disk, a kill) used to leave its run out of the listing without a word."""
    entry = tmp_path / "store" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{"config": {"seed": 0, "wid')
    assert main([f"paths.output_root={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    assert "0123456789abcdef  damaged (config.json)" in out and "1 damaged" in out
    assert f"{entry / 'config.json'} is damaged" in err


# --- store entries written by hand: the listing reads records, it trains nothing ----------------------------------


def entry(
    store: Path,
    key: str,
    overrides: list[str],
    finished: bool = False,
    command: str | None = None,
    blocks: int | None = None,
) -> Path:
    """A store entry as a run leaves it: config.json from the start (with the command that started it), progress.json
    after ``blocks`` blocks, results.json when ``finished``."""
    folder = store / key
    folder.mkdir(parents=True)
    config = OmegaConf.to_container(compose_config(overrides, store.parent), resolve=True)
    atomic_write_json(
        folder / RUN_CONFIG_FILE, {"config": config, "config_hash": key, "run_dir": str(folder), "command": command}
    )
    if blocks is not None:
        write_checked_json(folder / PROGRESS_FILE, {"boundaries": [0, 1, 2, 3], "blocks": [{}] * blocks})
    if finished:
        write_checked_json(folder / RESULTS_FILE, {"config": config, "config_hash": key, "paper_mdl": 1.5})
    return folder


def test_where_takes_the_columns_the_table_shows(tmp_path: Path, capsys) -> None:
    """``--where eraser=leace`` was refused (rc 2, "did you mean eraser.name") though the table's column is eraser."""
    store = tmp_path / "store"
    for i, (eraser, activation) in enumerate([("none", "relu"), ("leace", "relu"), ("leace", "gelu")]):
        entry(store, f"{i:016x}", [f"eraser={eraser}", f"model.options.activation={activation}"], finished=i < 2)
    assert main([f"paths.output_root={tmp_path}", "--where", "eraser=leace"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s)" in out and "none" not in out.split("\n", 1)[1]
    listed = lambda *where: [r.folder.name[-1] for r in list_runs(store, where=where)]  # noqa: E731
    assert listed("eraser=leace", "activation=gelu") == ["2"]  # a swept key, by its column's name
    assert listed("status=finished", "eraser.name=leace") == ["1"]  # the run's state; a full config key
    assert listed("status=interrupted") == ["2"] and listed("paper_mdl=1.5000") == ["0", "1"]
    assert listed("data=digits", "lr=0.003") == ["0", "2", "1"]  # leace: gelu, then relu


def test_rows_are_in_the_order_of_the_columns_not_of_the_hashes(tmp_path: Path) -> None:
    """By data set, model, width, depth, eraser (the paper's order: the control first), seed: not by config hash."""
    store = tmp_path / "store"
    planned = [  # in the order expected; each hash sorts the other way
        ["model=lenet"],
        ["eraser=none", "width=64"],
        ["eraser=leace", "width=64"],
        ["eraser=qleace", "width=64", "seed=0"],
        ["eraser=qleace", "width=64", "seed=1"],
        ["eraser=none", "width=64", "depth=3"],
        ["eraser=none", "width=256"],
    ]
    for i, overrides in enumerate(planned):
        entry(store, f"{len(planned) - i:016x}", overrides, finished=True)
    assert [r.folder.name for r in list_runs(store)] == [f"{len(planned) - i:016x}" for i in range(len(planned))]


def test_debug_runs_are_listed_apart_from_real_runs(tmp_path: Path, capsys) -> None:
    """debug=fast runs (numbers that mean nothing) were listed `finished` beside real ones."""
    store = tmp_path / "store"
    entry(store, "00000000000000aa", ["eraser=none"], finished=True)
    entry(store, "00000000000000bb", FAST, finished=True)
    entry(store, "00000000000000cc", ["debug=profile"], finished=True)
    assert main([f"paths.output_root={tmp_path}"]) == 0
    real, debug = capsys.readouterr().out.split("debug runs (")
    assert "00000000000000aa" in real and "1 run(s): 1 finished" in real and "bb" not in real
    assert "00000000000000bb" in debug and "00000000000000cc" in debug and "2 debug run(s): 2 finished" in debug
    assert {r.folder.name[-2:]: r.debug for r in list_runs(store)} == {"aa": None, "bb": "fast", "cc": "profile"}


def test_a_stopped_run_is_interrupted_with_the_command_that_resumes_it_and_a_running_one_is_running(
    tmp_path: Path, capsys
) -> None:
    """A run whose process is gone (SIGTERM, a kill: no failure recorded) was `partial`, as one still training."""
    store = tmp_path / "store"
    command = "python launch.py eraser=qleace 'tags=[a,b]'"
    stopped = entry(store, "00000000000000aa", ["eraser=qleace", "tags=[a,b]"], command=command, blocks=2)
    running = entry(store, "00000000000000bb", ["eraser=leace"], command="python launch.py eraser=leace", blocks=1)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "lease_s": 300}
    atomic_write_json(running / HOLDER_FILE, holder)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    atomic_write_json(stopped / HOLDER_FILE, {**holder, "pid": dead.pid})  # left by a killed process
    runs = {r.folder.name[-2:]: r for r in list_runs(store)}
    assert (runs["aa"].status, runs["aa"].values["status"], runs["aa"].resume) == (
        "interrupted",
        "interrupted (2/3 blocks)",
        command,
    )
    assert (runs["bb"].status, runs["bb"].values["status"], runs["bb"].resume) == (
        "running",
        "running (1/3 blocks)",
        None,
    )
    assert main([f"paths.output_root={tmp_path}", "--status", "interrupted"]) == 0
    out = capsys.readouterr().out
    assert f"  00000000000000aa  {command}" in out.split("interrupted runs resume")[1] and "bb" not in out


@pytest.mark.parametrize("damaged", [PROGRESS_FILE, RESULTS_FILE])
def test_a_damaged_progress_or_results_record_is_listed_as_damaged_naming_it(
    tmp_path: Path, capsys, damaged: str
) -> None:
    """A damaged progress.json or results.json beside a readable config.json was listed `started`, without a word."""
    store = tmp_path / "store"
    folder = entry(store, "00000000000000aa", ["eraser=none"], command="python launch.py eraser=none", blocks=1)
    (folder / damaged).write_text('{"blocks": [')  # cut short
    assert main([f"paths.output_root={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    assert f"00000000000000aa  damaged ({damaged})  digits" in out and "1 damaged" in out
    assert f"warning: {folder / damaged} is damaged" in err and "python launch.py eraser=none" in err
    assert ("starts the run over" if damaged == PROGRESS_FILE else "computes the run again") in err


def test_a_ctrl_c_in_a_fit_is_interrupted_not_failed_and_the_same_command_resumes_it(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Lightning turns a Ctrl-C in a fit into SystemExit(1): the run was recorded `failed (k/n blocks)`."""
    overrides = [*KILL_SETTINGS, "trainer.patience=2", f"paths.output_root={tmp_path}"]
    cfg = compose_config(overrides, tmp_path)
    original, count = SaveLastCheckpoint.on_train_epoch_end, [0]

    def ctrl_c_at_the_fourth_checkpoint(self, trainer, module) -> None:
        original(self, trainer, module)
        count[0] += 1
        if count[0] == 4:
            raise KeyboardInterrupt

    handler = signal.getsignal(signal.SIGINT)
    try:
        with monkeypatch.context() as m:
            m.setattr(SaveLastCheckpoint, "on_train_epoch_end", ctrl_c_at_the_fourth_checkpoint)
            with pytest.raises((KeyboardInterrupt, SystemExit)):
                run_experiment(cfg, tmp_path / "a", overrides=overrides)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from a Ctrl-C on, for its shutdown
    (run,) = list_runs(tmp_path / "store")
    assert not (run.folder / FAILURE_FILE).exists()
    assert run.status == "interrupted" and run.resume == "python launch.py " + " ".join(overrides)
    assert main([f"paths.output_root={tmp_path}"]) == 0
    assert f"{run.folder.name}  python launch.py {overrides[0]}" in capsys.readouterr().out
    resumed = run_experiment(cfg, tmp_path / "b", overrides=overrides)
    assert read_run(run.folder).status == "finished" and "skipped" not in resumed
