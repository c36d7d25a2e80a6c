"""Lightning plumbing every fit shares: the quiet Trainer and the resumable epoch-end checkpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

from mdl.engine.checkpoints import RunCheckpointIO
from mdl.engine.device import lightning_device_kwargs
from mdl.engine.preemption import defer_until_checkpoint, end_deferral, sigterm_requested, stop_after_checkpoint


def make_trainer(
    trainer_kwargs: dict[str, Any],
    device: torch.device,
    callbacks: list[L.Callback],
    checkpointing: bool,
    stamp: str = "",
) -> L.Trainer:
    """A quiet Trainer on the run's device, saving checkpoints (stamped with ``stamp``) only through our callbacks."""
    plugins: list[Any] = [RunCheckpointIO(device, stamp)]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))  # submitit owns requeueing
    return L.Trainer(
        **{**trainer_kwargs, **lightning_device_kwargs(device)},
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_checkpointing=checkpointing,  # our SaveLastCheckpoint, never a default one
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


class SaveLastCheckpoint(Checkpoint):
    """Write a resumable checkpoint at the end of every training epoch, a pass (or, with
    ``min_interval_s``, of the first pass that ends that long after the last save).

    A ``Checkpoint`` subclass, so Lightning orders it after every other callback (early stopping
    and best weights included): the state it saves includes the epoch just validated. The file is
    written atomically and checksummed by the trainer's ``RunCheckpointIO`` (mdl.engine.checkpoints);
    the protocol's state (best weights, curves) is in its own callback's state.
    """

    def __init__(self, path: str | os.PathLike, min_interval_s: float = 0.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s  # > 0: skip epoch ends closer than this to the last save
        self._last_save = float("-inf")  # the first epoch end always saves

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        recent = time.monotonic() - self._last_save < self.min_interval_s
        if recent and not trainer.should_stop and not sigterm_requested():
            return
        trainer.save_checkpoint(self.path)
        self._last_save = time.monotonic()
        stop_after_checkpoint(str(self.path))  # a SIGTERM arrived: stop here, resumable (mdl.engine.preemption)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """From here a SIGTERM stops the fit at its next checkpoint (mdl.engine.preemption). (A fit killed after its
        last checkpoint but before the driver recorded it trains no further: StackedProtocol.on_train_start.)"""
        defer_until_checkpoint()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end_deferral()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        end_deferral()
