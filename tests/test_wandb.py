"""W&B in offline mode: one run per job, grouped by sweep, typed by eraser, named by overrides."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import FAST, WANDB_OFFLINE, copy_output, run_launch


def test_offline_runs_carry_group_job_type_and_name(small_sweep) -> None:
    (sweep,) = {job.parent for job in small_sweep.run_dirs}
    run_files = sorted(sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 4
    for run_file in run_files:
        job_dir = run_file.parents[2]
        eraser = "leace" if "eraser=leace" in job_dir.name else "none"
        record = run_file.read_bytes()  # protobuf records: strings are stored verbatim
        assert sweep.name.encode() in record  # group: the sweep
        assert f"eraser={eraser}".encode() in record  # name: the job's overrides
        assert eraser.encode() in record  # job type
        for series in (
            b"block01/val_loss",
            b"block01/train_loss",
            b"block01/val_accuracy",
            b"epoch",
            b"block02/val_loss",
            b"final/val_loss",
            b"final/val_accuracy",
            b"paper_mdl",
        ):
            assert series in record, series
        _workspace_panels_have_data(record)
    from wandb_records import run_record

    run = run_record(run_files[0])  # a debug sweep: grouped apart, named by what it sweeps and when; tagged
    assert run.run_group == f"debug eraser x seed {sweep.parent.name} {sweep.name}" and "debug:fast" in run.tags
    assert run.job_type == "none" and run_record(run_files[2]).job_type == "leace"


def _workspace_panels_have_data(record: bytes) -> None:
    """Every key the saved workspace's panels read (mdl/run/wandb_workspace.py) is in a real run's file, and the
    workspace builds into W&B's own view model (nothing is sent)."""
    import re

    import pytest

    from mdl.run.wandb_workspace import SECTIONS, build

    panels = [panel for section in SECTIONS for panel in section.panels]
    keys = [k for p in panels for k in p.keys if p.kind != "scatter" or k != p.keys[0]]  # a scatter's x: a config key
    keys += [p.x for p in panels if p.kind == "line"]
    regexes = [p.regex for p in panels if p.regex]
    text = record.decode("latin-1")
    for key in keys:
        assert key in text, key
    for regex in regexes:
        assert re.search(regex, text), regex
    pytest.importorskip("wandb_workspaces")
    view = build("entity", "project")._to_model().model_dump_json()
    assert all(key in view for key in keys) and "eraser.value.name" in view


def test_summary_tags_group_table_and_artifacts_read_back(small_sweep) -> None:
    """Read from the run files W&B writes: the summary holds the paper's numbers and every erasure
    diagnostic, tags come from the config, the name has no logger=wandb, results.json and the eraser
    are an artifact, the blocks a table."""
    from wandb_records import artifacts, config, run_record, summary

    job = small_sweep.run_dirs[2]  # eraser=leace, seed=0
    (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
    assert "tags" not in run_file.parents[2].name  # the user's tags name no folder: they are not part of a run
    results = json.loads((run_file.parents[2] / "results.json").read_text())
    values = summary(run_file)
    assert values["paper_mdl"] == results["paper_mdl"] and values["final/best_val_loss"] == results["final_val_loss"]
    # summary keys say what they are: the kept weights' loss (best) or the last epoch's (last); series have none
    assert values["final/last_val_loss"] == results["val_loss_curve"][-1] and values["trainer/global_step"] > 0
    for i, block in enumerate(results["blocks"], 1):
        assert values[f"block{i:02d}/best_val_loss"] == block["val_bits_per_example"] * math.log(2)
        assert values[f"block{i:02d}/last_val_loss"] == block["val_loss_curve"][-1]
        assert values[f"block{i:02d}/eval_bits_per_example"] == block["eval_bits"] / block["n_eval"]
    assert not {"final/val_loss", "final/train_loss", "block01/val_loss", "final_val_loss"} & set(values)
    for key, value in results["data_diagnostics"]["erasure"].items():
        if isinstance(value, (int, float)):
            assert values[f"erasure/{key}"] == value, key
    run = run_record(run_file)
    assert {"baseline", "v2", "data:digits", "model:mlp", "eraser:leace", "fits:stacked"} <= set(run.tags)
    assert "logger" not in run.display_name and "eraser=leace" in run.display_name
    assert run_file.parents[3].name in run.run_group  # the sweep's time
    logged = artifacts(run_file)
    (files,) = [v for k, v in logged.items() if k.startswith("results-")]
    assert sorted(files) == ["eraser.safetensors", "results.json"]
    assert any(k.endswith("-blocks") for k in logged)
    # media as W&B wrote them to the run's files: their summary entries (nrows, _type...) are filled in by W&B's
    # writer thread as it gets there, so they are not read here (one CI run lacked blocks/nrows)
    (table,) = run_file.parent.glob("files/media/table/blocks_*.table.json")
    assert len(json.loads(table.read_text())["data"]) == len(results["blocks"])
    assert len(list(run_file.parent.glob("files/media/images/erased_images_*.png"))) == 1  # Figure 1's panel, logged
    assert (run_file.parents[2] / "figures" / "figure1_digits.png").stat().st_size > 0
    assert config(run_file)["environment"] == results["environment"]  # what computed it, beside the config


@pytest.mark.slow  # two launches with W&B
def test_a_skipped_run_is_logged_from_its_stored_results_once(finished_run, tmp_path: Path) -> None:
    """A sweep re-launched with logger=wandb after CSV runs shows every run in W&B (skipped ones from the
    store), and a third launch does not log them again."""
    from wandb_records import summary

    root = copy_output(finished_run, tmp_path / "a")  # the default run, with the default logger (CSV)
    for attempt in ("b", "c"):
        again = run_launch(["logger=wandb", f"paths.output_root={root}", *FAST], cwd=root, env=WANDB_OFFLINE)
        assert again.returncode == 0 and "skipped: a finished run" in again.stdout + again.stderr, again.stderr[-3000:]
    run_files = sorted((root / "runs").glob("*/*/wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1  # the second wandb launch found the marker
    (stored,) = (root / "store").glob("*/results.json")
    assert summary(run_files[0])["paper_mdl"] == json.loads(stored.read_text())["paper_mdl"]
    record = run_files[0].read_bytes()
    for series in (b"block01/val_accuracy", b"block02/val_accuracy", b"final/val_accuracy"):
        assert series in record, series  # before: no val_accuracy series from a stored run (0 of 10)


def test_a_stored_block_gives_a_logger_its_accuracy_with_its_losses(finished_run) -> None:
    """results.json keeps each block's and the final fit's validation accuracy per epoch, so a logger added later
    (W&B from the store) gets every series the live run logged; before, blocks kept none."""
    from mdl.results import BlockResult
    from mdl.run.loggers import LoggerGroup, log_block

    class Rows:
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            self.rows.append(metrics)

    results = json.loads((finished_run.run_dir / "results.json").read_text())
    first = results["blocks"][0]
    assert len(first["val_accuracy_curve"]) == len(first["val_loss_curve"]) > 0
    assert len(results["val_accuracy_curve"]) == len(results["val_loss_curve"])
    rows = Rows()
    log_block(LoggerGroup([rows]), 0, BlockResult(**first), curves=True)
    logged = [r["block01/val_accuracy"] for r in rows.rows if "block01/val_accuracy" in r]
    assert logged == first["val_accuracy_curve"] and all(0 <= a <= 1 for a in logged)


@pytest.mark.slow  # two launches with W&B
def test_a_run_logged_live_is_not_logged_again_when_a_relaunch_skips_it(tmp_path: Path) -> None:
    """A sweep relaunched after a preemption skips its finished runs: those W&B already has, live, were logged a
    second time from the store (the store's marker was written only by that logging), two W&B runs for one run."""
    for attempt in ("first", "relaunch"):
        done = run_launch(["logger=wandb", f"paths.output_root={tmp_path}", *FAST], cwd=tmp_path, env=WANDB_OFFLINE)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped: a finished run" in done.stdout + done.stderr
    assert len(list((tmp_path / "runs").glob("*/*/wandb/offline-run-*/run-*.wandb"))) == 1


def test_several_loggers_each_get_the_run(small_sweep) -> None:
    """logger=[csv,wandb] (the template's list of loggers; the sweep's adds tensorboard where installed): the CSV file
    and the W&B run both hold the live series and the paper's numbers; W&B keeps its summary, the CSV its rows."""
    import csv

    from wandb_records import summary

    for run_dir in small_sweep.run_dirs:
        (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        results = json.loads((run_dir / "results.json").read_text())
        assert summary(run_file)["paper_mdl"] == results["paper_mdl"]
        assert b"block01/val_loss" in run_file.read_bytes()
        with open(run_dir / "csv" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert any(r.get("block01/val_loss") for r in rows)
        assert [float(r["paper_mdl"]) for r in rows if r.get("paper_mdl")] == [results["paper_mdl"]]


def test_a_logger_setting_outside_its_logger_is_named(tmp_path: Path) -> None:
    """Settings sit under the logger's name (logger.wandb.project=...); a flat one is refused with the fix."""
    proc = run_launch(["logger=wandb", "+logger.project=foo", f"paths.output_root={tmp_path}", *FAST], cwd=tmp_path)
    assert proc.returncode == 2
    assert "logger.project: not a logger" in proc.stderr and "logger.wandb.project" in proc.stderr


def test_the_run_images_function_is_named_by_config_and_checked_before_the_run(tmp_path: Path) -> None:
    """The picture W&B logs with a run is the report's function named in conf/logger/wandb.yaml (no import up the
    layers); a name that is no module fails before the data load, with the fix; null logs none."""
    import pytest

    from conftest import compose_config
    from mdl.run.loggers import LoggerGroup, check_logger, run_images

    cfg = compose_config(["logger=wandb", "logger.wandb.run_images=no_such_module.panel"])
    with pytest.raises(ValueError, match=r"no such module 'no_such_module'.*logger.wandb.run_images=null"):
        check_logger(cfg)
    check_logger(compose_config(["logger=wandb", "logger.wandb.run_images=null"]))
    assert compose_config(["logger=wandb"]).logger.wandb.run_images == "mdl.report.figure1.run_panel"
    assert run_images(LoggerGroup([], None, None), tmp_path) == []
    assert run_images(LoggerGroup([], None, "mdl.report.figure1.no_such_function"), tmp_path) == []  # never fails a run
