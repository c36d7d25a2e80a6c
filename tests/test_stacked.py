"""The stacked engine against the sequential one: same starts, same batches, same protocol,
results within the seed-to-seed spread, and an exact resume of the stacked state."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import lightning as L
import pytest
import schedulefree
import torch
from mup import MuReadout

from conftest import FITS, FAST, RecordOps, compose_config, host_reads, assert_members_equal_singles
from datamodules.augment import Augmentation
from datamodules.loader import EvalBatches
from datamodules.stacked_batches import Pacing, StackedBatch, StackedBatches, TrainSource
from mdl.run.components import make_model_factory
from mdl.run.experiment import run_experiment
from mdl.engine.stacked_fit import StackedProtocol
from mdl.engine.protocol import member_seeds
from mdl.engine.stacked_fit import build_members
from mdl.engine.trainer_settings import refuse_for_stacked
from models import create_model, mup_param_groups
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel
from test_resume import EXACT, assert_resumes_exactly, run_killed_after


def crop_flip(augment: bool) -> Augmentation | None:
    """The default crop and flip, or none."""
    return Augmentation() if augment else None


STACKED = [*FAST, "mdl.members_per_fit=all", "mdl.checkpoint_every_s=0", "mdl.min_steps_per_pass=1"]


def test_each_member_starts_from_the_model_built_under_its_seed() -> None:
    cfg = compose_config(["model=lenet", "width=16", "model.base_width=8"])
    make_model = make_model_factory(cfg, 10, (1, 8, 8))
    seeds = member_seeds(seed=3, num_boundaries=4)
    assert seeds == [3000, 3001, 3002, 3004]  # blocks 0..2, then the final fit (prequential.py's seeds)
    stack = build_members(make_model, seeds, torch.device("cpu"))
    for row, s in enumerate(seeds):
        L.seed_everything(s, verbose=False)
        alone = make_model()
        member = {n: p.detach()[row] for n, p in stack.param_dict().items()}
        member |= {n: b[row] for n, b in stack.buffer_dict().items()}
        for name, tensor in alone.state_dict().items():
            assert torch.equal(member[name], tensor), (s, name)


@pytest.mark.parametrize(
    ("augment", "min_steps_per_pass", "pass_steps"), [(False, 1, 10), (True, 1, 10), (True, 25, 30)]
)
def test_each_member_sees_the_batches_it_sees_alone(augment: bool, min_steps_per_pass: int, pass_steps: int) -> None:
    """Step by step, in groups of up to 4 steps, each ending at the latest at a member's epoch end: a member's
    batches are those of a stack of one on its prefix, whatever a pass (Lightning's epoch) holds: whole epochs of
    the longest member (10 steps), at least ``min_steps_per_pass``."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(300, 3, 8, 8, generator=gen), torch.randint(0, 10, (300,), generator=gen)
    prefixes, batch = [50, 130, 300], 32
    stacked = StackedBatches(
        [TrainSource(x, y)], prefixes, batch, seeds=7, augment=crop_flip(augment), pacing=Pacing(4, min_steps_per_pass)
    )
    assert len(stacked) == stacked.steps_per_pass == pass_steps
    steps_per_epoch = [math.ceil(n / batch) for n in prefixes]
    expected = {}
    for m, n in enumerate(prefixes):
        alone = StackedBatches([TrainSource(x[:n], y[:n])], [n], batch, seeds=7, augment=crop_flip(augment))
        expected[m] = []
        for _ in range(3 * alone.steps_per_pass):
            group = alone.next()
            keep = group.weight[0, 0] > 0
            expected[m].append((group.x[0, 0][keep], group.y[0, 0][keep]))
    seen: dict[int, list] = {m: [] for m in range(3)}
    sizes = set()
    while stacked.active:
        full = stacked.active == [0, 1, 2]
        steps = 0
        for group in stacked:
            sizes.add(group.steps)
            steps += group.steps
            for i in range(group.steps):
                for row, m in enumerate(group.members):
                    keep = group.weight[i, row] > 0
                    seen[m].append((group.x[i, row][keep], group.y[i, row][keep]))
                    epoch_ends = len(seen[m]) % steps_per_epoch[m] == 0
                    assert not epoch_ends or i == group.steps - 1, "a group ran past a member's epoch end"
            for m in group.members:  # a member leaves after its 3 epochs, as a stopping member does
                if len(seen[m]) == len(expected[m]):
                    stacked.remove(m)
        assert steps == pass_steps or not (full and stacked.active == [0, 1, 2]), "a pass of all members fell short"
    assert sizes == {1, 2, 4}  # capped at 4, cut short at epoch ends (the first member's epoch is 2 steps)
    for m in range(3):
        for (xs, ys), (xe, ye) in zip(seen[m], expected[m]):
            assert torch.equal(ys, ye) and torch.equal(xs, xe)


def test_a_pass_ends_early_only_at_the_longest_members_epoch_ends() -> None:
    """A SIGTERM's checkpoint waits for one epoch of the longest member, not a whole pass: ``end_pass_early`` is
    asked at each of its epoch ends (10 steps of a 30-step pass) and ends the pass there when it says so."""
    x, y = torch.rand(300, 4), torch.randint(0, 10, (300,))
    loader = StackedBatches([TrainSource(x, y)], [50, 130, 300], 32, pacing=Pacing(4, 25))
    taken: list[int] = []
    asked: list[int] = []
    loader.end_pass_early = lambda: asked.append(sum(taken)) or len(asked) == 2  # noqa: E731
    for group in loader:
        taken.append(group.steps)
    assert loader.steps_per_pass == 30 and asked == [10, 20] and sum(taken) == 20
    assert sum(group.steps for group in loader) == 30  # the next pass is whole when nothing asks
    assert loader.streams[2].step == 0  # the longest member stands at an epoch start after each pass


def _stacked_and_single(lr: float = 3e-2) -> tuple[StackedClassifier, list[StackedClassifier]]:
    """Three muP MLPs, as one stack and as three stacks of one (each its own copy of the weights)."""
    opt = lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=2)  # noqa: E731

    def models() -> list[torch.nn.Module]:
        made = []
        for s in range(3):
            torch.manual_seed(s)
            made.append(create_model("mlp", 32, 2, 10, (1, 8, 8), base_width=8))
        return made

    stack = StackedClassifier(StackedModel(models()), opt, lr)
    return stack, [StackedClassifier(StackedModel([m]), opt, lr) for m in models()]


@pytest.fixture
def float64():
    """In float32, Adam's normalisation magnifies rounding noise in near-zero gradients to ~1e-5;
    in float64 the comparison can be sharp."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_stacked_steps_equal_independent_optimizers_per_member(float64) -> None:
    """One optimizer over the stack = M optimizers (schedule-free, warm-up, muP lr groups)."""
    stack, singles = _stacked_and_single()
    opt_stack = stack.configure_optimizers()
    opts = [s.configure_optimizers() for s in singles]
    for o in (opt_stack, *opts):
        o.train()
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.rand(3, 16, 1, 8, 8, generator=gen), torch.randint(0, 10, (3, 16), generator=gen)
        w = torch.ones(3, 16)
        w[1, 10:] = 0  # member 1's batch is short: padding must not count
        stack.train_group(StackedBatch(x[None], y[None], w[None], [0, 1, 2]), opt_stack)
        for m, (single, o) in enumerate(zip(singles, opts)):
            keep = w[m] > 0
            single.step_loss(x[m][keep][None], y[m][keep][None], w[m][keep][None]).backward()
            o.step()
            o.zero_grad()
    assert_members_equal_singles(stack, singles)


def test_training_step_reads_nothing_back_to_the_host() -> None:
    """A group of steps, optimizer steps included (schedule-free, past its warm-up)."""
    stack, _ = _stacked_and_single()
    optimizer = stack.configure_optimizers()
    optimizer.train()
    group = StackedBatch(
        torch.rand(4, 3, 16, 1, 8, 8), torch.randint(0, 10, (4, 3, 16)), torch.ones(4, 3, 16), [0, 1, 2]
    )
    with RecordOps() as record:
        stack.train_group(group, optimizer)
    assert not host_reads(record), host_reads(record)


@pytest.mark.parametrize("name", ["mlp", "lenet"])  # the MLP's own batched form; torch.func's vmap
def test_a_stacked_step_launches_as_many_kernels_for_seven_members_as_for_two(name: str) -> None:
    """The stacked engine's point on a GPU, where a small model's step is bound by kernel launches:
    each layer, loss and optimizer update runs once for all members, not once per member."""
    kernels = {}
    for members in (2, 7):
        models = [create_model(name, 16, 2, 10, (3, 8, 8), base_width=8) for _ in range(members)]
        stack = StackedClassifier(
            StackedModel(models), lambda g: schedulefree.AdamWScheduleFree(g, warmup_steps=2), 1e-2
        )
        optimizer = stack.configure_optimizers()
        optimizer.train()
        group = StackedBatch(
            torch.rand(2, members, 16, 3, 8, 8),
            torch.randint(0, 10, (2, members, 16)),
            torch.ones(2, members, 16),
            list(range(members)),
        )
        stack.train_group(group, optimizer)  # the first step creates the optimizer's state
        with RecordOps() as record:
            stack.train_group(group, optimizer)
        kernels[members] = record.kernels
    assert kernels[2] and kernels[7] == kernels[2]


@pytest.mark.parametrize("augment", [False, True])
def test_a_stacked_group_of_batches_launches_as_many_kernels_for_seven_members_as_for_two(augment: bool) -> None:
    """Gathering, cropping and flipping a group of steps: one kernel per operation for the whole
    group; each member's shuffle and draws are per epoch, its batch a view of them."""
    x, y = torch.rand(640, 3, 8, 8), torch.randint(0, 10, (640,))
    kernels = {}
    for members in (2, 7):
        batches = StackedBatches(
            [TrainSource(x, y)], [640] * members, 32, seeds=0, augment=crop_flip(augment), pacing=Pacing(4)
        )
        groups = iter(batches)
        next(groups)  # past the epoch's start (its shuffle and draws)
        with RecordOps() as record:
            group = next(groups)
        assert group.steps == 4
        kernels[members] = record.kernels
    assert kernels[2] and kernels[7] == kernels[2]


def test_stacked_batches_resume_mid_epoch_with_the_same_crops_and_flips() -> None:
    x, y = torch.rand(300, 3, 8, 8), torch.randint(0, 10, (300,))

    def make() -> StackedBatches:
        return StackedBatches([TrainSource(x, y)], [70, 300], 32, seeds=5, augment=Augmentation(), pacing=Pacing(3))

    uninterrupted, resumed = make(), make()
    for _ in range(4):
        uninterrupted.next()
    resumed.load_state_dict(uninterrupted.state_dict())  # member 0 is in its 2nd epoch, member 1 in its 1st
    for _ in range(6):
        a, b = uninterrupted.next(), resumed.next()
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("augment", [False, True])
def test_members_with_their_own_training_sets_draw_what_they_draw_alone(augment: bool) -> None:
    """Packed runs with other erasers or data seeds: each member's batches (gathered, augmented, erased with its
    own source's eraser) are those of a stack holding its source alone."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.rand(200, 3, 8, 8, generator=gen) for _ in range(3)]
    ys = [torch.randint(0, 10, (200,), generator=gen) for _ in range(3)]
    shifts = [None, lambda x, y: x + y[:, None, None, None], lambda x, y: 2 * x]  # each source's batch eraser
    prefixes, seeds, sources = [40, 200, 120, 200, 77], [3, 3, 4, 5, 6], [0, 0, 1, 2, 1]
    own = [TrainSource(xs[i], ys[i], shifts[i]) for i in range(3)]
    mixed = StackedBatches(
        own, prefixes, 16, augment=crop_flip(augment), pacing=Pacing(3), seeds=seeds, source_of=sources
    )
    alone = {
        m: StackedBatches(
            [own[sources[m]]], [prefixes[m]], 16, seeds=seeds[m], augment=crop_flip(augment), pacing=Pacing(3)
        )
        for m in range(5)
    }
    for _ in range(8):
        group = mixed.next(2)
        for row, m in enumerate(group.members):
            own = alone[m].next(2)
            assert torch.equal(group.x[:, row], own.x[:, 0]) and torch.equal(group.y[:, row], own.y[:, 0])
            assert torch.equal(group.weight[:, row], own.weight[:, 0])
    with pytest.raises(ValueError, match="cannot share a stack"):
        StackedBatches([TrainSource(xs[0], ys[0]), TrainSource(xs[1][:, :1], ys[1])], [10], 16, source_of=[1])


def test_a_member_that_stops_early_is_scored_with_its_best_epochs_weights(tmp_path: Path, monkeypatch) -> None:
    scored: dict[int, dict] = {}
    original = StackedProtocol._finish

    def remember(self, module, stopping):
        for m in stopping:
            scored[m] = {"best": {k: v.clone() for k, v in self.best[m].items()}, "epoch": self.members[m].best_epoch}
        original(self, module, stopping)

    monkeypatch.setattr(StackedProtocol, "_finish", remember)
    cfg = compose_config([*STACKED, "trainer.kwargs.max_epochs=40", "trainer.patience=3"], tmp_path)
    results = run_experiment(cfg, tmp_path / "run")
    blocks = results["blocks"]
    stopped_early = [i for i, b in enumerate(blocks) if b["epochs"] < 40]
    assert stopped_early, "no member stopped early; lower the patience"
    for i in stopped_early:
        curve, kept = (
            blocks[i]["val_loss_curve"],
            scored[i]["epoch"],
        )  # kept -1: the untrained model (paper_loss=last_block)
        assert kept == blocks[i]["best_after_epochs"] - 1
        assert len(curve) == kept + 1 + 3  # patience epochs after the best
        if kept >= 0:
            assert kept == min(range(len(curve)), key=curve.__getitem__)
            assert blocks[i]["val_bits_per_example"] == curve[kept] / math.log(2)
        else:
            assert blocks[i]["val_bits_per_example"] * math.log(2) <= min(curve)
    # the scored weights give the best epoch's validation loss again
    from mdl.run.components import make_datamodule

    dm = make_datamodule(cfg)  # the run's own data module, set up
    model = make_model_factory(cfg, dm.num_classes, dm.input_shape)()
    for i in stopped_early:
        model.load_state_dict(scored[i]["best"])
        with torch.no_grad():
            nats = sum(
                torch.nn.functional.cross_entropy(model(x).double(), y, reduction="sum") for x, y in dm.val_dataloader()
            )
        assert float(nats) / 300 == pytest.approx(blocks[i]["val_bits_per_example"] * math.log(2), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("epochs_per_pass", [1, 3])
def test_stacked_run_resumes_bit_for_bit_at_every_kill_point(epochs_per_pass: int, tmp_path: Path, monkeypatch) -> None:
    """A checkpoint at the end of each pass (Lightning's epoch): one epoch of the longest member (the full training
    set, 10 steps of 128), or three (mdl.min_steps_per_pass=25), where the shorter members are mid-epoch."""
    settings = [*STACKED, "trainer.kwargs.max_epochs=12", "trainer.patience=3"]
    settings += [f"mdl.min_steps_per_pass={1 if epochs_per_pass == 1 else 25}"]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    assert reference["n_train"] == 1197 and compose_config(settings).data.batch_size == 128  # 10 steps an epoch
    passes = math.ceil(reference["final_epochs"] / epochs_per_pass)  # the final fit's member trains longest
    assert_resumes_exactly(settings, reference, range(1, passes + 1), tmp_path, monkeypatch)


@pytest.mark.slow
def test_engines_agree_within_the_seed_to_seed_spread(tmp_path: Path) -> None:
    """Digits, the default run, 5 seeds: the engines differ by less than the seeds do."""
    runs = {
        e: [
            run_experiment(compose_config([FITS[e], f"seed={s}"], tmp_path / e), tmp_path / f"{e}{s}") for s in range(5)
        ]
        for e in ("sequential", "stacked")
    }
    for key in ("paper_mdl", "online_bits_per_example"):
        seq, stk = ([r[key] for r in runs[e]] for e in ("sequential", "stacked"))
        spread = statistics.stdev(seq)
        gap = abs(statistics.mean(seq) - statistics.mean(stk))
        print(
            f"{key}: sequential {statistics.mean(seq):.4f} ± {spread:.4f}, stacked {statistics.mean(stk):.4f} "
            f"± {statistics.stdev(stk):.4f}, gap {gap:.4f} = {gap / spread:.2f} seed sd"
        )
        assert gap < spread
    for i in range(len(runs["sequential"][0]["blocks"])):
        seq = [r["blocks"][i]["eval_bits"] / r["blocks"][i]["n_eval"] for r in runs["sequential"]]
        stk = [r["blocks"][i]["eval_bits"] / r["blocks"][i]["n_eval"] for r in runs["stacked"]]
        # a block whose fits never beat the untrained model scores log2 K in both engines (up to summation order)
        assert abs(statistics.mean(seq) - statistics.mean(stk)) <= max(
            statistics.stdev(seq), statistics.stdev(stk), 1e-12
        ), i


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("mlp", {}),
        ("mlp", {"activation": "gelu"}),
        ("mlp", {"activation": "swiglu"}),
        ("lenet", {}),
        ("convnext", {}),
        ("swin", {}),
    ],
)
def test_every_registered_model_stacks(name: str, options: dict) -> None:
    """vmap over functional_call (or the model's batched form) gives each member's own output."""
    models = []
    for s in range(3):
        torch.manual_seed(s)
        models.append(create_model(name, 32, 2 if name == "mlp" else 1, 10, (3, 16, 16), base_width=16, **options))
        readout = next(m for m in models[-1].modules() if isinstance(m, MuReadout))
        with torch.no_grad():
            readout.weight.normal_()  # the muP readout starts at zero: make outputs differ
    x = torch.rand(3, 4, 3, 16, 16)
    stack = StackedModel(models)
    stacked = stack(x)
    shared = stack.run(stack.param_dict(), stack.buffer_dict(), x[0], shared_input=True)
    for m, model in enumerate(models):
        assert torch.allclose(stacked[m], model(x[m]), atol=1e-5), m
        assert torch.allclose(shared[m], model(x[0]), atol=1e-5), m


def test_gradient_clipping_is_refused_by_the_stacked_engine(tmp_path: Path) -> None:
    cfg = compose_config([*STACKED, "+trainer.kwargs.gradient_clip_val=1.0"], tmp_path)
    with pytest.raises(ValueError, match="cannot clip each member"):
        run_experiment(cfg, tmp_path / "run")


def test_damaged_stacked_checkpoint_is_discarded_and_the_fit_redone(tmp_path: Path, monkeypatch, caplog) -> None:
    import logging

    settings = [*STACKED, "trainer.kwargs.max_epochs=6"]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    cfg = compose_config(settings, tmp_path / "kill")
    assert run_killed_after(cfg, tmp_path / "kill" / "a", 2, monkeypatch)
    (ckpt,) = (tmp_path / "kill" / "store").glob("*/checkpoints/stacked.ckpt")
    blob = bytearray(ckpt.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING):
        resumed = run_experiment(cfg, tmp_path / "kill" / "b")
    assert "discarding damaged checkpoint" in caplog.text
    for key in EXACT:
        assert resumed[key] == reference[key], key


def test_a_diverging_member_stops_the_run_with_the_learning_rate_in_the_message(tmp_path: Path) -> None:
    cfg = compose_config([*STACKED, "optimizer.lr=1e30"], tmp_path)
    with pytest.raises(FloatingPointError, match=r"training diverged: member \d+ .*optimizer.lr="):
        run_experiment(cfg, tmp_path / "run")


def test_run_identity_is_the_engine_and_cpu_threads_not_how_often_it_checkpoints_or_how_it_groups_steps() -> None:
    from mdl.run.identity import DEFAULT_THREADS, config_hash

    base = config_hash(compose_config(FAST))
    assert base == config_hash(
        compose_config([*FAST, "mdl.checkpoint_every_s=0", "mdl.min_steps_per_pass=1", "mdl.steps_per_group=1"])
    )
    # on a CPU the thread count changes the numbers' last bits: it is part of the identity, as resolved
    assert base == config_hash(
        compose_config([*FAST, f"trainer.torch_threads={DEFAULT_THREADS}"])
    )  # stacked: null = torch's
    assert config_hash(compose_config([*FAST, "trainer.torch_threads=1"])) != config_hash(
        compose_config([*FAST, "trainer.torch_threads=3"])
    )
    assert base == config_hash(compose_config([*FAST, "data.balance=null", "data.transform=null"]))
    assert base != config_hash(compose_config([*FAST, "mdl.members_per_fit=1"]))
    assert base != config_hash(compose_config([*FAST, "data.balance=suby"]))


def test_patience_zero_stops_at_the_first_epoch_without_improvement_as_lightning_does(tmp_path: Path) -> None:
    results = {
        e: run_experiment(
            compose_config([*FAST, FITS[e], "trainer.patience=0", "trainer.kwargs.max_epochs=30"], tmp_path / e),
            tmp_path / e / "run",
        )
        for e in ("sequential", "stacked")
    }
    for e, r in results.items():
        for block in r["blocks"]:
            curve = block["val_loss_curve"]
            assert all(b < a for a, b in zip(curve[:-2], curve[1:-1])), e  # improving epochs never stop a fit
            if len(curve) == 1:  # the first epoch did not beat the untrained model (paper_loss=last_block)
                assert block["best_after_epochs"] == 0, e
            else:
                assert len(curve) == 30 or curve[-1] >= min(curve[:-1]), e


def test_muP_learning_rates_equal_muPs_own_groups_to_the_bit() -> None:
    model = create_model("mlp", 160, 2, 10, (1, 8, 8), base_width=128)  # width_mult 1.25: lr / 1.25 != lr * 0.8
    sequential = sorted(g["lr"] for g in mup_param_groups(model, 1.7e-3))
    stacked = sorted(g["lr"] for g in StackedModel([model]).param_groups(1.7e-3))
    assert sequential == stacked


def test_trainer_settings_that_change_the_protocol_are_refused_before_the_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="accumulate_grad_batches=2: .*follow the prequential protocol"):
        run_experiment(
            compose_config([*STACKED, "+trainer.kwargs.accumulate_grad_batches=2"], tmp_path), tmp_path / "run"
        )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"accumulate_grad_batches": 2}, "follow the prequential protocol"),
        ({"fast_dev_run": True}, "follow the prequential protocol"),
        ({"overfit_batches": 3}, "follow the prequential protocol"),
        ({"min_epochs": 5}, "follow the prequential protocol"),
        ({"limit_train_batches": 1}, "follow the prequential protocol"),  # an int: one batch
        ({"gradient_clip_val": 0.5}, "cannot clip each member"),
        ({"limit_val_batches": 0.5}, "validates every model"),
        ({"val_check_interval": 10}, "validates every model"),
        ({"max_steps": 5}, "use max_epochs"),
        ({"min_steps": 5}, "use max_epochs"),
        ({"max_time": "00:01:00:00"}, "use max_epochs"),
        ({"max_steps": None}, "use max_epochs"),
        ({"accumulate_grad_batches": None}, "follow the prequential protocol"),  # None is not their default
    ],
)
def test_the_stacked_engine_refuses_every_setting_of_lightnings_steps_validation_and_stopping(
    kwargs: dict, reason: str
) -> None:
    """The protocol owns all of them, whatever the number of members per fit."""
    with pytest.raises(ValueError, match=f"trainer.kwargs.{next(iter(kwargs))}=.*{reason}"):
        refuse_for_stacked(kwargs)


def test_the_stacked_engine_accepts_the_neutral_values_of_those_settings() -> None:
    refuse_for_stacked(
        {
            "accumulate_grad_batches": 1,
            "fast_dev_run": False,
            "overfit_batches": 0.0,
            "min_epochs": 0,
            "limit_train_batches": 1.0,
            "gradient_clip_val": None,
            "limit_val_batches": 1.0,
            "check_val_every_n_epoch": 1,
            "max_steps": -1,
            "min_steps": None,
            "max_epochs": 40,
        }
    )


def test_a_stacked_checkpoint_made_by_other_code_is_not_resumed(tmp_path: Path, monkeypatch, caplog) -> None:
    import logging

    from mdl.results import read_checked_json, write_checked_json

    settings = [*STACKED, "trainer.kwargs.max_epochs=6"]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    cfg = compose_config(settings, tmp_path / "kill")
    assert run_killed_after(cfg, tmp_path / "kill" / "a", 1, monkeypatch)  # before any member finished
    (progress,) = (tmp_path / "kill" / "store").glob("*/progress.json")
    write_checked_json(progress, {**read_checked_json(progress), "code_version": "older"})
    with caplog.at_level(logging.INFO):
        resumed = run_experiment(cfg, tmp_path / "kill" / "b")
    assert "discarding the earlier progress" in caplog.text and "resuming fit" not in caplog.text
    for key in EXACT:
        assert resumed[key] == reference[key], key


def test_callbacks_see_every_optimizer_step_of_a_group(tmp_path: Path, monkeypatch) -> None:
    """Steps run in groups inside one Lightning step; a callback's per-step hooks still run once per
    optimizer step: max over members of epochs x steps per epoch (they all start at step 0)."""
    import mdl.run.experiment

    calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}

    class CountSteps(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss) -> None:
            assert loss.requires_grad
            calls["on_before_backward"] += 1

        def on_after_backward(self, trainer, pl_module) -> None:
            calls["on_after_backward"] += 1

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            assert any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
            calls["on_before_optimizer_step"] += 1

    monkeypatch.setattr(mdl.run.experiment, "make_preconditioner", lambda cfg, dm, make_model: ([CountSteps()], None))
    cfg = compose_config(
        [*STACKED, "trainer.kwargs.max_epochs=6", "trainer.patience=2", "mdl.steps_per_group=4"], tmp_path
    )
    results = run_experiment(cfg, tmp_path / "run")
    batch = cfg.data.batch_size
    members = [(b["n_train"], b["epochs"]) for b in results["blocks"]] + [(results["n_train"], results["final_epochs"])]
    steps = max(epochs * math.ceil(n / batch) for n, epochs in members)
    assert calls == {name: steps for name in calls}


def test_grouping_steps_changes_no_result(tmp_path: Path) -> None:
    """mdl.steps_per_group only changes how many optimizer steps one Lightning step runs: the same
    batches, steps and protocol (on this CPU the numbers are identical to the bit)."""
    results = [
        run_experiment(
            compose_config([*STACKED, "trainer.kwargs.max_epochs=6", f"mdl.steps_per_group={g}"], tmp_path / str(g)),
            tmp_path / str(g) / "run",
        )
        for g in (1, 5)
    ]
    ungrouped, grouped = ([(b["epochs"], b["eval_bits"], b["val_loss_curve"]) for b in r["blocks"]] for r in results)
    assert [e for e, _, _ in grouped] == [e for e, _, _ in ungrouped]
    for (_, bits_g, curve_g), (_, bits_u, curve_u) in zip(grouped, ungrouped):
        assert bits_g == pytest.approx(bits_u, rel=1e-6) and curve_g == pytest.approx(curve_u, rel=1e-6)
    assert results[1]["paper_mdl"] == pytest.approx(results[0]["paper_mdl"], rel=1e-6)


def test_members_ending_an_epoch_together_are_validated_with_one_read_of_the_device() -> None:
    """On a GPU each read stalls the queue; the members whose epoch ends at a step share one read
    (training means and validation means together). Members of 32 and 64 examples, batches of 16,
    4 epochs each: epochs end after steps 2, 4 (both), 6, 8 (both), 12 and 16: 6 reads for 8 ends."""
    from mdl.engine.trainer import make_trainer

    x, y = torch.rand(96, 1, 8, 8), torch.randint(0, 10, (96,))
    loader = StackedBatches([TrainSource(x, y)], [32, 64], 16, pacing=Pacing(4))
    models = [create_model("mlp", 16, 1, 10, (1, 8, 8)) for _ in range(2)]
    module = StackedClassifier(StackedModel(models), torch.optim.SGD, lr=0.1)
    val = EvalBatches(x[64:], y[64:], 32)
    protocol = StackedProtocol(loader, lambda m: val, lambda m: val, patience=100, max_epochs=4, lr=0.1)
    reads = []
    end_epochs = protocol._end_epochs

    def counted(module: StackedClassifier, ended: list[int], trainer) -> list[int]:
        with RecordOps() as record:
            stopping = end_epochs(module, ended, trainer)
        reads.append((len(ended), host_reads(record)))
        return stopping

    protocol._end_epochs = counted
    trainer = make_trainer({"max_epochs": -1}, torch.device("cpu"), [protocol], checkpointing=False)
    trainer.fit(module, train_dataloaders=loader)
    assert [protocol.members[m].epoch for m in (0, 1)] == [4, 4]
    assert reads == [(1, ["Tensor.tolist"]), (2, ["Tensor.tolist"])] * 2 + [(1, ["Tensor.tolist"])] * 2


def test_a_checkpoint_written_with_the_retired_finished_at_still_resumes() -> None:
    """Checkpoints written before ``MemberState.finished_at`` was removed (written, never read) carry it: a resume
    leaves it out and restores every other field."""
    x, y = torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))
    make = lambda: StackedProtocol(  # noqa: E731
        StackedBatches([TrainSource(x, y)], [32, 64], 16, pacing=Pacing(2)), lambda m: None, lambda m: None, 10, 4, 0.1
    )
    saved = make().state_dict()
    saved["members"][1] |= {"finished_at": 12.5, "epoch": 3, "best_epoch": 2}
    resumed = make()
    resumed.load_state_dict(saved)
    assert (resumed.members[1].epoch, resumed.members[1].best_epoch, resumed.members[1].n_train) == (3, 2, 64)


def test_a_stack_of_one_runs_its_plain_model_with_batch_norm_and_dropout() -> None:
    """A fit of one member is a stack of one: it runs the plain model (not its stacked form), so what only a lone
    model can have works there, bit for bit (outputs and gradients): batch norm (its running statistics updated in the
    stack's buffers, eval mode under no_grad) and dropout; a stack of two still refuses them."""
    from models.stacking import StackedModel

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3),
            torch.nn.BatchNorm2d(4),
            torch.nn.Flatten(),
            torch.nn.Dropout(0.5),
            torch.nn.Linear(64, 3),
        )

    plain, stack = make(), StackedModel([make()])
    x = torch.rand(5, 1, 6, 6)
    torch.manual_seed(1)
    expected = plain(x)
    torch.manual_seed(1)
    out = stack(x[None])[0]
    assert torch.equal(out, expected)
    assert torch.equal(stack.buffer_dict()["1.running_mean"][0], plain[1].running_mean)
    expected.sum().backward(), out.sum().backward()
    assert all(torch.equal(p.grad, s.grad[0]) for p, s in zip(plain.parameters(), stack.stacked))
    # the member's tensors are bound for the call only, a failed call included: the template holds its weightless
    # (meta) tensors again
    with pytest.raises(RuntimeError):
        stack(torch.rand(1, 5, 2, 6, 6))  # two channels where the convolution takes one
    assert all(t.is_meta for t in [*stack.template.parameters(), *stack.template.buffers()])
    plain.eval()
    with torch.no_grad():
        scored = stack.run(stack.param_dict(), stack.buffer_dict(), x, shared_input=True)[0]
    assert torch.equal(scored, plain(x))
    with pytest.raises(ValueError, match="BatchNorm2d.*cannot be stacked"):
        StackedModel([make(), make()])


def test_a_stack_of_one_trains_through_leaves_that_share_its_parameters() -> None:
    """A stack of one trains its member through leaves on the stack's own storage (``_member_leaves``): an optimizer
    step on the stack moves what the next forward computes with, gradients reach the stack's parameters (summed
    over two backward passes as autograd sums them), the leaves are no parameters of the stack, and a move that
    replaces the parameters' tensors (here to float64, as ``.to("cuda")`` does) makes new leaves: each step equals
    the plain model's to the bit. Fails if the leaves kept the old tensors or dropped a gradient."""
    from models.stacking import StackedModel

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    plain, stack = make(), StackedModel([make()])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, stack)]
    for step in range(4):
        if step == 2:
            plain, stack = plain.double(), stack.double()
        x = torch.rand(7, 6, dtype=next(plain.parameters()).dtype)
        for opt, forward in zip(optimizers, (lambda: plain(x), lambda: stack(x[None])[0])):
            opt.zero_grad(set_to_none=True)
            for _ in range(2):  # gradients accumulate over two passes
                forward().square().sum().backward()
        assert all(torch.equal(p.grad, s.grad[0]) for p, s in zip(plain.parameters(), stack.stacked))
        for opt in optimizers:
            opt.step()
        assert all(torch.equal(p, s[0]) for p, s in zip(plain.parameters(), stack.stacked))
    assert len(list(stack.parameters())) == len(list(plain.parameters()))
    assert all(leaf.dtype == torch.float64 for leaf in stack._member_leaves().values())
    x = torch.rand(1, 7, 6, dtype=torch.float64)
    for frozen in (True, False):  # freezing a parameter, and unfreezing it, after its leaf was made
        stack.zero_grad(set_to_none=True)
        stack.stacked[0].requires_grad_(not frozen)
        stack(x).sum().backward()
        assert (stack.stacked[0].grad is None) == frozen and stack.stacked[1].grad is not None
