"""The LightningModule that trains any registered model with a (muP-scaled) Adam-like optimizer.

Schedule-free optimizers keep two weight sequences; the weights worth evaluating or saving are
the averaged ones, which are in the model only while the optimizer is in eval mode. So the
optimizer is put in eval mode for validation and testing, back in train mode for training, and
every checkpoint is written with eval-mode weights whatever the mode was when it was asked for.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.mup_setup import mup_param_groups
from models.precision import forward_with_precision

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


class Classifier(L.LightningModule):
    """Cross-entropy classification; records per-epoch mean train and validation losses (nats)."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory, lr: float, mup: bool = True) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.lr = lr
        self.mup = mup
        self.train_loss_curve: list[float] = []
        self.val_loss_curve: list[float] = []
        self._sums: dict[str, list[float]] = {}

    def forward(self, x: Tensor) -> Tensor:
        """Float32 logits, computed under the model's autocast option (models/precision.py)."""
        return forward_with_precision(self.model, x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.model.parameters())
        groups = mup_param_groups(self.model, self.lr) if self.mup else [{"params": params, "lr": self.lr}]
        return self.optimizer_factory(groups)

    # --- schedule-free modes ------------------------------------------------------------------

    def _set_mode(self, train: bool) -> None:
        if self._trainer is None:
            return
        for opt in self.trainer.optimizers:
            set_optimizer_mode(opt, train)

    def on_train_epoch_start(self) -> None:
        self._set_mode(train=True)
        loader = self.trainer.train_dataloader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.current_epoch)

    def on_validation_epoch_start(self) -> None:
        self._set_mode(train=False)

    def on_test_epoch_start(self) -> None:
        self._set_mode(train=False)

    def on_train_end(self) -> None:
        self._set_mode(train=False)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Whatever mode we are in, the checkpoint holds the eval-mode (averaged) weights."""
        checkpoint["loss_curves"] = {
            "train": list(self.train_loss_curve), "val": list(self.val_loss_curve), "pending": dict(self._sums),
        }
        opts = self.trainer.optimizers if self._trainer is not None else []
        in_train = [o for o in opts if optimizer_train_mode(o)]
        if not in_train:
            return
        for o in in_train:
            set_optimizer_mode(o, train=False)
        checkpoint["state_dict"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        checkpoint["optimizer_states"] = [o.state_dict() for o in opts]
        for o in in_train:
            set_optimizer_mode(o, train=True)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        curves = checkpoint.get("loss_curves")
        if curves is None:
            return
        self.train_loss_curve, self.val_loss_curve = list(curves["train"]), list(curves["val"])
        self._sums = {k: list(v) for k, v in curves["pending"].items()}
        if "train" in self._sums:  # saved in on_train_epoch_end, before this module's hook ran
            self.train_loss_curve.append(self._epoch_mean("train"))

    # --- steps --------------------------------------------------------------------------------

    def _accumulate(self, key: str, loss_sum: Tensor, n: int) -> None:
        total = self._sums.setdefault(key, [0.0, 0])
        total[0] += float(loss_sum)
        total[1] += n

    def _epoch_mean(self, key: str) -> float:
        total, n = self._sums.pop(key, [0.0, 0])
        return total / max(n, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self._accumulate("train", loss.detach() * y.shape[0], y.shape[0])
        return loss

    def on_train_epoch_end(self) -> None:
        self.train_loss_curve.append(self._epoch_mean("train"))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss_sum = F.cross_entropy(self(x), y, reduction="sum")
        self._accumulate("val", loss_sum, y.shape[0])

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self._sums.pop("val", None)
            return
        mean = self._epoch_mean("val")
        self.val_loss_curve.append(mean)
        self.log("val_loss", mean, prog_bar=False, logger=False)


@torch.no_grad()
def total_bits(model: nn.Module, batches: Any) -> tuple[float, int]:
    """Sum of -log2 p(y | x) over all batches (float64 accumulation) and the example count."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for x, y in batches:
        nats = F.cross_entropy(model(x).double(), y, reduction="sum")  # float64: exact sums
        total += nats.cpu()
        count += y.shape[0]
    model.train(was_training)
    return float(total) / math.log(2), count
