"""launch.py as a user runs it: single runs, multiruns into distinct directories, clear errors."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FAST, REPO, copy_output, run_in_process, run_launch, sweep_report


def test_the_default_launch_prints_its_summary_and_writes_its_results(finished_run) -> None:
    """The main path, as a user starts it (`python launch.py debug=fast`): exit 0, the summary printed last, and the
    results in the run's folder the same as in the store of finished runs (what the next launch skips on)."""
    run = finished_run
    assert "paper MDL:" in run.proc.stdout and f"results: {run.run_dir / 'results.json'}" in run.proc.stdout
    results = run.results
    (stored,) = run.root.glob(f"store/{results['config_hash']}/results.json")
    assert json.loads(stored.read_text()) == results
    assert results["config"]["eraser"]["name"] == "leace" and results["config"]["model"]["name"] == "mlp"
    assert len(results["blocks"]) == 2 and results["boundaries"][0] == 100  # debug=fast: 3 blocks of 100 and up


def test_multirun_launches_every_job_into_its_own_directory(small_sweep) -> None:
    results = [job / "results.json" for job in small_sweep.run_dirs]
    assert len(results) == 4
    assert len({r.parent for r in results}) == 4 and len({r.parent.parent for r in results}) == 1
    combos = {
        (json.loads(r.read_text())["config"]["eraser"]["name"], json.loads(r.read_text())["config"]["seed"])
        for r in results
    }
    assert combos == {("none", 0), ("none", 1), ("leace", 0), ("leace", 1)}
    assert small_sweep.proc.stdout.count("paper MDL") == 4
    report = sweep_report(small_sweep.root)
    assert "leace" in report.read_text()


def test_job_folders_are_named_by_job_dirname(small_sweep) -> None:
    """Hydra names each job's folder with mdl.run.storage.job_dirname (conf/config.yaml's hydra.sweep.subdir): the job
    number and its overrides, without the keys that do not change a run (logger, tags, paths)."""
    from mdl.run.storage import job_dirname

    names = [job.name for job in small_sweep.run_dirs]
    expected = [
        job_dirname(i, f"debug=fast,eraser={eraser},seed={seed}")
        for i, (eraser, seed) in enumerate([("none", 0), ("none", 1), ("leace", 0), ("leace", 1)])
    ]
    assert (
        names
        == expected
        == [
            "0_debug=fast,eraser=none,seed=0",
            "1_debug=fast,eraser=none,seed=1",
            "2_debug=fast,eraser=leace,seed=0",
            "3_debug=fast,eraser=leace,seed=1",
        ]
    )


def test_unknown_eraser_stops_with_the_available_names(tmp_path: Path) -> None:
    proc = run_launch(["eraser=bogus", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "eraser/bogus" in proc.stderr and "leace" in proc.stderr


def test_unknown_model_name_is_named(tmp_path: Path) -> None:
    proc = run_launch(["model.name=bogus", f"paths.output_root={tmp_path}", *FAST], cwd=tmp_path)
    assert proc.returncode != 0
    assert "unknown model 'bogus'" in proc.stderr


@pytest.mark.slow
def test_a_sweep_with_one_invalid_job_runs_none_of_them(tmp_path: Path) -> None:
    """Every job is checked before the first runs (the sweep_cost callback), not after hours of the valid ones."""
    proc = run_launch(["-m", *FAST, "depth=2,0", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "depth=0" in proc.stderr and "must be an integer >= 1" in proc.stderr and "no job was run" in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


def test_sweep_cost_refuses_what_launch_refuses_with_one_message(capsys) -> None:
    from mdl.sweeps.cost import main as cost_main

    for args, message in (
        (["model=nope"], "Could not find 'model/nope'"),
        (["mdl.num_blocks=1"], "mdl.num_blocks=1: must be"),
        (["model.name=nope"], "unknown model 'nope'"),
    ):
        with pytest.raises(SystemExit) as stop:
            cost_main(args)
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_long_overrides_make_a_short_unique_job_folder() -> None:
    """A job folder's name over 255 bytes failed with ENAMETOOLONG; long overrides are cut and hashed (the folders
    Hydra makes with it: test_job_folders_are_named_by_job_dirname; a sweep of such jobs: the slow test below)."""
    from mdl.run.storage import MAX_JOB_DIRNAME, job_dirname

    assert job_dirname(3, "a=1") == "3_a=1" and "/" not in job_dirname(0, "data.cache_dir=/x/y")
    long = [job_dirname(0, "x=" + "1" * 300), job_dirname(0, "x=" + "1" * 299 + "2"), job_dirname(1, "x=" + "1" * 300)]
    assert len(set(long)) == 3  # the hash tells them apart, the job number too
    assert all(len(name.encode()) <= MAX_JOB_DIRNAME for name in long)
    assert all(name.startswith(("0_x=111", "1_x=111")) for name in long)  # cut, not replaced: still readable


@pytest.mark.slow
def test_a_sweep_with_long_overrides_runs_in_short_sibling_folders(tmp_path: Path) -> None:
    from mdl.run.storage import MAX_JOB_DIRNAME

    lr = "0.003" + "0" * 300 + "1"  # a valid value, 300 characters longer than usual
    proc = run_launch(["-m", *FAST, "seed=0,1", f"optimizer.lr={lr}", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent for p in (tmp_path / "multirun").rglob("results.json"))
    assert len(jobs) == 2 and len({j.parent for j in jobs}) == 1  # siblings in the sweep folder, not nested
    assert all(len(j.name.encode()) <= MAX_JOB_DIRNAME for j in jobs) and jobs[0].name != jobs[1].name


def test_logger_null_turns_logging_off(tmp_path: Path) -> None:
    """`logger=null`, the template's spelling: launch.py hands Hydra 1.3 its own, `~logger`, and the run logs nothing."""
    from launch import without_null_groups

    assert without_null_groups(["logger=null", "eraser=none", "logger.wandb.project=x"]) == [
        "~logger",
        "eraser=none",
        "logger.wandb.project=x",
    ]
    run_in_process(["~logger", *FAST], tmp_path)
    assert (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / "csv").exists()


def test_tensorboard_without_its_package_is_refused_before_loading() -> None:
    import importlib.util

    from conftest import compose_config
    from mdl.run.config_checks import validate_config

    cfg = compose_config([*FAST, "logger=tensorboard"])
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        validate_config(cfg)
        return
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tensorboard\]'"):
        validate_config(cfg)


@pytest.mark.slow
def test_start_prints_the_whole_config_with_print_config_full(profiled) -> None:
    root, proc = profiled  # a launch with print_config=full
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "config (" in proc.stdout and "\neraser:\n" in proc.stdout  # the resolved config, before the run
    assert proc.stdout.index("\neraser:\n") < proc.stdout.index("paper MDL")


def test_capped_fits_are_warned_about(tmp_path: Path, caplog) -> None:
    """Fits that reach max_epochs before early stopping could end are named: here every fit (patience 30 > 2 epochs)."""
    with caplog.at_level("WARNING"):
        run_in_process([*FAST, "trainer.kwargs.max_epochs=2", "trainer.patience=30"], tmp_path)
    text = caplog.text
    assert "stopped at trainer.kwargs.max_epochs=2 before early stopping" in text and "the final fit" in text


def test_print_config_is_not_part_of_a_runs_identity() -> None:
    from conftest import compose_config
    from mdl.run.identity import config_hash

    assert config_hash(compose_config(FAST)) == config_hash(compose_config([*FAST, "print_config=false"]))


def test_debug_fast_is_the_fast_settings() -> None:
    """debug=fast (the tests' FAST) composes the same run as its settings typed out (same identity), and an
    override typed after it wins."""
    from conftest import compose_config
    from mdl.run.identity import config_hash

    typed = [
        "trainer.kwargs.max_epochs=3",
        "trainer.patience=2",
        "mdl.num_blocks=3",
        "data.first_block=100",
        "width=32",
        "model.base_width=32",
    ]
    assert FAST == ["debug=fast"]
    assert config_hash(compose_config(["debug=fast"])) == config_hash(compose_config(typed))
    assert config_hash(compose_config(["debug=fast", "model=lenet"])) == config_hash(
        compose_config([*typed, "model=lenet"])
    )
    assert compose_config(["debug=fast", "mdl.num_blocks=8"]).mdl.num_blocks == 8


@pytest.fixture(scope="module")
def profiled(finished_run, tmp_path_factory):
    """`python launch.py debug=profile print_config=full` where the same config (debug=fast's) has already finished,
    without the data cache."""
    root = copy_output(finished_run, tmp_path_factory.mktemp("profiled") / "out")
    started = time.perf_counter()
    args = ["debug=profile", "print_config=full", "data.cache_dir=null", f"paths.output_root={root}"]
    proc = run_launch(args, cwd=root)  # no data cache: the eraser is fitted (and diagnosed), as on a first launch
    PROFILED_WALL_S[root] = time.perf_counter() - started
    return root, proc


PROFILED_WALL_S: dict[Path, float] = {}  # the profiled launch's wall time, measured around its process


@pytest.mark.slow
def test_debug_profile_writes_and_shows_the_profile(profiled) -> None:
    root, proc = profiled
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = root.glob("runs/*/*/profile/fit-profile.txt")
    assert "run_training_epoch" in report.read_text() and f"profile ({report}" in proc.stdout


@pytest.mark.slow
def test_debug_profile_breaks_the_whole_job_down_from_its_start_up_to_its_results(profiled) -> None:
    """mdl.run.phases: besides Lightning's report (the fits alone: a fraction of a digits job), debug=profile writes
    where the whole job's time went, from the process's start: start-up, data, eraser, the fits, the results; the
    phases add up to the launch's wall time within 10% (its own is a little shorter: the summary and the
    interpreter's exit come after), and the table is printed. Before: only the fits' 0.3 s of a 20 s job."""
    root, proc = profiled
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = root.glob("runs/*/*/profile/phases.json")
    breakdown = json.loads(path.read_text())
    seconds = {p["phase"]: p["seconds"] for p in breakdown["phases"]}
    names = list(seconds)
    for start in ("start-up: ", "data: ", "eraser: fit", "eraser: diagnostics", "fit ", "results: "):
        assert any(name.startswith(start) for name in names), (start, names)
    assert names[0].startswith("start-up: ") and names[-2].startswith("results: "), names
    wall = PROFILED_WALL_S[root]
    timed = sum(s for name, s in seconds.items() if not name.startswith("untimed"))
    assert abs(sum(seconds.values()) - breakdown["wall_s"]) < 0.01 and breakdown["from"] == "process start"
    assert 0.9 * wall <= timed <= wall, (timed, wall, seconds)
    assert f"; {path}):" in proc.stdout and "start-up: importing torch" in proc.stdout


@pytest.mark.slow
def test_debug_profile_runs_even_when_the_config_is_done(finished_run, profiled) -> None:
    """The profiler is not part of a run's identity: debug=profile re-runs a finished config to profile it."""
    from conftest import compose_config
    from mdl.run.identity import config_hash

    root, proc = profiled
    done = finished_run.results["config_hash"]
    assert config_hash(compose_config(["debug=profile"])) == done and (root / "store" / done / "results.json").exists()
    assert proc.returncode == 0 and "skipped: a finished run" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert list(root.glob("runs/*/*/profile/fit-profile.txt"))


@pytest.fixture(scope="module")
def overfit(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -X importtime launch.py debug=overfit` on the default (an MLP): the check, and what it imported."""
    root = tmp_path_factory.mktemp("overfit")
    proc = run_launch(
        ["debug=overfit", "print_config=false", f"paths.output_root={root}"],
        cwd=root,
        python_flags=["-X", "importtime"],
    )
    return proc, root


@pytest.mark.slow
def test_debug_overfit_fits_one_batch_or_says_it_cannot(overfit, tmp_path: Path) -> None:
    """launch.py's check: exit 0 and the verdict when the batch is fitted, the verdict and what to check when it is not
    (its exit status 1 through launch.py: the slow test below); a check, not a run: nothing stored."""
    import torch

    from conftest import compose_config
    from mdl.run.debug_checks import overfit_one_batch

    ok, root = overfit
    assert ok.returncode == 0 and "the model fits it" in ok.stdout, ok.stdout[-1000:] + ok.stderr[-2000:]
    assert not list(root.rglob("results.json"))
    threads = torch.get_num_threads()
    try:
        stuck = overfit_one_batch(compose_config(["debug=overfit", "optimizer.lr=1e-7"], tmp_path), 300)
    finally:
        torch.set_num_threads(threads)  # the check sets a run's threads
    assert not stuck.fits and "does NOT fit it" in stuck.describe() and "optimizer.lr" in stuck.describe()
    assert not list(tmp_path.rglob("results.json"))


@pytest.mark.slow  # a launch (the check itself: the test above)
def test_a_batch_the_model_cannot_fit_ends_launch_with_exit_status_1(tmp_path: Path) -> None:
    stuck = run_launch(
        ["debug=overfit", "optimizer.lr=1e-7", "print_config=false", f"paths.output_root={tmp_path}"], cwd=tmp_path
    )
    assert stuck.returncode == 1 and "does NOT fit it" in stuck.stdout and "optimizer.lr" in stuck.stdout
    assert not list(tmp_path.rglob("results.json"))  # a check, not a run


@pytest.mark.slow
def test_debug_overfit_on_the_default_loads_no_model_it_does_not_train(overfit) -> None:
    """debug=overfit on the default (an MLP) is import time more than training (7 s, 0.5 s of it the check): it no
    longer imports timm (ConvNeXt and Swin, about 0.7 s, and W&B through it), which registers when a run asks for it."""
    proc, _ = overfit
    assert proc.returncode == 0 and "the model fits it" in proc.stdout, proc.stderr[-2000:]
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time")
    }
    assert "torch" in imported and not imported & {"timm", "wandb"}


def test_runs_listing_with_a_misspelled_override_is_one_message(capsys) -> None:
    from mdl.runs import main as runs_main

    assert runs_main(["paths.output_rot=/x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_training_imports_are_frozen_once_and_the_collector_state_is_restored(monkeypatch) -> None:
    """The training code is imported with the cyclic GC paused, its garbage collected and the rest frozen (the run's
    full collections then skip torch's and lightning's half a million objects), by launch.py and the packed launcher;
    the collector's state is restored, even when the import fails, and a later job of the process freezes nothing."""
    import gc
    import re

    from mdl.run import imports
    from mdl.run.imports import imports_frozen

    for entry in (REPO / "launch.py", REPO / "hydra_plugins" / "mdl_packed" / "packed_launcher.py"):
        assert re.search(r"with imports_frozen\(\):[^\n]*\n\s+from mdl\.run\.experiment import", entry.read_text()), (
            entry
        )
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(imports, "_frozen", False)  # as in a fresh process
    with imports_frozen():
        assert not gc.isenabled()
    assert gc.isenabled() and calls == ["collect", "freeze"]
    monkeypatch.setattr(imports, "_frozen", False)
    with pytest.raises(ImportError), imports_frozen():
        raise ImportError("a broken install")
    assert gc.isenabled() and calls[2:] == ["collect", "freeze"]
    gc.disable()
    monkeypatch.setattr(imports, "_frozen", False)
    try:
        with imports_frozen():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
    with imports_frozen():  # already frozen: a later job
        assert gc.isenabled()
    assert len(calls) == 6


def test_launch_composes_the_config_once_unless_a_config_may_set_hydra_mode(monkeypatch) -> None:
    """launch.py skips Hydra's first compose, which only reads ``hydra.mode`` (``compose_once``): right only while no
    file in conf/ sets it, so this fails when one does; a command line that sets it, or a config of the user's own,
    keeps Hydra's probe."""
    import yaml
    from hydra._internal.hydra import Hydra

    import launch

    for path in (REPO / "conf").rglob("*.yaml"):
        node = yaml.safe_load(path.read_text()) or {}
        packaged_in_hydra = path.read_text().startswith("# @package hydra") or path.parent == REPO / "conf" / "hydra"
        in_hydra = node if packaged_in_hydra else node.get("hydra") or {}
        assert "mode" not in in_hydra, f"{path} sets hydra.mode: launch.compose_once skips the compose that reads it"
    probe = Hydra.get_mode
    monkeypatch.setattr(Hydra, "get_mode", probe)  # restored after the test, whatever happens in it
    for argv in (["hydra.mode=MULTIRUN"], ["-cd", "/elsewhere"], ["--config-na=mine"], ["hydra.searchpath=[x]"]):
        launch.compose_once(argv)
        assert Hydra.get_mode is probe, argv
    launch.compose_once(["seed=1", "-m"])
    assert Hydra.get_mode is not probe and Hydra.get_mode(None, "config", ["seed=1"]) is None
