"""`python -m mdl.runs` lists the run store: finished and partial runs, filters, CSV export."""

from __future__ import annotations

import csv
from pathlib import Path

from conftest import FAST, compose_config
from mdl.run.experiment import run_experiment
from mdl.runs import list_runs, main
from test_resume import KILL_SETTINGS, run_killed_after


def test_lists_finished_and_partial_runs_with_filters(tmp_path: Path, monkeypatch, capsys) -> None:
    finished = run_experiment(compose_config(FAST + ["eraser=none"], tmp_path), tmp_path / "a")
    partial_cfg = compose_config([*KILL_SETTINGS, "trainer.patience=2", "eraser=leace"], tmp_path)
    assert run_killed_after(partial_cfg, tmp_path / "b", 6, monkeypatch)

    runs = {r.values["eraser"]: r for r in list_runs(tmp_path / "store")}
    assert runs["none"].status == "finished" and runs["none"].values["paper_mdl"] == round(finished["paper_mdl"], 4)
    assert runs["leace"].status in ("partial", "started") and runs["leace"].values["paper_mdl"] is None
    assert [r.values["eraser"] for r in list_runs(tmp_path / "store", where=["eraser.name=leace"])] == ["leace"]
    assert [r.values["eraser"] for r in list_runs(tmp_path / "store", status="finished")] == ["none"]

    out = tmp_path / "runs.csv"
    assert main([f"paths.output_root={tmp_path}", "--where", "width=32", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 run(s): 1 finished" in printed and finished["config_hash"] in printed
    rows = list(csv.DictReader(out.open()))
    assert {r["eraser"] for r in rows} == {"none", "leace"}


def test_missing_store_is_one_message(tmp_path: Path, capsys) -> None:
    assert main([f"paths.output_root={tmp_path / 'nowhere'}"]) == 2
    assert "no run store at" in capsys.readouterr().err


def test_a_run_with_a_truncated_record_is_listed_as_damaged(tmp_path: Path, capsys) -> None:
    """A config.json cut short (a full disk, a kill) used to leave its run out of the listing without a word."""
    entry = tmp_path / "store" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{"config": {"seed": 0, "wid')
    assert main([f"paths.output_root={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    assert "0123456789abcdef  damaged" in out and "1 damaged" in out
    assert f"{entry / 'config.json'} is damaged" in err
