"""What the LightningModule (``models.stacked_module.StackedClassifier``) and the protocol share: the optimizer
factory's type, schedule-free's train and eval modes, and the divergence check.

Schedule-free optimizers keep two weight sequences; the weights worth evaluating are the averaged ones (x), in the
model only while the optimizer is in eval mode. The stacked module keeps the optimizer in train mode and computes x
out of place for the members it evaluates.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


OptimizerFactory = Callable[..., torch.optim.Optimizer]


def optimizer_train_mode(optimizer: torch.optim.Optimizer) -> bool | None:
    """True/False for schedule-free optimizers in train/eval mode; None for ordinary ones."""
    group = optimizer.param_groups[0]
    return group.get("train_mode") if "train_mode" in group else None


def set_optimizer_mode(optimizer: torch.optim.Optimizer, train: bool) -> None:
    mode = optimizer_train_mode(optimizer)
    if mode is None or mode == train:
        return
    optimizer.train() if train else optimizer.eval()  # type: ignore[attr-defined]


def require_finite(mean: float, what: str, where: str, lr: float) -> float:
    """Stop a diverged fit with the learning rate in the message (not a NaN in results.json); every
    engine's check (mdl.engine.protocol)."""
    if not math.isfinite(mean):
        raise FloatingPointError(
            f"training diverged: {where} has mean {what} loss {mean} with learning rate {lr:g} (optimizer.lr, whose "
            f"default per data set is optimizer.lr_by_data, scaled for depth); lower it, e.g. optimizer.lr={lr / 10:g}"
        )
    return mean
