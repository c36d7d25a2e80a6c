"""Wall time of one full prequential run with each engine, and of the framework against a hand loop.

    python benchmarks/bench_engines.py [hydra overrides...] [--repeats 1] [--epochs 100] [--rounds 3]
        [--skip-engines] [--kernels-only]

Part 0 counts the kernel launches (aten ops that are not views) per optimizer step of all S
models of the run: S stacks of one after the other (sequential) against one stack of S (stacked). On a
GPU a small model's step is bound by them; on a CPU they can be counted exactly.

Part 1 runs the same configured run (default: the embedded default, digits + LEACE + MLP) with
``mdl.members_per_fit=1`` (sequential) and ``mdl.members_per_fit=all`` (stacked) in this process, after one untimed data
set-up (so neither pays for fitting the eraser), and prints each wall time, the ratio and both
MDL numbers; and the sequential engine as it was before time-based checkpoints (one every epoch).

Part 2 trains one model on the full training set for ``--epochs`` epochs (no early stopping)
through a hand-written loop on the plain model (the same batches, steps, schedule-free modes and per-epoch
validation) and through the engine's path with that one member (one fit of a stack of one, the StackedProtocol
validating in place), and prints the ratios. The stacked engine is also timed against a hand
loop doing its identical work (the stacked model's batched kernels, the padded-batch loss), which
separates the framework's overhead from the cost of the stacked form itself.

For CIFAR-10-shaped data on a GPU, e.g.
    python benchmarks/bench_engines.py data=synthetic data.options.shape=[3,32,32] \
        data.options.n_train=50000 data.val_size=5000 data.test_size=0 width=1024 device=cuda
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from datamodules.stacked_batches import Pacing  # noqa: E402
from mdl.engine.trainer import make_trainer  # noqa: E402
from mdl.engine.stacked_fit import StackedProtocol, build_members  # noqa: E402
from mdl.run.components import (  # noqa: E402
    make_datamodule,
    make_model_factory,
    make_optimizer,
    run_lr,
)
from mdl.run.experiment import quiet_lightning, run_experiment  # noqa: E402
from models import mup_param_groups  # noqa: E402
from models.stacked_module import StackedClassifier  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compose_run(overrides: list[str], root: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_root={root}", "skip_if_done=false", "~logger"])


MEMBERS_PER_FIT = {"sequential": 1, "stacked": "all"}  # the two groupings, as this script names them


def time_engine(overrides: list[str], engine: str, root: str) -> tuple[float, dict]:
    """One full run from scratch (a fresh run store, so nothing is resumed or skipped)."""
    run = Path(root) / f"run-{engine}-{time.time_ns()}"
    grouping = f"mdl.members_per_fit={MEMBERS_PER_FIT[engine]}"
    cfg = compose_run([*overrides, grouping, f"paths.store_dir={run / 'store'}"], root)
    start = time.perf_counter()
    results = run_experiment(cfg, run)
    return time.perf_counter() - start, results


def hand_loop(make_model, optimizer_factory, lr: float, dm, epochs: int) -> float:
    """The framework's work without the framework: the same model built, the same batches (a fit of one member's),
    steps, modes and validation."""
    sync(dm.device)
    start = time.perf_counter()
    model = make_model().to(dm.device)
    optimizer = optimizer_factory(mup_param_groups(model, lr))
    train, val = dm.stacked_train_loader([dm.num_train]), dm.val_dataloader()
    for _ in range(epochs):
        optimizer.train()
        total = torch.zeros((), dtype=torch.float64, device=dm.device)
        for group in train:  # one pass: one epoch of the one member
            for x, y, w in zip(group.x[:, 0], group.y[:, 0], group.weight[:, 0]):
                nats = F.cross_entropy(model(x), y, reduction="none") * w
                loss = nats.sum() / w.sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                total += nats.detach().sum().double()
        optimizer.eval()
        model.eval()  # as any correct validation (dropout, normalisation statistics)
        with torch.no_grad():
            v = sum(F.cross_entropy(model(x), y, reduction="sum").double() for x, y in val)
        model.train()
        float(total), float(v)  # the one read per epoch the framework also makes
    sync(dm.device)
    return time.perf_counter() - start


def hand_loop_stacked(make_module, make_loader, val, epochs: int) -> float:
    """The stacked engine's work for one member without the framework: the same stack built, its
    batches in groups, its steps, and per epoch its evaluation weights and validation."""
    device = val.device
    sync(device)
    start = time.perf_counter()
    module, loader = make_module(), make_loader()
    optimizer = module.configure_optimizers()
    optimizer.train()
    module.train_sums = module.train_sums.to(device)
    for _ in range(epochs):
        for group in loader:
            module.train_group(group, optimizer)
        total, _ = module.loss_sums(module.eval_weights([0]), val, float64=False)
        torch.stack([module.take_train_sums([0]), total]).tolist()  # the one read per epoch the framework also makes
    sync(device)
    return time.perf_counter() - start


def framework_vs_hand(overrides: list[str], root: str, epochs: int, rounds: int) -> None:
    cfg = compose_run(overrides, root)
    dm = make_datamodule(cfg)
    torch.set_num_threads(cfg.trainer.torch_threads or torch.get_num_threads())
    kwargs = {**OmegaConf.to_container(cfg.trainer.kwargs, resolve=True), "max_epochs": epochs}
    make_model = make_model_factory(cfg, dm.num_classes, dm.input_shape)
    timings = {"hand": [], "stacked": [], "hand stacked": []}
    pacing = Pacing(cfg.mdl.steps_per_group, cfg.mdl.min_steps_per_pass)  # the engine as a run has it
    for _ in range(rounds):  # interleaved; each form's fastest round counts (noise only ever adds time)
        L.seed_everything(0, verbose=False)
        timings["hand"].append(hand_loop(make_model, make_optimizer(cfg), run_lr(cfg), dm, epochs))
        L.seed_everything(0, verbose=False)
        start = time.perf_counter()
        one_member_fit(dm, make_model, make_optimizer(cfg), run_lr(cfg), kwargs, epochs, pacing)
        sync(dm.device)
        timings["stacked"].append(time.perf_counter() - start)

        def make_stacked() -> StackedClassifier:
            return StackedClassifier(build_members(make_model, [0], dm.device), make_optimizer(cfg), run_lr(cfg))

        def make_loader():
            return dm.stacked_train_loader([dm.num_train], Pacing(cfg.mdl.steps_per_group))  # a pass: one epoch

        timings["hand stacked"].append(hand_loop_stacked(make_stacked, make_loader, dm.val_dataloader(), epochs))
    hand, hand_stacked, stk = (min(timings[k]) for k in ("hand", "hand stacked", "stacked"))
    steps = epochs * math.ceil(dm.num_train / dm.options.batch_size)
    print(
        f"single model, {epochs} epochs ({steps} steps, {cfg.mdl.steps_per_group} per group): hand loop {hand:.2f} s | "
        f"the engine with one member {stk:.2f} s (framework/hand = {stk / hand:.2f}), hand loop of the same work "
        f"through the stack of one {hand_stacked:.2f} s (framework/that = {stk / hand_stacked:.2f})"
    )


class CountKernels(TorchDispatchMode):
    """Counts the aten ops that are not views: on a GPU, each one is a kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def kernels_per_step(overrides: list[str], root: str) -> None:
    """Kernel launches per optimizer step of every model of a run: S models one after the other
    (sequential) against one stack of S members. A small model's GPU step is bound by launches, so
    this ratio, counted here on the CPU, is what the stacked engine can save there."""
    from mdl.schedule import block_boundaries

    cfg = compose_run(overrides, root)
    dm = make_datamodule(cfg)
    members = len(block_boundaries(dm.num_train, cfg.mdl.num_blocks, cfg.mdl.first_block))
    steps = 4
    make_model = make_model_factory(cfg, dm.num_classes, dm.input_shape)
    single = StackedClassifier(build_members(make_model, [0], dm.device), make_optimizer(cfg), run_lr(cfg))
    single.to(dm.device)
    batches = iter(dm.stacked_train_loader([dm.num_train], Pacing(steps)))
    optimizer = single.configure_optimizers()
    optimizer.train()
    single.train_group(next(batches), optimizer)  # the first steps create the optimizer's state
    first = next(batches)
    with CountKernels() as one:
        single.train_group(first, optimizer)
    stack = StackedClassifier(
        build_members(make_model_factory(cfg, dm.num_classes, dm.input_shape), list(range(members)), dm.device),
        make_optimizer(cfg),
        run_lr(cfg),
    )
    stack.to(dm.device)  # its loss sums too, as on_train_start does in a fit
    loader = iter(dm.stacked_train_loader([dm.num_train] * members, Pacing(steps)))
    optimizer = stack.configure_optimizers()
    optimizer.train()
    stack.train_group(next(loader), optimizer)
    group = next(loader)  # gathered outside the count: the steps alone, as above
    with CountKernels() as stacked:
        stack.train_group(group, optimizer)
    per_model, stk = one.kernels / first.steps, stacked.kernels / group.steps
    print(
        f"kernels per optimizer step of all {members} models of a run ({cfg.model.name}): sequential "
        f"{members} x {per_model:.0f} = {members * per_model:.0f} | stacked {stk:.0f} | sequential/stacked = "
        f"{members * per_model / stk:.1f}x | stacked/one model = {stk / per_model:.2f}x"
    )


def one_member_fit(dm, make_model, optimizer, lr: float, kwargs: dict, epochs: int, pacing: Pacing) -> None:
    """The stacked engine's path (one Trainer.fit, the StackedProtocol) with the final model alone."""
    loader = dm.stacked_train_loader([dm.num_train], pacing)
    module = StackedClassifier(build_members(make_model, [0], dm.device), optimizer, lr)
    protocol = StackedProtocol(loader, lambda m: dm.val_dataloader(), lambda m: dm.test_dataloader(), 10**6, epochs, lr)
    trainer = make_trainer({**kwargs, "max_epochs": -1}, dm.device, [protocol], checkpointing=False)
    trainer.fit(module, train_dataloaders=loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the single-model comparison")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--kernels-only", action="store_true", help="only count the kernels per optimizer step")
    args, overrides = parser.parse_known_args()
    quiet_lightning()
    with tempfile.TemporaryDirectory() as root:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; overrides {overrides or '(none)'}")
        kernels_per_step(overrides, root)
        if args.kernels_only:
            return
        if not args.skip_engines:
            time_engine(
                [*overrides, "trainer.patience=1", "mdl.num_blocks=2"], "sequential", root
            )  # data set-up, eraser cache
            for r in range(args.repeats):
                before, _ = time_engine([*overrides, "mdl.checkpoint_every_s=0"], "sequential", root)
                print(
                    f"[{r}] sequential with a checkpoint every epoch (as before mdl.checkpoint_every_s): {before:.1f} s"
                )
                seq, seq_results = time_engine(overrides, "sequential", root)
                stk, stk_results = time_engine(overrides, "stacked", root)
                print(
                    f"[{r}] sequential {seq:.1f} s (paper MDL {seq_results['paper_mdl']:.4f}, online "
                    f"{seq_results['online_bits_per_example']:.4f}) | stacked {stk:.1f} s (paper MDL "
                    f"{stk_results['paper_mdl']:.4f}, online {stk_results['online_bits_per_example']:.4f}) | "
                    f"sequential/stacked = {seq / stk:.2f}x, every-epoch-checkpoint sequential/stacked = {before / stk:.2f}x"
                )
        framework_vs_hand(overrides, root, args.epochs, args.rounds)


if __name__ == "__main__":
    main()
