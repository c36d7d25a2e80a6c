"""``debug=overfit``: can the configured model, optimizer and learning rate fit one batch?

A model that cannot drive the loss on a single batch of 128 (erased) training examples towards
zero will not learn the data set either: a broken architecture, a learning rate off by orders of
magnitude, an eraser that left no signal in the batch's labels (then fitting needs memorising).
The check trains the run's own model as a fit of one member does, a stack of one (muP groups, the configured
optimizer and lr), on the
first ``data.batch_size`` examples of the prequential order for ``overfit_one_batch`` steps and
reports the loss and accuracy on that batch before and after, with a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from models.module import set_optimizer_mode

if TYPE_CHECKING:
    from models.stacked_module import StackedClassifier

FITS_LOSS_FRACTION = 0.05  # the batch is fitted when its loss fell below 5% of the untrained loss ...
FITS_ACCURACY = 0.99  # ... and (nearly) every example is classified right (our choice)


@dataclass(frozen=True)
class OverfitResult:
    steps: int
    examples: int
    initial_loss: float
    final_loss: float
    final_accuracy: float

    @property
    def fits(self) -> bool:
        return self.final_loss <= FITS_LOSS_FRACTION * self.initial_loss and self.final_accuracy >= FITS_ACCURACY

    def describe(self) -> str:
        verdict = (
            "fits it"
            if self.fits
            else "does NOT fit it: check the learning rate (optimizer.lr), the architecture, or whether erasure left "
            "the labels learnable"
        )
        return (
            f"overfit check: {self.steps} steps on one batch of {self.examples} examples: loss "
            f"{self.initial_loss:.4f} -> {self.final_loss:.4g} nats, accuracy {self.final_accuracy:.3f}; the model {verdict}"
        )


def batch_metrics(module: "StackedClassifier", x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The stack of one's mean loss and accuracy on one batch, in eval mode."""
    with torch.no_grad():
        module.eval()
        logits = module.stack(x[None])[0].float()
        module.train()
        return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def overfit_one_batch(cfg: DictConfig, steps: int) -> OverfitResult:
    """Train the run's own module (muP groups, optimizer, lr, data and eraser from ``cfg``) on one batch for
    ``steps`` steps and measure it before and after. The config is checked as a run checks it, so the check
    answers for exactly the run it stands in for."""
    from mdl.engine.stacked_fit import build_members
    from models.stacked_module import StackedClassifier
    from mdl.run.components import make_datamodule, make_model_recipe
    from mdl.run.config_checks import check_trainer_config, validate_config
    from mdl.run.identity import training_threads

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"overfit_one_batch={steps!r}: the number of steps, an integer >= 1; e.g. overfit_one_batch=300"
        )
    validate_config(cfg)
    device = check_trainer_config(cfg)
    torch.manual_seed(cfg.seed)
    dm = make_datamodule(cfg, device)
    torch.set_num_threads(
        training_threads(cfg)
    )  # as a run trains (prepare_run): torch's default oversubscribes shared CPUs
    recipe = make_model_recipe(cfg, dm.num_classes, dm.input_shape)
    stack = build_members(recipe.make_model, [cfg.seed], device, bool(cfg.trainer.channels_last))
    module = StackedClassifier(stack, recipe.optimizer, recipe.lr, cfg.trainer.precision, loss=recipe.loss).to(device)
    n = min(int(cfg.data.batch_size), len(dm.train_set))
    x, y = dm.train_set.x[:n].to(device), dm.train_set.y[:n].to(device)
    optimizer = module.configure_optimizers()
    set_optimizer_mode(optimizer, False)
    initial_loss, _ = batch_metrics(module, x, y)
    set_optimizer_mode(optimizer, True)
    weight = torch.ones(1, n, device=device)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = module.step_loss(x[None], y[None], weight)
        if not math.isfinite(float(loss.detach())):
            break
        loss.backward()
        optimizer.step()
    set_optimizer_mode(optimizer, False)  # schedule-free: evaluate the averaged weights, as every fit does
    final_loss, accuracy = batch_metrics(module, x, y)
    return OverfitResult(steps, n, initial_loss, final_loss, accuracy)
