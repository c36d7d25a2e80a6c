"""A run's environment (mdl/run/environment.py): recorded with its results, outside its identity, and a stored
result from another environment is never reused silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import FAST, compose_config
from mdl.results import RESULTS_FILE, read_checked_json, write_checked_json
from mdl.run.environment import current_environment, describe, environment_differences
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash

SETTINGS = [*FAST, "trainer.torch_threads=1"]


def test_environment_names_what_moves_the_last_bits() -> None:
    env = current_environment("cpu", threads=3)
    for key in ("python", "torch", "numpy", "cuda", "cudnn", "gpu", "blas", "cpu_capability", "threads"):
        assert key in env, key
    assert env["threads"] == 3 and env["gpu"] is None and env["cuda"] is None  # a CPU run used no CUDA library
    assert environment_differences(env, dict(env)) == []
    assert environment_differences(env, {**env, "torch": "9.9"}) == [f"torch: {env['torch']} -> 9.9"]
    assert environment_differences(None, env) == ["environment: unrecorded -> recorded"]
    assert describe(env).startswith(f"torch {env['torch']} cpu/")


def test_environment_is_not_part_of_a_runs_identity(tmp_path: Path) -> None:
    base = config_hash(compose_config(SETTINGS, tmp_path))
    assert config_hash(compose_config([*SETTINGS, "mdl.reuse_across_environments=true"], tmp_path)) == base


def _pretend_made_elsewhere(store_results: Path) -> None:
    results = read_checked_json(store_results)
    results["environment"] = {**results["environment"], "torch": "0.0.1-elsewhere", "cpu_capability": "NEON"}
    write_checked_json(store_results, results)


def test_a_result_from_another_environment_is_not_reused_silently(tmp_path: Path, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    first = run_experiment(cfg, tmp_path / "first")
    assert first["environment"] == current_environment("cpu", threads=1)
    stored = Path(cfg.paths.store_dir) / first["config_hash"] / RESULTS_FILE
    _pretend_made_elsewhere(stored)

    with caplog.at_level(logging.WARNING):
        again = run_experiment(cfg, tmp_path / "again")  # computed again here, and said so
    assert not again.get("skipped")
    assert "made in another environment" in caplog.text and "0.0.1-elsewhere" in caplog.text and "NEON" in caplog.text
    assert again["paper_mdl"] == first["paper_mdl"]  # same machine, same numbers
    assert read_checked_json(stored)["environment"] == current_environment(
        "cpu", threads=1
    )  # the store now holds this one


def test_reuse_across_environments_reuses_it_with_a_warning(tmp_path: Path, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    first = run_experiment(cfg, tmp_path / "first")
    _pretend_made_elsewhere(Path(cfg.paths.store_dir) / first["config_hash"] / RESULTS_FILE)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reused = run_experiment(
            compose_config([*SETTINGS, "mdl.reuse_across_environments=true"], tmp_path), tmp_path / "b"
        )
    assert reused["skipped"] and reused["environment"]["torch"] == "0.0.1-elsewhere"
    assert "reusing the finished run of this config made in another environment" in caplog.text


def test_same_environment_is_reused_quietly(tmp_path: Path, caplog) -> None:
    cfg = compose_config(SETTINGS, tmp_path)
    run_experiment(cfg, tmp_path / "first")
    with caplog.at_level(logging.WARNING):
        assert run_experiment(cfg, tmp_path / "again")["skipped"]
    assert "environment" not in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_the_thread_count_recorded_is_the_one_trained_with(tmp_path: Path, threads: int) -> None:
    results = run_experiment(compose_config([*FAST, f"trainer.torch_threads={threads}"], tmp_path), tmp_path / "run")
    assert results["environment"]["threads"] == threads
