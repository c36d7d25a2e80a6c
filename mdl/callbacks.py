"""Lightning callbacks used by the prequential driver."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import lightning as L
import torch


class KeepBestWeights(L.Callback):
    """Remember the weights of the epoch with the lowest validation loss; restore them on demand.

    Runs after validation, when a schedule-free optimizer is in eval mode, so the weights kept are
    the averaged ones that were actually validated.
    """

    def __init__(self, monitor: str = "val_loss") -> None:
        self.monitor = monitor
        self.best_score = float("inf")
        self.best_epoch = -1
        self.best_state: dict[str, torch.Tensor] | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        score = trainer.callback_metrics.get(self.monitor)
        if score is None:
            return
        score = float(score)
        if score < self.best_score:
            self.best_score, self.best_epoch = score, trainer.current_epoch
            self.best_state = copy.deepcopy(pl_module.state_dict())

    def restore(self, pl_module: L.LightningModule) -> None:
        if self.best_state is not None:
            pl_module.load_state_dict(self.best_state)

    def state_dict(self) -> dict:
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "best_state": self.best_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score = state_dict["best_score"]
        self.best_epoch = state_dict["best_epoch"]
        self.best_state = state_dict["best_state"]


class SaveLastCheckpoint(L.Callback):
    """Write a resumable checkpoint at the end of every training epoch, atomically.

    Placed after early stopping in the callback list, so the saved early-stopping counters and
    best weights include the epoch just validated; a schedule-free optimizer is in eval mode
    here (validation ran), and ``Classifier.on_save_checkpoint`` guarantees eval weights anyway.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        trainer.save_checkpoint(tmp)
        os.replace(tmp, self.path)
