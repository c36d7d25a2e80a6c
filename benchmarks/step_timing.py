"""The framework's own training step and validation batch, timed: a stack of M >= 1 members (``StackedClassifier``,
each member its own batch; a stack of one runs its plain model), as a fit of ``mdl.members_per_fit`` members runs them.

Used by bench_stacked_speed.py (one member against a stack, per speed setting) and bench_epoch_times.py (the cost
table's rows). A step is ``train_group``: forward, backward and the optimizer step, on random data already on the
device; Lightning's loop is not in it (the engine runs ``mdl.steps_per_group`` steps per Lightning step, so its
host cost is spread thin). On a GPU every timing is bracketed by a synchronisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from datamodules.stacked_batches import StackedBatch
from models.stacked_module import StackedClassifier
from models.precision import set_float32_precision
from models.stacking import StackedModel

# speed setting -> (trainer.precision, trainer.compile, trainer.matmul_precision); the names are
# conf/cost/epoch_times.yaml's (mdl/sweeps/rates.py gpu_setting): fp32_highest is trainer=default, fp32_high TF32
# (the paper presets), bf16_compile trainer=gpu (with channels-last for conv nets); fp32 is the CPU's
SETTINGS = {
    "fp32": ("fp32", False, "highest"),
    "fp32_highest": ("fp32", False, "highest"),
    "fp32_high": ("fp32", False, "high"),
    "bf16": ("bf16", False, "high"),
    "bf16_compile": ("bf16", True, "high"),
    "fp32_compile": ("fp32", True, "highest"),
}


@dataclass
class Timed:
    """A module ready to step: its batch (one per member) and its optimizer in training mode."""

    module: nn.Module
    batch: StackedBatch
    optimizer: torch.optim.Optimizer
    members: int
    x: torch.Tensor  # one member's batch of inputs (for validation timing)


def build(
    make_model: Callable[[], nn.Module],
    optimizer: Callable[..., torch.optim.Optimizer],
    lr: float,
    members: int,
    shape: tuple[int, ...],
    batch: int,
    setting: str,
    device: torch.device,
    channels_last: bool = False,
    mup: bool = True,
    backend: str = "inductor",
    num_classes: int = 10,
) -> Timed:
    """The stack of ``members`` freshly built models, set up as a fit of that many members sets them up (precision,
    compile, channels-last for a stack of one's conv nets; ``mup`` is read from the models themselves)."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown speed setting {setting!r}; choose from {sorted(SETTINGS)}")
    precision, compiled, matmul_precision = SETTINGS[setting]
    set_float32_precision(matmul_precision)
    if compiled:  # every stack compiles the same function (StackedModel._run): without a reset, a process timing many
        torch._dynamo.reset()  # stacks reaches dynamo's recompile limit and silently times the later ones uncompiled
    x = torch.rand(members, batch, *shape, device=device)
    y = torch.randint(0, num_classes, (members, batch), device=device)
    stack = StackedModel([make_model().to(device) for _ in range(members)], channels_last=channels_last)
    module = StackedClassifier(stack, optimizer, lr, precision=precision).to(device)
    if compiled:
        module.stack.compile(backend)
    group = StackedBatch(x[None], y[None], torch.ones(1, members, batch, device=device), list(range(members)))
    opt = module.configure_optimizers()
    opt.train()
    return Timed(module, group, opt, members, x[0])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(timed: Timed, steps: int, device: torch.device, warmup: int = 3) -> tuple[float, float]:
    """(fastest of ``steps`` timed optimizer steps of all members, seconds of the ``warmup`` steps before them).
    The fastest: on a shared machine other work only ever slows a step down."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(warmup):
        timed.module.train_group(timed.batch, timed.optimizer)
    _synchronize(device)
    warm = time.perf_counter() - start
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        timed.module.train_group(timed.batch, timed.optimizer)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, warm


def seconds_per_eval_batch(timed: Timed, eval_batch: int, device: torch.device, repeats: int = 3) -> float:
    """Fastest forward pass of one member (``members`` 1) over ``eval_batch`` examples without gradients."""
    x = timed.x[:1].expand(eval_batch, *timed.x.shape[1:]).contiguous()
    module = timed.module
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass warms up
            _synchronize(device)
            start = time.perf_counter()
            module.stack(x[None])
            _synchronize(device)
            best = min(best, time.perf_counter() - start)
    return best
