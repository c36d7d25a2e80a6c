"""The training side: schedule-free modes around checkpoints, seeding, the experiment runner."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import schedulefree
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import FAST, compose_config
from datamodules.loader import DeviceBatches
from mdl.run.experiment import run_experiment
from models import Classifier, create_model
from models.module import optimizer_train_mode, set_optimizer_mode


class RecordEvalWeights(L.Callback):
    """Save a checkpoint mid-epoch (optimizer in train mode) and remember the eval-mode weights."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.expected: dict[str, dict[str, torch.Tensor]] = {}
        self.train_mode_weights: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 1:
            return
        opt = trainer.optimizers[0]
        assert optimizer_train_mode(opt) is True
        path = self.folder / f"mid-{trainer.current_epoch}.ckpt"
        self.train_mode_weights[path.name] = copy.deepcopy(pl_module.state_dict())
        trainer.save_checkpoint(path)
        set_optimizer_mode(opt, train=False)
        self.expected[path.name] = copy.deepcopy(pl_module.state_dict())
        set_optimizer_mode(opt, train=True)
        assert optimizer_train_mode(opt) is True


def test_checkpoints_hold_eval_mode_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.rand(256, 1, 8, 8), torch.randint(0, 10, (256,))
    model = create_model("mlp", 32, 2, 10, (1, 8, 8), base_width=32)
    module = Classifier(model, lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=0), lr=1e-2)
    recorder = RecordEvalWeights(tmp_path)
    end_of_epoch = ModelCheckpoint(
        dirpath=tmp_path, filename="epoch-{epoch}", save_top_k=-1, save_on_train_epoch_end=True
    )
    trainer = L.Trainer(
        max_epochs=3,
        callbacks=[recorder, end_of_epoch],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DeviceBatches(x, y, 64, shuffle=True), DeviceBatches(x, y, 128))
    assert len(recorder.expected) == 3
    for name, expected in recorder.expected.items():
        ckpt = torch.load(tmp_path / name, weights_only=False)
        assert all(g["train_mode"] is False for g in ckpt["optimizer_states"][0]["param_groups"])
        # eval() and train() are lerps, so a round trip moves weights by float rounding only
        for key, value in expected.items():
            assert torch.allclose(ckpt["state_dict"][key], value, rtol=1e-5, atol=1e-7), f"{name}: {key}"
        train_weights = recorder.train_mode_weights[name]
        assert any(
            not torch.allclose(ckpt["state_dict"][k], v, rtol=1e-3, atol=1e-6) for k, v in train_weights.items()
        ), "train- and eval-mode weights coincide: the test would not notice a train-mode checkpoint"
    epoch_ckpts = sorted(tmp_path.glob("epoch-*.ckpt"))
    assert len(epoch_ckpts) == 3
    for path in epoch_ckpts:
        ckpt = torch.load(path, weights_only=False)
        assert all(g["train_mode"] is False for g in ckpt["optimizer_states"][0]["param_groups"])


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
