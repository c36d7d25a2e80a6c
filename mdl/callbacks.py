"""Lightning callbacks used by the prequential driver."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from mdl.preemption import defer_until_checkpoint, end_deferral, sigterm_requested, stop_after_checkpoint


def stopping_score(mean: float) -> float:
    """The value Lightning's ``EarlyStopping`` (mode min, min_delta 0) compares for a mean loss: its
    float32 rounding, as the logged metric holds it. Both engines' stopping rules compare this.
    (numpy rounds a float to float32 as torch does, without making a tensor.)"""
    return float(np.float32(mean))


class EpochProtocol(L.Callback):
    """The sequential engine's protocol at the end of every training epoch, run in place: validate
    the evaluation weights, keep the best epoch's weights, stop after ``patience`` epochs without
    improvement.

    Lightning's validation loop with a logged metric, ``EarlyStopping`` and a best-weights callback
    do the same for about a millisecond of host work per epoch, as much as a whole epoch of a small
    model on digits. The stopping rule is ``EarlyStopping``'s (mode min, min_delta 0) on the float32
    value it would compare, as ``PrequentialCallback`` applies it too. After each validation the
    callbacks that override ``on_validation_end`` are called, as Lightning would (the module in eval
    mode, a schedule-free optimizer's evaluation weights in it): e.g. the final fit's probe curves.
    The snapshot holds every parameter and buffer (persistent or not) on the training device, so
    ``restore`` rebuilds the module there from the snapshot alone, wherever Lightning's teardown
    has moved it since.

    With ``untrained_candidate`` the model is also validated before its first epoch, and the
    untrained weights are a candidate like any epoch's (``best_epoch`` -1 when they stay best), as
    the original code validated before training (quad-mlp mdl/probe.py:120-130): a fit can never
    end worse on validation than the model it started from.
    """

    def __init__(
        self, val_batches: Callable[[], Iterable[Any]], patience: int, device: torch.device | str,
        untrained_candidate: bool = False,
    ) -> None:
        self.val_batches, self.patience, self.device = val_batches, patience, torch.device(device)
        self.untrained_candidate = untrained_candidate
        self.best_score = float("inf")  # float32-rounded, as EarlyStopping compares
        self.best_epoch = -1  # 0-based index of the best trained epoch; -1 = none yet, or the untrained model
        self.best_val_loss = math.nan  # its mean validation loss (nats, float64)
        self.initial_val_loss: float | None = None  # the untrained model's, when it is a candidate
        self.wait = 0
        self.best_state: dict[str, torch.Tensor] | None = None
        self.after_validation: list[Callable[..., None]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_validation = [cb.on_validation_end for cb in trainer.callbacks
                                 if type(cb).on_validation_end is not L.Callback.on_validation_end]
        if self.untrained_candidate and self.initial_val_loss is None:  # not again on a resume
            mean = pl_module.validate(self.val_batches())
            pl_module.val_loss_curve.pop()  # the curve holds trained epochs only
            self.initial_val_loss = mean
            self._keep(pl_module, stopping_score(mean), mean, epoch=-1)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.zero_grad(set_to_none=True)  # as Lightning before validating: no gradients held meanwhile
        mean = pl_module.validate(self.val_batches())
        if self.after_validation:  # as Lightning calls them: the model in eval mode, no autograd
            with torch.no_grad():
                pl_module.eval()
                for hook in self.after_validation:
                    hook(trainer, pl_module)
                pl_module.train()
        score = stopping_score(mean)
        if score < self.best_score:
            self._keep(pl_module, score, mean, epoch=len(pl_module.val_loss_curve) - 1)
        else:  # as EarlyStopping: only an epoch without improvement can run out of patience
            self.wait += 1
            if self.wait >= self.patience:
                trainer.should_stop = True

    def _keep(self, pl_module: L.LightningModule, score: float, mean: float, epoch: int) -> None:
        self.best_score, self.best_val_loss, self.best_epoch, self.wait = score, mean, epoch, 0
        self.best_state = {name: t.detach().clone() for name, t in named_tensors(pl_module)}

    def restore(self, pl_module: L.LightningModule) -> None:
        """Put ``pl_module`` on the training device holding the best epoch's weights."""
        if self.best_state is None:
            raise RuntimeError("no validation epoch finished, so there are no best weights to restore")
        pl_module.to_empty(device=self.device)  # where it is now does not matter: every tensor is replaced
        pl_module.to(self.device)  # a no-op move that updates Lightning's record of the module's device
        with torch.no_grad():
            for name, tensor in named_tensors(pl_module):
                tensor.copy_(self.best_state[name])

    def state_dict(self) -> dict:
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "wait": self.wait,
                "best_val_loss": self.best_val_loss, "initial_val_loss": self.initial_val_loss,
                "best_state": self.best_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score, self.best_epoch, self.wait = state_dict["best_score"], state_dict["best_epoch"], state_dict["wait"]
        self.best_val_loss, self.initial_val_loss = state_dict["best_val_loss"], state_dict["initial_val_loss"]
        best = state_dict["best_state"]
        self.best_state = None if best is None else {k: v.to(self.device) for k, v in best.items()}


def named_tensors(module: torch.nn.Module):
    """Every parameter and buffer, non-persistent ones included (a snapshot must rebuild the module)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


class SaveLastCheckpoint(Checkpoint):
    """Write a resumable checkpoint at the end of every training epoch (or, with
    ``min_interval_s``, of the first epoch that ends that long after the last save).

    A ``Checkpoint`` subclass, so Lightning orders it after every other callback (early stopping
    and best weights included): the state it saves includes the epoch just validated. The file is
    written atomically and checksummed by the trainer's ``RunCheckpointIO`` (mdl/checkpoints.py);
    a schedule-free optimizer is in eval mode here (validation ran), and
    ``Classifier.on_save_checkpoint`` guarantees eval weights anyway.
    """

    def __init__(self, path: str | os.PathLike, min_interval_s: float = 0.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s  # > 0: skip epoch ends closer than this to the last save
        self._last_save = float("-inf")  # the first epoch end always saves
        self._resumed_stopped = False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        recent = time.monotonic() - self._last_save < self.min_interval_s
        if recent and not trainer.should_stop and not sigterm_requested():
            return
        trainer.save_checkpoint(self.path)
        self._last_save = time.monotonic()
        stop_after_checkpoint(str(self.path))  # a SIGTERM arrived: stop here, resumable (mdl/preemption.py)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["fit_stopped"] = bool(trainer.should_stop)  # early stopping decided at this epoch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit killed after its last checkpoint but before the driver recorded it trains no further.
        From here a SIGTERM stops the fit at its next checkpoint (mdl/preemption.py)."""
        if self._resumed_stopped:
            trainer.should_stop = True
        defer_until_checkpoint()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end_deferral()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        end_deferral()

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._resumed_stopped = bool(checkpoint.get("fit_stopped", False))
