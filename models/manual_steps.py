"""Optimizer steps taken inside one Lightning training step (manual optimization).

Both kinds of fit (one member, several stacked) can run a group of consecutive optimizer steps per Lightning training step
(``mdl.steps_per_group``): Lightning's automatic optimization costs about half a millisecond
of host time per training step (its closure, about a dozen hook dispatches, a generic batch
transfer), as much as a whole step of a small model. Inside a group the raw optimizer is
stepped directly, and the per-step callback hooks Lightning would have called are called here,
in Lightning's order, on the callbacks that override them (e.g. models.preconditioning).
One difference: ``on_before_zero_grad`` runs right after the step it follows (Lightning's
automatic optimization calls it after the next forward pass), so it sees that step's gradients.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


class StepHooks:
    """Lightning's per-step callback hooks, called on the callbacks that override them: Lightning's
    own dispatch (every callback, profiler contexts) costs more per step than a small model's step."""

    def __init__(self, trainer: L.Trainer | None = None, module: L.LightningModule | None = None) -> None:
        self.trainer, self.module = trainer, module
        callbacks = trainer.callbacks if trainer is not None else []
        self.hooks = {
            name: [getattr(cb, name) for cb in callbacks if getattr(type(cb), name) is not getattr(L.Callback, name)]
            for name in STEP_HOOKS
        }

    def __call__(self, name: str, *args: Any) -> None:
        for hook in self.hooks[name]:
            hook(self.trainer, self.module, *args)


def optimizer_step(loss: Tensor, optimizer: torch.optim.Optimizer, hooks: StepHooks) -> None:
    """Backward, step and zero the gradients, with the hooks where Lightning calls them."""
    hooks("on_before_backward", loss)
    loss.backward()
    hooks("on_after_backward")
    hooks("on_before_optimizer_step", optimizer)
    optimizer.step()
    hooks("on_before_zero_grad", optimizer)
    optimizer.zero_grad(set_to_none=True)
