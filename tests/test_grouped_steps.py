"""The sequential engine's grouped steps: ``mdl.steps_per_group`` batches per Lightning step change
how often Lightning runs, never which batches, steps or hooks a model sees."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import schedulefree
import torch

import mdl.run.experiment
from conftest import FAST, RecordOps, compose_config, host_reads
from datamodules.augment import Augmentation
from datamodules.loader import BatchGroup, DeviceBatches, GroupedBatches
from mdl.run.experiment import run_experiment
from mdl.engine.trainer_settings import refuse_for_sequential, settings_needing_single_steps
from models import create_model
from models.module import Classifier

SEQUENTIAL = [*FAST, "mdl.members_per_fit=1", "mdl.checkpoint_every_s=0", "skip_if_done=false"]


def test_groups_hold_the_loaders_batches_in_order() -> None:
    x, y = torch.rand(150, 3, 8, 8), torch.arange(150)
    inner = DeviceBatches(x, y, 16, shuffle=True, augment=Augmentation(), seed=3)  # 10 batches, the last one short
    grouped = GroupedBatches(DeviceBatches(x, y, 16, shuffle=True, augment=Augmentation(), seed=3), steps_per_group=4)
    for epoch in (0, 1):
        inner.set_epoch(epoch)
        grouped.set_epoch(epoch)
        groups = list(grouped)
        assert [g.steps for g in groups] == [4, 4, 2] and len(grouped) == 3
        flat = [batch for g in groups for batch in g.batches]
        for (xg, yg), (xi, yi) in zip(flat, inner, strict=True):
            assert torch.equal(xg, xi) and torch.equal(yg, yi)
    with pytest.raises(ValueError, match="steps_per_group must be >= 1"):
        GroupedBatches(inner, 0)


def test_grouping_changes_no_result(tmp_path: Path) -> None:
    """steps_per_group 1 (Lightning's automatic optimization) and 5 (manual, 5 steps per Lightning
    step) train the same batches with the same steps: on this CPU the same numbers to the bit."""
    results = [
        run_experiment(
            compose_config([*SEQUENTIAL, "trainer.kwargs.max_epochs=6", f"mdl.steps_per_group={g}"], tmp_path / str(g)),
            tmp_path / str(g) / "run",
        )
        for g in (1, 5)
    ]
    ungrouped, grouped = (
        [(b["epochs"], b["eval_bits"], b["val_loss_curve"], b["train_loss_curve"]) for b in r["blocks"]]
        for r in results
    )
    assert grouped == ungrouped
    assert results[1]["val_loss_curve"] == results[0]["val_loss_curve"]
    assert results[1]["paper_mdl"] == results[0]["paper_mdl"]


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


def test_gradient_clipping_trains_one_step_per_lightning_step(tmp_path: Path) -> None:
    """Lightning clips only under automatic optimization: a run that asks for clipping runs
    ungrouped (and equals the run that asked for single steps itself)."""
    runs = [
        run_experiment(
            compose_config(
                [*SEQUENTIAL, "+trainer.kwargs.gradient_clip_val=0.01", f"mdl.steps_per_group={g}"], tmp_path / str(g)
            ),
            tmp_path / str(g) / "run",
        )
        for g in (1, 4)
    ]
    assert runs[0]["blocks"] == runs[1]["blocks"]
    unclipped = run_experiment(compose_config(SEQUENTIAL, tmp_path / "free"), tmp_path / "free" / "run")
    assert unclipped["blocks"][0]["train_loss_curve"] != runs[0]["blocks"][0]["train_loss_curve"]  # clipping acted


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, []),
        (
            {
                "gradient_clip_val": 0,
                "accumulate_grad_batches": 1,
                "limit_train_batches": 1.0,
                "fast_dev_run": False,
                "overfit_batches": 0.0,
                "max_epochs": 50,
            },
            [],
        ),
        ({"gradient_clip_val": 1.0}, ["gradient_clip_val"]),
        ({"accumulate_grad_batches": 2, "fast_dev_run": True}, ["accumulate_grad_batches", "fast_dev_run"]),
        ({"limit_train_batches": 1}, ["limit_train_batches"]),  # an int counts batches: one, not all
        ({"overfit_batches": 2}, ["overfit_batches"]),
        ({"gradient_clip_val": None, "limit_train_batches": None}, []),  # Lightning's own defaults
        (
            {"accumulate_grad_batches": None},
            ["accumulate_grad_batches"],
        ),  # not its default: Lightning's error, not ours
    ],
)
def test_settings_that_act_on_lightning_steps_are_found(kwargs: dict, named: list[str]) -> None:
    assert sorted(settings_needing_single_steps(kwargs)) == named


def test_a_group_of_steps_reads_nothing_back_to_the_host() -> None:
    torch.manual_seed(0)
    model = create_model("mlp", 32, 2, 10, (1, 8, 8), base_width=32)
    module = Classifier(model, lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=0), lr=1e-2)
    optimizer = module.configure_optimizers()
    optimizer.train()
    group = BatchGroup([(torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))) for _ in range(4)])
    with RecordOps() as record:
        module.train_group(group, optimizer)
    assert not host_reads(record), host_reads(record)
    assert module._epoch_mean("train") > 0 and module._sums == {}


def test_a_group_of_steps_launches_no_kernel_a_hand_written_loop_would_not() -> None:
    """The framework's steps (loss curve on the device, per-step hooks) add no GPU work: the same
    kernels as the plain loop ``loss.backward(); step(); zero_grad(); total += loss * n``."""

    def make() -> tuple[Classifier, torch.optim.Optimizer]:
        torch.manual_seed(0)
        module = Classifier(
            create_model("mlp", 32, 2, 10, (1, 8, 8), base_width=32),
            lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=0),
            lr=1e-2,
        )
        optimizer = module.configure_optimizers()
        optimizer.train()
        return module, optimizer

    batches = [(torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))) for _ in range(3)]
    module, optimizer = make()
    module.train_group(BatchGroup(batches), optimizer)  # the optimizer's state exists in both counts
    module._sums.clear()
    with RecordOps() as framework:
        module.train_group(BatchGroup(batches), optimizer)
    hand_module, hand_optimizer = make()
    for x, y in batches:  # the same warm-up steps
        torch.nn.functional.cross_entropy(hand_module(x), y).backward()
        hand_optimizer.step()
        hand_optimizer.zero_grad(set_to_none=True)
    with RecordOps() as hand:
        total = None
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(hand_module(x), y)
            loss.backward()
            hand_optimizer.step()
            hand_optimizer.zero_grad(set_to_none=True)
            term = loss.detach().double() * y.shape[0]
            total = term if total is None else total + term
    assert framework.kernels and sorted(framework.kernels) == sorted(hand.kernels)


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ("check_val_every_n_epoch=2", "validates every model"),
        ("limit_val_batches=0.5", "validates every model"),
        ("val_check_interval=0.25", "validates every model"),
        ("max_steps=100", "use max_epochs"),
        ("min_steps=10", "use max_epochs"),
    ],
)
def test_protocol_breaking_settings_are_refused(setting: str, reason: str, tmp_path: Path) -> None:
    """The sequential engine validates in place at every epoch end, so a setting of Lightning's
    validation loop would be silently ignored; a step limit does not resume from epoch-end
    checkpoints. Both are refused, with the reason."""
    with pytest.raises(ValueError, match=f"trainer.kwargs.{setting.split('=')[0]}=.*{reason}"):
        run_experiment(compose_config([*SEQUENTIAL, f"+trainer.kwargs.{setting}"], tmp_path), tmp_path / "run")


def test_a_time_limit_is_refused_and_lightnings_none_defaults_are_not() -> None:
    with pytest.raises(ValueError, match="trainer.kwargs.max_time=.*use max_epochs"):
        refuse_for_sequential({"max_time": {"hours": 1}})
    refuse_for_sequential({"max_time": None, "min_steps": None, "limit_val_batches": None, "val_check_interval": None})


def test_validation_end_hooks_see_an_eval_mode_model_without_gradients(tmp_path: Path, monkeypatch) -> None:
    """As under Lightning's validation loop: eval mode, no autograd, no gradients held, the
    schedule-free optimizer's evaluation weights in the model."""
    seen = []

    class Look(L.Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            grads = [p.grad for p in pl_module.parameters()]
            seen.append(
                (
                    pl_module.training,
                    torch.is_grad_enabled(),
                    all(g is None for g in grads),
                    trainer.optimizers[0].param_groups[0]["train_mode"],
                )
            )

    monkeypatch.setattr(mdl.run.experiment, "make_preconditioner", lambda cfg, dm, make_model: ([Look()], None))
    for group in (1, 4):
        seen.clear()
        run_experiment(
            compose_config([*SEQUENTIAL, f"mdl.steps_per_group={group}"], tmp_path / str(group)),
            tmp_path / str(group) / "run",
        )
        assert seen and set(seen) == {(False, False, True, False)}


def test_in_place_early_stopping_follows_lightnings_rule() -> None:
    """EpochProtocol stops where Lightning's EarlyStopping would on the same validation losses (float32
    comparisons: a float64 improvement below float32 resolution is none) and keeps the best epoch's weights."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import EarlyStopping

    from mdl.engine.single_fit import EpochProtocol

    class Scripted(torch.nn.Module):
        def __init__(self, losses: list[float]) -> None:
            super().__init__()
            self.weight, self.losses, self.val_loss_curve = torch.nn.Parameter(torch.zeros(1)), iter(losses), []

        def validate(self, batches, as_trained: bool = False) -> float:
            self.val_loss_curve.append(next(self.losses))
            self.weight.data.fill_(len(self.val_loss_curve) - 1)  # the weights "of" each epoch
            return self.val_loss_curve[-1]

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        losses = (1 + torch.randn(40, generator=gen, dtype=torch.float64).cumsum(0) * 0.01).tolist()
        losses[4] = min(losses[:4]) - 0.01  # the best so far
        losses[5] = losses[4] - 1e-12  # better in float64, equal in float32: no improvement
        patience = 1 + trial % 4
        ours, lightning = EpochProtocol(lambda: [], patience, "cpu"), EarlyStopping("val_loss", patience=patience)
        module, trainer = Scripted(losses), SimpleNamespace(should_stop=False)
        expected_stop = next(
            e
            for e in range(40)
            if lightning._evaluate_stopping_criteria(torch.tensor(losses[e], dtype=torch.float32))[0]
        )
        for epoch in range(expected_stop + 1):
            assert not trainer.should_stop
            ours.on_train_epoch_end(trainer, module)
        assert trainer.should_stop and ours.best_epoch == min(
            range(expected_stop + 1), key=lambda e: (float(torch.tensor(losses[e], dtype=torch.float32)), e)
        )
        ours.restore(module)
        assert module.weight.item() == ours.best_epoch
