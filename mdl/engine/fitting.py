"""The two things the driver is given: what a run is (``Run``) and how its members are fitted (``Fitting``).

A ``Run`` is one config's training problem: its data, block schedule, seed, model recipe and the hooks of its
loggers. A ``Fitting`` is what every fit of the runs trained together shares: Trainer settings, the protocol's
patience and loop, checkpoints, precision and compilation, how many members train at once. A run alone and a
pack of runs take the same path (``mdl.engine.driver.train_runs``): a run alone is a pack of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning as L
from torch import nn

from datamodules.datamodule import ErasedDataModule
from datamodules.stacked_batches import Pacing
from mdl.engine.protocol import LoopRules, member_seeds
from models.losses import SpectralDecoupling
from models.module import OptimizerFactory

BlockHook = Callable[..., None]  # (block index, result[, restored]): a finished block, for the loggers
EpochHook = Callable[..., None]  # (member, epoch from 0, train loss, val loss, accuracy): mdl.engine.progress_display


@dataclass(frozen=True)
class ModelRecipe:
    """A member's model and how it is optimised, built once per run from its config: a fresh model per call of
    ``make_model`` (a fit stacks them; a stack of one runs its plain model)."""

    make_model: Callable[[], nn.Module]
    optimizer: OptimizerFactory
    lr: float
    loss: SpectralDecoupling | None = None  # the training objective's regulariser; None: plain cross-entropy


@dataclass
class Run:
    """What a run is: the data its members train on, the block schedule, the seed its members' seeds and batch
    order come from, its model, its store folder (progress.json, its own checkpoints) and its loggers' hooks."""

    data: ErasedDataModule
    boundaries: Sequence[int]
    seed: int
    model: ModelRecipe
    store: Path
    on_block: BlockHook | None = None
    on_epoch: EpochHook | None = None
    final_curves: Any = None  # a callback of the final member only (mdl.engine.final_fit_curves)
    final_fit: bool = True  # False: the blocks' members only (protocol.final_fit; the paper MDL never uses the final)
    label: str = ""  # its name in log lines and the progress display where it trains with other runs
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda hook: (
        hook
    )  # wraps the hooks called for this run alone
    # (its finished blocks, its loggers'): e.g. their log lines then go to the run's own log file

    @property
    def size(self) -> int:
        """Members: one per block boundary, the last the final fit."""
        return len(self.boundaries)

    def seeds(self) -> list[int]:
        return member_seeds(self.seed, self.size)


@dataclass(frozen=True)
class Fitting:
    """How the members of the runs trained together are fitted. ``folder`` holds the checkpoints of their fits, of
    one member or more (a run's store, or a pack's folder), and ``stamp`` marks them (mdl.engine.checkpoints).
    ``members_per_fit``: None = all of a run's members in one
    fit, ``auto`` = as many as the device holds (``mdl.engine.memory.plan_fits``)."""

    trainer_kwargs: dict[str, Any]
    patience: int
    folder: Path
    stamp: str = ""  # what wrote a checkpoint: a resume trusts only its own (mdl.engine.checkpoints)
    members_per_fit: int | str | None = None
    checkpoint_every_s: float = 0.0
    pacing: Pacing = Pacing()  # optimizer steps per Lightning step and per Lightning epoch
    paper_loss: str = "last_block"  # with last_block the untrained weights are every member's first candidate
    rules: LoopRules = LoopRules()  # the protocol's loop (conf/protocol/)
    callbacks: Sequence[L.Callback] = ()  # join every fit (e.g. models.preconditioning)
    precision: str = "fp32"
    channels_last: bool = False  # a stack of one (a stacked ConvNeXt is channels-last anyway)
    compile_backend: str | None = None

    @property
    def untrained_candidate(self) -> bool:
        return self.paper_loss == "last_block"

    @property
    def max_epochs(self) -> int | None:
        return self.trainer_kwargs.get("max_epochs")
