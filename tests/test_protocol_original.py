"""protocol=original: the original code's training loop, checked against a transcription of it.

``original_loop`` transcribes the epoch loop of EleutherAI/mdl mdl/probe.py@5e66bb9:101-155 (Probe.fit) line by
line, with this project's validation sum in place of ``Probe.evaluate`` (the same numbers in nats, summed per
batch) and no augmentation or eraser (identities there). The project's fit of one member (a stack of one) under
``LoopRules`` of protocol=original must leave the same weights, optimizer state and schedule-free step count.
"""

from __future__ import annotations

import math
from copy import deepcopy
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
from schedulefree import AdamWScheduleFree
from torch import nn

from datamodules.stacked_batches import StackedBatches, TrainSource
from mdl.engine.protocol import LoopRules
from mdl.engine.stacked_fit import StackedProtocol
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

ORIGINAL = LoopRules(backtrack=True, evaluate_as_trained=True)
LR, BATCH, PATIENCE, MAX_EPOCHS = 0.3, 16, 3, 200
make_optimizer = partial(AdamWScheduleFree, betas=(0.95, 0.999), warmup_steps=5)


def toy_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Noisy labels and a large learning rate: validation goes up and down, so the loop backtracks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] + 0.8 * torch.randn(96, generator=g) > 0).long() + (x[:, 1] > 0.5).long()
    return x[:64], y[:64], x[64:], y[64:]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def val_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The project's validation number (``StackedClassifier.loss_sums``): float32 sums per batch, added in float64."""
    total = None
    with torch.no_grad():
        for xb, yb in zip(x.split(BATCH), y.split(BATCH)):
            s = F.cross_entropy(model(xb), yb, reduction="none").sum().double()
            total = s if total is None else total + s
    return float(total) / len(x)


def original_loop(model: nn.Module, x, y, x_val, y_val) -> tuple[list[float], torch.optim.Optimizer, dict]:
    """mdl/probe.py@5e66bb9 Probe.fit's loop, transcribed (its line numbers in the comments)."""
    opt = make_optimizer([{"params": list(model.parameters()), "lr": LR}])  # 101
    best_loss = torch.inf  # 105
    best_opt_state = opt.state_dict()  # 106
    best_state = model.state_dict()  # 107
    num_plateaus = 0  # 108
    model.eval()  # 110
    opt.eval()  # 113-114
    curve = []
    for i in range(MAX_EPOCHS):  # 120
        val_loss = val_mean(model, x_val, y_val)  # 121
        curve.append(val_loss)
        if val_loss < best_loss:  # 124
            best_loss = val_loss
            best_opt_state = deepcopy(opt.state_dict())
            best_state = deepcopy(model.state_dict())
            num_plateaus = 0
        else:  # 129
            num_plateaus += 1
            if num_plateaus >= PATIENCE:  # 133
                break
            opt.load_state_dict(best_opt_state)  # 137
            model.load_state_dict(best_state)  # 138
        model.train()  # 144
        opt.train()  # 145-146
        for x_batch, y_batch in zip(x.split(BATCH), y.split(BATCH)):  # 149
            opt.zero_grad()  # 150
            loss = F.cross_entropy(model(x_batch), y_batch)  # 152-153 (no augment, identity transform)
            loss.backward()  # 155
            opt.step()
    stopped = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)  # after the loop: the lowest validation loss
    return curve, opt, stopped


def one_member(model: nn.Module) -> StackedClassifier:
    return StackedClassifier(StackedModel([model]), make_optimizer, LR)


def project_fit(rules: LoopRules, x, y, x_val, y_val) -> tuple[list[float], dict, dict, dict]:
    """The protocol (``StackedProtocol``) on a stack of one of the same model, the same batches in order: its
    validation curve, and when the member stopped, its weights, its best weights and the optimizer's state."""
    module = one_member(tiny_model())
    val = list(zip(x_val.split(BATCH), y_val.split(BATCH)))
    loader = StackedBatches([TrainSource(x, y)], [len(y)], BATCH, reshuffle=False)
    seen: dict = {}

    class Stopped(StackedProtocol):  # the member's state when it stops, before it leaves the stack
        def _finish(self, module, stopping) -> None:
            seen["stopped"] = {n: t.detach()[0].clone() for n, t in module.stack.param_dict().items()}
            seen["best"] = {n: t.clone() for n, t in self.best[0].items()}
            seen["optimizer"] = deepcopy(module.trainer.optimizers[0].state_dict())
            super()._finish(module, stopping)

    protocol = Stopped(
        loader, lambda m: val, lambda m: val, PATIENCE, MAX_EPOCHS, LR, untrained_candidate=True, rules=rules
    )
    trainer = L.Trainer(
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[protocol],
    )
    trainer.fit(module, train_dataloaders=loader)
    state = protocol.members[0]
    return [state.initial_val_loss, *state.val_loss_curve], seen["stopped"], seen["best"], seen["optimizer"]


def test_backtracking_matches_the_original_loop() -> None:
    """Same validation curve, same weights where it stopped and after restoring the best, same optimizer state
    (schedule-free's z and second moments, drifted as the original's aliased snapshot drifted) and step count."""
    x, y, x_val, y_val = toy_data()
    original = tiny_model()
    curve, opt, stopped = original_loop(original, x, y, x_val, y_val)
    ours, our_stopped, our_best, our_opt = project_fit(ORIGINAL, x, y, x_val, y_val)
    assert len(curve) < MAX_EPOCHS  # stopped by patience
    best = [min(curve[: i + 1]) for i in range(len(curve))]
    assert sum(c > b for c, b in zip(curve[1:], best)) >= PATIENCE  # it backtracked, twice in a row at least
    assert ours == curve
    for name, tensor in stopped.items():
        assert torch.equal(our_stopped[name], tensor), name
    for name, tensor in original.state_dict().items():
        assert torch.equal(our_best[name], tensor), name
    assert our_opt["param_groups"][0]["k"] == opt.param_groups[0]["k"]
    assert our_opt["param_groups"][0]["weight_sum"] == opt.param_groups[0]["weight_sum"]
    for i, q in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key in ("z", "exp_avg_sq"):
            assert torch.equal(our_opt["state"][i][key][0], opt.state[q][key]), key


def test_sound_loop_does_not_backtrack() -> None:
    """The default loop runs on from where it is: its curve leaves the original's at the first backtrack."""
    x, y, x_val, y_val = toy_data()
    curve, _, _ = original_loop(tiny_model(), x, y, x_val, y_val)
    ours, *_ = project_fit(LoopRules(), x, y, x_val, y_val)
    assert ours != curve


def test_scoring_in_train_mode() -> None:
    """protocol=original scores a stack of one in train mode (dropout, drop-path active: ``as_trained``), though under
    no_grad; otherwise in eval mode, as a lone model is scored."""
    torch.manual_seed(0)
    module = one_member(nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))).train()
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    weights = module.eval_weights([0])
    eval_bits = module.loss_sums(weights, [(x, y)])[0]
    module.stack.as_trained = True
    train_bits = module.loss_sums(weights, [(x, y)])[0]
    module.stack.as_trained = False
    assert not torch.equal(train_bits, eval_bits) and module.training
    assert torch.equal(module.loss_sums(weights, [(x, y)])[0], eval_bits)


def test_protocol_groups_name_their_loops() -> None:
    """conf/protocol: sound is every default of ``LoopRules``; original switches on every rule of the original's loop."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        assert LoopRules.of(compose("config").protocol) == LoopRules()
        original = compose("config", overrides=["protocol=original"])
        assert LoopRules.of(original.protocol) == LoopRules(
            backtrack=True,
            evaluate_as_trained=True,
            reshuffle=False,
            augment_per_batch=True,
            exact_stopping=True,
            batch_mean_validation=True,
            redraw_per_block=True,
        )
        from mdl.run.pack import pack_key

        assert pack_key(original) is None  # a packed sweep trains it alone (one member per fit)
        assert pack_key(compose("config")) is not None


def test_backtracking_runs_train_one_member_per_fit() -> None:
    """A stack shares one schedule-free step count, so a backtracking protocol fits its members one at a time."""
    from mdl.engine.memory import one_per_fit_if_backtracking

    assert one_per_fit_if_backtracking(None, ORIGINAL) == 1 and one_per_fit_if_backtracking(4, ORIGINAL) == 1
    assert one_per_fit_if_backtracking(None, LoopRules()) is None and one_per_fit_if_backtracking(4, LoopRules()) == 4


def test_the_original_stops_on_the_float64_loss_not_its_float32_rounding() -> None:
    """An epoch that improves the mean validation loss by less than a float32 step: Lightning's EarlyStopping (and
    protocol=sound) sees no improvement, the original's Python-float comparison (mdl/probe.py@5e66bb9:124) does.
    On LEACE'd digits the first epochs improve by 0.2-1.8 such steps, so this decided whether a fit left the
    untrained model (issue 45 item 3)."""
    import numpy as np

    from mdl.engine.protocol import MemberState

    first = 2.302585092994046  # log 10: an untrained 10-class model's loss
    tiny = float(np.spacing(np.float32(first))) / 4  # a quarter of a float32 step there
    for exact, improves in ((False, False), (True, True)):
        state = MemberState(member=0, n_train=10)
        assert state.judge(first, -1, exact=exact)
        assert state.judge(first - tiny, 0, exact=exact) is improves
        assert state.best_epoch == (0 if improves else -1)
    from conftest import compose_config

    assert LoopRules.of(compose_config(["protocol=original"]).protocol).exact_stopping
    assert not LoopRules.of(compose_config([]).protocol).exact_stopping


def original_evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """mdl/probe.py@5e66bb9 ``Probe.evaluate`` (:202-208) with ``loss_fn`` (:210-216), transcribed: the mean loss in
    bits, each batch's float32 mean times its size, added as Python floats."""
    total_loss = sum(
        (F.cross_entropy(model(x_batch), y_batch.long()) / math.log(2)).item() * len(x_batch)
        for x_batch, y_batch in zip(x.split(batch_size), y.split(batch_size))
    )
    return total_loss / len(x)


def near_uniform_pair(seed: int) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """An untrained 10-class model (zero readout: log 10 for every example) and one a first warm-up epoch away
    (weights of 1e-7), on 300 validation examples: their losses differ by about a float32 step."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(300, 8, generator=g), torch.randint(0, 10, (300,), generator=g)
    untrained, trained = nn.Linear(8, 10), nn.Linear(8, 10)
    for model in (untrained, trained):
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
    with torch.no_grad():
        trained.weight.copy_(1e-7 * torch.randn(10, 8, generator=g))
    return untrained, trained, x, y


@torch.no_grad()
def test_the_original_adds_up_validation_per_batch_in_bits() -> None:
    """protocol.batch_mean_validation: the mean validation loss is the original's (its bits times log 2, to the bit),
    and so is the verdict on an epoch a float32 step from the untrained model; the one float32 sum per
    data.eval_batch_size batch (protocol=sound) decides some of those the other way (issue 45)."""
    from mdl.engine.protocol import MemberState

    flipped = 0
    for seed in range(20):
        untrained, trained, x, y = near_uniform_pair(seed)
        verdicts = {}
        for original in (False, True):
            state = MemberState(member=0, n_train=10)
            for epoch, model in ((-1, untrained), (0, trained)):
                module = one_member(model)
                batches = list(zip(x.split(128), y.split(128))) if original else [(x, y)]
                sums, count = module.loss_sums(module.eval_weights([0]), batches, float64=False, batch_means=original)
                mean = float(module.validation_means(sums, count, original)[0])
                if original:
                    assert mean == original_evaluate(model, x, y, 128) * math.log(2)
                verdicts[original] = state.judge(mean, epoch, exact=True)
        theirs = original_evaluate(trained, x, y, 128) < original_evaluate(untrained, x, y, 128)
        assert verdicts[True] == theirs
        flipped += verdicts[False] != theirs
    assert flipped > 0
    from conftest import compose_config

    assert LoopRules.of(compose_config(["protocol=original"]).protocol).batch_mean_validation
    assert not LoopRules.of(compose_config([]).protocol).batch_mean_validation
