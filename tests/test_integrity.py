"""Honest numbers after damage, code changes and concurrency (docs/slurm.md: "Interruptions lose nothing").

Each test fails on a framework that trusts what it finds on disk: a damaged checkpoint, progress
file or stored result, progress made by other code, or a second process running the same run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, REPO, compose_config, python_path
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash
from test_resume import EXACT, KILL_SETTINGS, run_killed_after

SETTINGS = [*KILL_SETTINGS, "trainer.patience=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ref")
    return run_experiment(compose_config(SETTINGS, root), root / "run")


def _store(root: Path) -> Path:
    (folder,) = (root / "store").iterdir()
    return folder


def _same(results: dict, reference: dict) -> None:
    for key in EXACT:
        assert results[key] == reference[key], key


def test_damaged_checkpoint_is_discarded_and_its_block_retrained(reference, tmp_path, monkeypatch, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    assert run_killed_after(cfg, tmp_path / "a", 3, monkeypatch)
    (ckpt,) = _store(tmp_path).glob("checkpoints/*.ckpt")
    blob = bytearray(ckpt.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 8] = bytes(b ^ 0xFF for b in blob[len(blob) // 2 : len(blob) // 2 + 8])
    ckpt.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING):
        _same(run_experiment(cfg, tmp_path / "b"), reference)
    assert "discarding damaged checkpoint" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "edit"])
def test_damaged_progress_file_is_redone(damage: str, reference, tmp_path, monkeypatch, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    saves = reference["blocks"][0]["epochs"] + 1  # inside block 2: block 1 is recorded in progress.json
    assert run_killed_after(cfg, tmp_path / "a", saves, monkeypatch)
    progress = _store(tmp_path) / "progress.json"
    text = progress.read_text()
    progress.write_text(
        text[: len(text) // 2] if damage == "truncate" else text.replace('"epochs": ', '"epochs": 1', 1)
    )
    with caplog.at_level(logging.WARNING):
        _same(run_experiment(cfg, tmp_path / "b"), reference)
    assert "discarding the earlier progress" in caplog.text


@pytest.mark.slow
def test_progress_made_by_other_code_is_not_resumed(reference, tmp_path, monkeypatch, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    saves = reference["blocks"][0]["epochs"] + 1
    with monkeypatch.context() as m:
        m.setattr("mdl.engine.progress.code_version", lambda: "0ldc0de")
        assert run_killed_after(cfg, tmp_path / "a", saves, monkeypatch)
    with caplog.at_level(logging.WARNING):
        results = run_experiment(cfg, tmp_path / "b")
    assert "made by code version 0ldc0de" in caplog.text
    _same(results, reference)


def _killed_in_block_0_by_other_code(cfg, run_dir: Path, monkeypatch) -> None:
    with monkeypatch.context() as m:
        m.setattr("mdl.engine.progress.code_version", lambda: "0ldc0de")
        m.setattr("mdl.results.code_version", lambda: "0ldc0de")
        assert run_killed_after(cfg, run_dir, 1, monkeypatch)  # inside block 0: nothing finished yet


def test_block_0_killed_under_other_code_is_not_resumed(reference, tmp_path, monkeypatch, caplog) -> None:
    """progress.json exists from the start of a run, so even a kill before the first block ends
    leaves the code version behind (it used to be written after block 0 only)."""
    cfg = compose_config(SETTINGS, tmp_path)
    _killed_in_block_0_by_other_code(cfg, tmp_path / "a", monkeypatch)
    assert json.loads((_store(tmp_path) / "progress.json").read_text())["code_version"] == "0ldc0de"
    with caplog.at_level(logging.WARNING):
        _same(run_experiment(cfg, tmp_path / "b"), reference)
    assert "made by code version 0ldc0de" in caplog.text


def test_a_checkpoint_carries_the_code_and_run_that_wrote_it(reference, tmp_path, monkeypatch, caplog) -> None:
    """Without progress.json to say so, the checkpoint's own stamp refuses another code version."""
    cfg = compose_config(SETTINGS, tmp_path)
    _killed_in_block_0_by_other_code(cfg, tmp_path / "a", monkeypatch)
    store = _store(tmp_path)
    (store / "progress.json").unlink()
    from mdl.engine.checkpoints import read_stamp

    (ckpt,) = store.glob("checkpoints/*.ckpt")
    assert read_stamp(ckpt) == f"code 0ldc0de run {store.name}"
    with caplog.at_level(logging.WARNING):
        _same(run_experiment(cfg, tmp_path / "b"), reference)
    assert f"written by code 0ldc0de run {store.name}" in caplog.text


@pytest.mark.slow
def test_damaged_stored_result_is_run_again_not_skipped(reference, tmp_path, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    run_experiment(cfg, tmp_path / "a")
    stored = _store(tmp_path) / "results.json"
    stored.write_text(stored.read_text()[:100])
    with caplog.at_level(logging.WARNING):
        again = run_experiment(cfg, tmp_path / "b")
    assert not again.get("skipped") and "damaged" in caplog.text
    _same(again, reference)
    assert run_experiment(cfg, tmp_path / "c")["skipped"]  # and the rewritten one is trusted


def test_where_things_are_stored_is_not_part_of_a_runs_identity(tmp_path) -> None:
    a = compose_config(FAST, tmp_path)
    b = compose_config([*FAST, "data.cache_dir=/elsewhere", "paths.data_root=/data"], tmp_path / "x")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(compose_config([*FAST, "seed=1"], tmp_path))


def test_one_block_schedule_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"mdl.num_blocks=1.*(at least 2|>= 2)"):
        run_experiment(compose_config([*FAST, "mdl.num_blocks=1"], tmp_path), tmp_path / "run")


@pytest.mark.slow
def test_undefined_test_score_is_null_not_zero(tmp_path) -> None:
    results = run_experiment(compose_config([*FAST, "data.test_size=0"], tmp_path), tmp_path / "run")
    assert results["final_test_bits_per_example"] is None
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["final_test_bits_per_example"] is None


@pytest.mark.slow  # two launches at once, end to end (the lock itself: tests/test_run_lock.py)
def test_two_identical_runs_started_together_never_share_a_fit(tmp_path) -> None:
    args = [sys.executable, str(REPO / "launch.py"), *SETTINGS, f"paths.output_root={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": python_path()}
    procs = [
        subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert sum("skipped: a finished run" in out for out in outputs) == 1, outputs
    results = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("results.json")]
    assert len(results) == 2 and results[0]["paper_mdl"] == results[1]["paper_mdl"]
    assert not list((tmp_path / "store").rglob("*.tmp"))


def test_temporaries_of_killed_checkpoint_writes_are_removed_on_the_next_attempt(
    reference, tmp_path, monkeypatch, caplog
) -> None:
    """A kill during a checkpoint write leaves its unique temporary (as large as the checkpoint); it was never removed."""
    cfg = compose_config(SETTINGS, tmp_path)
    assert run_killed_after(cfg, tmp_path / "a", 2, monkeypatch)
    (ckpt,) = _store(tmp_path).glob("checkpoints/*.ckpt")
    left = ckpt.with_name(f".{ckpt.name}.12345.deadbeef.tmp")
    left.write_bytes(b"half a checkpoint")
    with caplog.at_level(logging.WARNING):
        _same(run_experiment(cfg, tmp_path / "b"), reference)
    assert not left.exists() and "temporary file(s) of killed checkpoint writes" in caplog.text
