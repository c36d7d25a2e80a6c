"""Grouped steps: ``mdl.steps_per_group`` batches per Lightning step change how often Lightning runs, never which
batches, steps or hooks a model sees; the trainer settings the protocol cannot honour are refused."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

import mdl.run.experiment
from conftest import FAST, compose_config
from mdl.run.experiment import run_experiment
from mdl.engine.protocol import MemberState
from mdl.engine.trainer_settings import refuse_for_stacked

SEQUENTIAL = [
    *FAST,
    "mdl.members_per_fit=1",
    "mdl.checkpoint_every_s=0",
    "mdl.min_steps_per_pass=1",
    "skip_if_done=false",
]


@pytest.mark.slow
def test_grouping_changes_no_result(tmp_path: Path) -> None:
    """steps_per_group 1 and 5 (5 steps per Lightning step), and passes (Lightning's epochs) of one epoch or of
    many, train the same batches with the same steps: on this CPU the same numbers to the bit."""
    results = [
        run_experiment(
            compose_config(
                [*SEQUENTIAL, "trainer.kwargs.max_epochs=6", f"mdl.steps_per_group={g}", f"mdl.min_steps_per_pass={p}"],
                tmp_path / f"{g}_{p}",
            ),
            tmp_path / f"{g}_{p}" / "run",
        )
        for g, p in ((1, 1), (5, 1), (5, 64))
    ]
    ungrouped, *others = (
        [(b["epochs"], b["eval_bits"], b["val_loss_curve"], b["train_loss_curve"]) for b in r["blocks"]]
        for r in results
    )
    for r, blocks in zip(results[1:], others):
        assert blocks == ungrouped
        assert r["val_loss_curve"] == results[0]["val_loss_curve"]
        assert r["paper_mdl"] == results[0]["paper_mdl"]


class CountSteps(L.Callback):
    """Counts optimizer steps (through the per-step hooks) and Lightning's training steps."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(
            (
                "on_before_backward",
                "on_after_backward",
                "on_before_optimizer_step",
                "on_before_zero_grad",
                "on_train_batch_end",
            ),
            0,
        )

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        assert loss.requires_grad
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer, pl_module) -> None:
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        assert any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        self.calls["on_before_optimizer_step"] += 1

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self.calls["on_before_zero_grad"] += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls["on_train_batch_end"] += 1


@pytest.mark.parametrize("group", [1, 4])
def test_callbacks_see_every_optimizer_step(group: int, tmp_path: Path, monkeypatch) -> None:
    """Each per-step hook runs once per optimizer step, grouped or not; Lightning's own training
    steps number one per group."""
    counter = CountSteps()
    monkeypatch.setattr(mdl.run.experiment, "make_preconditioner", lambda cfg, dm, make_model: ([counter], None))
    cfg = compose_config([*SEQUENTIAL, "trainer.kwargs.max_epochs=5", f"mdl.steps_per_group={group}"], tmp_path)
    results = run_experiment(cfg, tmp_path / "run")
    batch = cfg.data.batch_size
    fits = [(b["n_train"], b["epochs"]) for b in results["blocks"]] + [(results["n_train"], results["final_epochs"])]
    steps = sum(epochs * math.ceil(n / batch) for n, epochs in fits)
    lightning_steps = sum(epochs * math.ceil(math.ceil(n / batch) / group) for n, epochs in fits)
    assert counter.calls == {**dict.fromkeys(counter.calls, steps), "on_train_batch_end": lightning_steps}
    assert group == 1 or lightning_steps < steps


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ("check_val_every_n_epoch=2", "validates every model"),
        ("limit_val_batches=0.5", "validates every model"),
        ("val_check_interval=0.25", "validates every model"),
        ("max_steps=100", "use max_epochs"),
        ("min_steps=10", "use max_epochs"),
        ("gradient_clip_val=0.5", "cannot clip each member"),
        ("accumulate_grad_batches=2", "follow the prequential protocol"),
        ("min_epochs=3", "follow the prequential protocol"),
    ],
)
def test_protocol_breaking_settings_are_refused(setting: str, reason: str, tmp_path: Path) -> None:
    """A fit of one member too: the protocol validates in place at every epoch end, so a setting of Lightning's
    validation loop would be silently ignored; a step limit does not resume from epoch-end checkpoints; Lightning
    neither clips nor accumulates under the manual optimization every fit uses. Each is refused, with the reason."""
    with pytest.raises(ValueError, match=f"trainer.kwargs.{setting.split('=')[0]}=.*{reason}"):
        run_experiment(compose_config([*SEQUENTIAL, f"+trainer.kwargs.{setting}"], tmp_path), tmp_path / "run")


def test_a_time_limit_is_refused_and_lightnings_none_defaults_are_not() -> None:
    with pytest.raises(ValueError, match="trainer.kwargs.max_time=.*use max_epochs"):
        refuse_for_stacked({"max_time": {"hours": 1}})
    refuse_for_stacked({"max_time": None, "min_steps": None, "limit_val_batches": None, "val_check_interval": None})


def test_early_stopping_follows_lightnings_rule() -> None:
    """A member stops where Lightning's EarlyStopping would on the same validation losses (float32 comparisons: a
    float64 improvement below float32 resolution is none) and keeps the best epoch (``MemberState``)."""
    from lightning.pytorch.callbacks import EarlyStopping

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        losses = (1 + torch.randn(40, generator=gen, dtype=torch.float64).cumsum(0) * 0.01).tolist()
        losses[4] = min(losses[:4]) - 0.01  # the best so far
        losses[5] = losses[4] - 1e-12  # better in float64, equal in float32: no improvement
        patience = 1 + trial % 4
        state, lightning = MemberState(member=0, n_train=1), EarlyStopping("val_loss", patience=patience)
        expected_stop = next(
            e
            for e in range(40)
            if lightning._evaluate_stopping_criteria(torch.tensor(losses[e], dtype=torch.float32))[0]
        )
        for epoch in range(40):
            state.epoch = epoch + 1
            if state.should_stop(state.judge(losses[epoch], epoch), patience, None):
                break
        assert epoch == expected_stop and state.best_epoch == min(
            range(expected_stop + 1), key=lambda e: (float(torch.tensor(losses[e], dtype=torch.float32)), e)
        )
