"""The LightningModule that trains any registered model with a (muP-scaled) Adam-like optimizer.

Schedule-free optimizers keep two weight sequences; the weights worth evaluating or saving are
the averaged ones, which are in the model only while the optimizer is in eval mode. So the
optimizer is put in eval mode for validation and testing, back in train mode for training, and
every checkpoint is written with eval-mode weights whatever the mode was when it was asked for.

Losses are accumulated on the model's device and read once per epoch: a ``float(loss)`` per step
would make the host wait for the GPU's queue to drain at every step. A training batch is either
one (x, y) batch (Lightning's automatic optimization) or a group of consecutive batches (``models.batches.StepGroup``),
each stepped here (manual optimization, models.manual_steps); the driver chooses
(mdl.engine.single_fit) and sets ``automatic_optimization`` to match.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.batches import StepGroup
from models.losses import SpectralDecoupling, spectral_penalty
from models.manual_steps import StepHooks, optimizer_step
from models.mup_setup import mup_param_groups
from models.precision import as_channels_last, autocast_context, check_precision

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

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        lr: float,
        mup: bool = True,
        precision: str = "fp32",
        channels_last: bool = False,
        loss: SpectralDecoupling | None = None,
    ) -> None:
        super().__init__()
        self.loss_regulariser = loss  # enters the training objective only (models.losses)
        self.model = model.to(memory_format=torch.channels_last) if channels_last else model
        self.optimizer_factory = optimizer
        self.lr = lr
        self.mup = mup
        self.precision = check_precision(precision)
        self.channels_last = channels_last
        self.train_loss_curve: list[float] = []
        self.val_loss_curve: list[float] = []
        self.val_accuracy_curve: list[float] = []  # fraction of validation examples the argmax gets right
        self._sums: dict[str, list[Any]] = {}  # key -> [loss sum (tensor on the device), count]
        self.step_hooks = StepHooks()  # the trainer's, from on_train_start (grouped steps)
        # protocol=original: validate and score the weights as training leaves them, in train mode (mdl.engine.protocol)
        self.evaluate_as_trained = False
        # protocol.batch_mean_validation: each validation batch's float32 mean in bits, as the original adds them up
        self.batch_mean_validation = False

    def forward(self, x: Tensor) -> Tensor:
        """Float32 logits, the forward pass under the run's precision (models.precision)."""
        if self.channels_last:
            x = as_channels_last(x)
        with autocast_context(self.precision, x.device.type):
            out = self.model(x)
        return out.float()

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

    def on_train_start(self) -> None:
        self.step_hooks = StepHooks(self.trainer, self)

    def on_train_epoch_start(self) -> None:
        self._set_mode(train=True)
        loader = self.trainer.train_dataloader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.current_epoch)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Batches move tensor by tensor (a no-op: the splits live on the training device), without
        Lightning's generic walk of the batch at every step."""
        if isinstance(batch, StepGroup):
            return batch.to(device)
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            return batch[0].to(device), batch[1].to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self._set_mode(train=False)

    def on_test_epoch_start(self) -> None:
        self._set_mode(train=False)

    def on_train_end(self) -> None:
        self._set_mode(train=False)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Whatever mode we are in, the checkpoint holds the eval-mode (averaged) weights."""
        checkpoint["loss_curves"] = {
            "train": list(self.train_loss_curve),
            "val": list(self.val_loss_curve),
            "val_accuracy": list(self.val_accuracy_curve),
            "pending": {k: [float(v[0]), v[1]] for k, v in self._sums.items()},
        }
        opts = self.trainer.optimizers if self._trainer is not None else []
        in_train = [o for o in opts if optimizer_train_mode(o)]
        if not in_train or self.evaluate_as_trained:  # protocol=original: its weights are y, saved as they are
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
        self.val_accuracy_curve = list(curves.get("val_accuracy", []))
        self._sums = {k: list(v) for k, v in curves["pending"].items()}
        if "train" in self._sums:  # saved in on_train_epoch_end, before this module's hook ran
            self.train_loss_curve.append(self._epoch_mean("train"))

    # --- steps --------------------------------------------------------------------------------

    def _accumulate(self, key: str, loss_sum: Tensor, n: int) -> None:
        """Add to the epoch's running sum on the device: no host synchronisation per step."""
        total = self._sums.get(key)
        if total is None:  # the epoch's first batch (no zeros tensor to add to: one kernel fewer per step)
            self._sums[key] = [loss_sum.detach().double(), n]
            return
        total[0] = total[0] + loss_sum.detach().double()  # out of place: a sum restored from a checkpoint is a float
        total[1] += n

    def _epoch_mean(self, key: str) -> float:
        """The epoch's mean loss (read from the device unless ``_read_sums`` already did)."""
        total, n = self._sums.pop(key, [0.0, 0])
        return float(total) / max(n, 1)

    def _read_sums(self) -> None:
        """Every running sum still on the device, read in one go: validation reads the epoch's
        training sum with its own, so a GPU's queue stalls once per epoch, not twice."""
        pending = [entry for entry in self._sums.values() if isinstance(entry[0], Tensor)]
        if pending:
            for entry, value in zip(pending, torch.stack([entry[0] for entry in pending]).tolist()):
                entry[0] = value

    def training_step(self, batch: tuple[Tensor, Tensor] | StepGroup, batch_idx: int) -> Tensor | None:
        if not isinstance(batch, StepGroup):
            return self.step_loss(*batch)
        if self.automatic_optimization:
            raise RuntimeError(
                "a group of steps is trained step by step: set automatic_optimization = False (mdl.engine.single_fit)"
            )
        self.train_group(batch, self.optimizers(use_pl_optimizer=False), self.step_hooks)
        return None

    def train_group(self, group: StepGroup, optimizer: torch.optim.Optimizer, hooks: StepHooks | None = None) -> None:
        """One optimizer step per batch of the group."""
        hooks = hooks or StepHooks()
        for x, y in group.batches:
            optimizer_step(self.step_loss(x, y), optimizer, hooks)

    def step_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """One batch's training objective; its plain cross-entropy joins the epoch's curve."""
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self._accumulate("train", loss.detach() * y.shape[0], y.shape[0])  # the curve stays plain cross-entropy
        if self.loss_regulariser is not None:
            loss = loss + spectral_penalty(logits, y, self.loss_regulariser).mean()
        return loss

    def on_train_epoch_end(self) -> None:
        self.train_loss_curve.append(self._require_finite(self._epoch_mean("train"), "training"))

    def _require_finite(self, mean: float, what: str) -> float:
        return require_finite(mean, what, f"epoch {self.current_epoch}", self.lr)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        if self.batch_mean_validation:  # the original's (cross_entropy / log 2).item() * len (mdl/probe.py@5e66bb9)
            loss_sum = (F.cross_entropy(logits, y) / math.log(2)).double() * y.shape[0]
        else:
            loss_sum = F.cross_entropy(logits, y, reduction="sum")
        self._accumulate("val", loss_sum, y.shape[0])
        self._accumulate("val_correct", (logits.argmax(-1) == y).sum(), y.shape[0])  # read with the loss

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self._sums.pop("val", None)
            self._sums.pop("val_correct", None)
            return
        self.log("val_loss", self._record_validation(), prog_bar=False, logger=False)

    @torch.no_grad()
    def validate(self, batches: Iterable[tuple[Tensor, Tensor]], as_trained: bool = False) -> float:
        """A validation pass outside Lightning's loop (a fit of one member validates in place,
        mdl.engine.single_fit): the same steps, modes and numbers; returns the mean loss (nats).
        ``as_trained``: the weights in the model now, in train mode (schedule-free's y, protocol=original)."""
        if not as_trained:
            self._set_mode(train=False)
        was_training = self.training
        self.train(as_trained)
        for i, batch in enumerate(batches):
            self.validation_step(batch, i)
        self.train(was_training)
        return self._record_validation()

    def _record_validation(self) -> float:
        self._read_sums()
        mean = self._epoch_mean("val") * (math.log(2) if self.batch_mean_validation else 1.0)  # nats either way
        mean = self._require_finite(mean, "validation")
        self.val_loss_curve.append(mean)
        self.val_accuracy_curve.append(self._epoch_mean("val_correct"))
        return mean


def require_finite(mean: float, what: str, where: str, lr: float) -> float:
    """Stop a diverged fit with the learning rate in the message (not a NaN in results.json); every
    engine's check (mdl.engine.protocol)."""
    if not math.isfinite(mean):
        raise FloatingPointError(
            f"training diverged: {where} has mean {what} loss {mean} with learning rate {lr:g} (optimizer.lr, whose "
            f"default per data set is optimizer.lr_by_data, scaled for depth); lower it, e.g. optimizer.lr={lr / 10:g}"
        )
    return mean


def module_device(module: nn.Module) -> torch.device | None:
    """The one device holding a module's parameters and buffers (None for a module without any)."""
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if len(devices) > 1:
        raise RuntimeError(f"the model's tensors are spread over {sorted(map(str, devices))}; expected one device")
    return devices.pop() if devices else None


def require_same_device(model: nn.Module, batch: Tensor, where: str) -> None:
    """A named error, instead of torch's, for a model and a batch on different devices."""
    on = module_device(model)
    if on is not None and on != batch.device:
        raise RuntimeError(
            f"{where}: the model is on {on} but the data is on {batch.device}. Lightning's teardown moves a "
            f"module to the CPU after every Trainer.fit; put it back on the training device first (mdl.engine.device)."
        )


@torch.no_grad()
def total_bits(model: nn.Module, batches: Any, train_mode: bool = False) -> tuple[float, int]:
    """Sum of -log2 p(y | x) over all batches (float64 accumulation, on the device) and the count.
    ``train_mode``: the model scores in train mode (protocol=original; drop-path stays active)."""
    was_training = model.training
    model.train(train_mode)
    total, count = None, 0
    for x, y in batches:
        require_same_device(model, x, "scoring")
        nats = F.cross_entropy(model(x).double(), y, reduction="sum")  # float64: exact sums
        total = nats if total is None else total + nats
        count += y.shape[0]
    model.train(was_training)
    return (float(total) / math.log(2) if total is not None else 0.0), count
