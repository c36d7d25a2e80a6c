"""The training side: seeding, the experiment runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, compose_config
from mdl.run.experiment import run_experiment


def _run(tmp_path: Path, seed: int, tag: str) -> dict:
    cfg = compose_config(FAST + [f"seed={seed}", "skip_if_done=false"], output_root=tmp_path / tag)
    return run_experiment(cfg, tmp_path / tag / "run")


def test_seed_zero_is_a_seed_like_any_other(tmp_path: Path) -> None:
    cfg = compose_config(FAST + ["seed=0"])
    assert cfg.seed == 0
    a, b, c = _run(tmp_path, 0, "a"), _run(tmp_path, 0, "b"), _run(tmp_path, 1, "c")
    assert [blk["eval_bits"] for blk in a["blocks"]] == [blk["eval_bits"] for blk in b["blocks"]]
    assert a["val_loss_curve"] == b["val_loss_curve"]
    assert [blk["eval_bits"] for blk in a["blocks"]] != [blk["eval_bits"] for blk in c["blocks"]]


def test_results_file_has_the_documented_keys(tmp_path: Path) -> None:
    cfg = compose_config(FAST, output_root=tmp_path)
    run_experiment(cfg, tmp_path / "run")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    for key in (
        "config",
        "git_sha",
        "blocks",
        "online_codelength_bits",
        "online_bits_per_example",
        "paper_mdl",
        "final_val_loss",
        "val_loss_curve",
        "config_hash",
        "eraser_path",
    ):
        assert key in results, key
    assert results["config"]["seed"] == 0 and results["config"]["eraser"]["name"] == "leace"
    assert [b["n_train"] for b in results["blocks"]] == results["boundaries"][:-1]
    assert sum(b["n_eval"] for b in results["blocks"]) + results["boundaries"][0] == results["n_train"]
    assert len(results["val_loss_curve"]) >= 1 and results["final_val_loss"] == min(results["val_loss_curve"])
    assert Path(results["eraser_path"]).exists()


def test_finished_config_is_skipped(tmp_path: Path) -> None:
    cfg = compose_config(FAST, output_root=tmp_path)
    first = run_experiment(cfg, tmp_path / "one")
    second = run_experiment(cfg, tmp_path / "two")
    assert second.get("skipped") is True and second["paper_mdl"] == first["paper_mdl"]
    assert json.loads((tmp_path / "two" / "results.json").read_text())["skipped"] is True


def test_a_finished_run_keeps_no_checkpoints_and_skip_if_done_false_runs_it_again(tmp_path: Path) -> None:
    """Checkpoints (the final one ~4x the model) serve only a resume; and with skip_if_done=false a run is
    trained again, not resumed from what an earlier attempt left (it reused a leftover final.ckpt)."""
    cfg = compose_config([*FAST, "mdl.members_per_fit=1"], output_root=tmp_path)
    first = run_experiment(cfg, tmp_path / "one")
    (store,) = (tmp_path / "store").iterdir()
    assert not (store / "checkpoints").exists() and not (store / "progress.json").exists()
    (store / "checkpoints").mkdir()
    (store / "checkpoints" / "final.ckpt").write_bytes(b"left by an earlier attempt")
    again = run_experiment(
        compose_config([*FAST, "mdl.members_per_fit=1", "skip_if_done=false"], output_root=tmp_path), tmp_path / "two"
    )
    assert not again.get("skipped") and again["paper_mdl"] == first["paper_mdl"]
    assert not (store / "checkpoints").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("eraser.name=nope", "unknown eraser 'nope'"),
        ("model.name=nope", "unknown model 'nope'"),
        ("seed=-1", "seed"),
        ("mdl.steps_per_group=2.5", "mdl.steps_per_group=2.5: must be an integer >= 1"),
        ("mdl.steps_per_group=abc", "mdl.steps_per_group='abc'"),
        ("mdl.checkpoint_every_s=inf", "mdl.checkpoint_every_s=inf: must be a finite number"),
        ("mdl.checkpoint_every_s=abc", "mdl.checkpoint_every_s='abc'"),
        (
            "+trainer.patiense=1",
            "trainer.patiense: unknown setting, it would be ignored; did you mean trainer.patience",
        ),
        ("+mdl.num_block=3", "did you mean mdl.num_blocks"),
    ],
)
def test_bad_config_values_are_named(tmp_path: Path, override: str, message: str) -> None:
    cfg = compose_config(FAST + [override], output_root=tmp_path)
    with pytest.raises(ValueError, match=message):
        run_experiment(cfg, tmp_path / "run")
