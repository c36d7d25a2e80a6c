"""`python -m mdl.runs` lists the run store: finished and partial runs, filters, CSV export."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import FAST, compose_config
from mdl.results import FAILURE_FILE
from mdl.run.experiment import run_experiment
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
    assert "RuntimeError: the data broke" in printed and "1 failed" in printed and "error" in printed.splitlines()[0]

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
    header = capsys.readouterr().out.splitlines()[0].split()
    for column in ("lr", "activation", "tags", "date", "path", "paper_mdl"):
        assert column in header, header
    assert "error" not in header and "seed" in header
    rows = {r["activation"]: r for r in csv.DictReader(out.open())}
    for act, result in results.items():
        assert float(rows[act]["paper_mdl"]) == result["paper_mdl"]  # every digit, not 4
        assert rows[act]["path"] == str((tmp_path / act).resolve()) and rows[act]["tags"] == "v2"
        assert float(rows[act]["lr"]) == result["config"]["optimizer"]["lr"]


@pytest.mark.parametrize("key, hint", [("eraser", "eraser.name"), ("eraser.nmae", "eraser.name"), ("activaton", None)])
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

    monkeypatch.setattr(pack, "_train_together", out_of_memory)
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
    assert "0123456789abcdef  damaged" in out and "1 damaged" in out
    assert f"{entry / 'config.json'} is damaged" in err
