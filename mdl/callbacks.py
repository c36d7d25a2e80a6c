"""Lightning callbacks used by the prequential driver."""

from __future__ import annotations

import copy

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
