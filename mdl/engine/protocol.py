"""The prequential protocol of one member, in a stack of any size.

A run has S members: member i < S - 1 trains on the first t_i examples and is scored on block
i + 1; the last member (the final fit) trains on all of them. Every member follows the same rule at the end of each of its epochs: validate, keep the best weights,
stop after ``patience`` epochs without improvement (Lightning's ``EarlyStopping``, mode min,
min_delta 0, on the float32 value it would compare) or at ``max_epochs``. This module holds that
rule, the member's record and its seed; ``StackedProtocol`` (mdl.engine.stacked_fit) applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mdl.codelength import heldout_block
from mdl.results import BlockResult
from models.module import require_finite

__all__ = ["LoopRules", "MemberOutcome", "MemberState", "fits_of", "member_seeds", "require_finite", "stopping_score"]


@dataclass(frozen=True)
class LoopRules:
    """How a member's training loop runs (conf/protocol/): ``sound`` (all False) or ``original``.

    ``backtrack``: after an epoch that does not improve, the best epoch's weights and optimizer state
    are loaded back and training goes on (original: mdl/probe.py@5e66bb9:124-138). The optimizer
    state is loaded with ``Optimizer.load_state_dict``, as the original did: its tensors then are the
    snapshot's own, so training moves the snapshot too until the next improvement, and schedule-free's
    step count, warm-up and averaging weights go back with it.
    ``evaluate_as_trained``: validation and scoring use the weights as training leaves them (schedule-free's
    y), the model in train mode; only the untrained model is validated in eval mode (original: the
    model and optimizer put in eval mode once, mdl/probe.py@5e66bb9:110-114, and in train mode every
    epoch, 143-146). ``reshuffle`` False: every epoch takes the prefix in its order (original: no shuffle in the
    loop, mdl/probe.py@5e66bb9:149). ``augment_per_batch``: one crop offset and one flip per batch (original:
    torchvision v2 RandomCrop/RandomHorizontalFlip on a batch tensor, experiments/cli.py@0cc7065, applied at
    mdl/probe.py@5e66bb9:152). A fit of several members cannot backtrack one member (one optimizer step count
    for the stack), so runs with ``backtrack`` train one member per fit. ``exact_stopping``: an epoch improves when
    its mean validation loss, a float64, is below the best (original: Python floats compared, mdl/probe.py@5e66bb9:124,
    the loss a float64 average of the batches' ``.item()``, :202-208), not its float32 rounding as Lightning's
    EarlyStopping compares (``stopping_score``): on LEACE'd digits the first epochs improve by less than a float32
    step, so the rounding decided whether a fit left the untrained model. ``batch_mean_validation``: the mean
    validation loss added up as the original did (mdl/probe.py@5e66bb9:202-208, 210-216): each batch of the training
    batch size gives its float32 mean cross-entropy in bits, times its size, summed in float64 and divided by the
    count (then stored in nats), not one float32 sum over batches of ``data.eval_batch_size``. Its float32 roundings
    differ by up to a few 1e-7 nats, as much as a first epoch changes the loss on LEACE'd digits, so it too decided
    whether a fit left the untrained model (issue 45). ``redraw_per_block``: every block's fit trains, validates and
    is scored on a fresh permutation of the pool (original: mdl/sweep.py@3034bc0:109-119; ``datamodules.redraw``),
    not on the prefixes of one order.
    """

    backtrack: bool = False
    evaluate_as_trained: bool = False
    reshuffle: bool = True
    augment_per_batch: bool = False
    exact_stopping: bool = False
    batch_mean_validation: bool = False
    redraw_per_block: bool = False

    @property
    def one_member_per_fit(self) -> bool:
        """Whether every fit trains one member: a stack shares one optimizer step count, which one member cannot
        take back alone (``backtrack``), adds its validation losses up its own way (``batch_mean_validation``) and
        trains every member on one layout (``redraw_per_block``)."""
        return self.backtrack or self.batch_mean_validation or self.redraw_per_block

    @classmethod
    def of(cls, protocol: Any) -> "LoopRules":
        """From a config's ``protocol`` node (None or absent keys: the sound loop)."""
        protocol = protocol or {}
        return cls(
            backtrack=bool(protocol.get("backtrack", False)),
            evaluate_as_trained=bool(protocol.get("evaluate_as_trained", False)),
            reshuffle=bool(protocol.get("reshuffle", True)),
            augment_per_batch=bool(protocol.get("augment_per_batch", False)),
            exact_stopping=bool(protocol.get("exact_stopping", False)),
            batch_mean_validation=bool(protocol.get("batch_mean_validation", False)),
            redraw_per_block=bool(protocol.get("redraw_per_block", False)),
        )


def stopping_score(mean: float) -> float:
    """The value Lightning's ``EarlyStopping`` (mode min, min_delta 0) compares for a mean loss: its
    float32 rounding, as the logged metric holds it. (numpy rounds a float to float32 as torch
    does, without making a tensor.)"""
    return float(np.float32(mean))


def member_seeds(seed: int, num_boundaries: int) -> list[int]:
    """Each block's model's seed and, last, the final model's: ``seed * 1000 + i``, the final one
    ``seed * 1000 + S`` (so a run's members never share a seed with another seed's run)."""
    return [seed * 1000 + i for i in range(num_boundaries - 1)] + [seed * 1000 + num_boundaries]


def max_epochs_of(trainer_max_epochs: int | None) -> int | None:
    """Lightning's reading of ``max_epochs``: None means 1000, -1 (or any value < 1) no limit."""
    if trainer_max_epochs is None:
        return 1000
    return trainer_max_epochs if trainer_max_epochs > 0 else None


@dataclass
class MemberState:
    """What the protocol knows of one member (saved in every checkpoint)."""

    member: int
    n_train: int
    steps_per_epoch: int = 0  # a fit counts its members' steps itself (StackedProtocol), not Lightning
    epoch: int = 0  # epochs finished
    step: int = 0  # steps into the current epoch
    best_score: float = math.inf  # float32-rounded, as EarlyStopping compares (float64 with exact_stopping)
    best_epoch: int = -1  # 0-based index of the best epoch; -1 = none yet, or the untrained model
    best_val_loss: float = math.nan  # its mean validation loss (nats, float64)
    initial_val_loss: float | None = None  # the untrained model's, when it is a candidate
    wait: int = 0
    val_loss_curve: list[float] = field(default_factory=list)
    train_loss_curve: list[float] = field(default_factory=list)
    val_accuracy_curve: list[float] = field(default_factory=list)

    def judge(self, mean: float, epoch: int, exact: bool = False) -> bool:
        """One validation of the weights after ``epoch`` (-1: untrained): whether they are the best
        so far (then they are this member's candidate); otherwise one more epoch without improving. ``exact``:
        compare the float64 mean itself (``LoopRules.exact_stopping``), else its float32 rounding."""
        score = float(mean) if exact else stopping_score(mean)
        if score < self.best_score:
            self.best_score, self.best_val_loss, self.best_epoch, self.wait = score, mean, epoch, 0
            return True
        self.wait += 1  # as EarlyStopping: only an epoch without improvement can run out of patience
        return False

    def should_stop(self, improved: bool, patience: int, max_epochs: int | None) -> bool:
        """After ``judge`` of the epoch just finished (``improved``: what it returned): out of patience, or at
        ``max_epochs`` (as ``max_epochs_of`` reads it). As in Lightning's ``EarlyStopping``, only an epoch
        without improvement runs out of patience: an improving one never stops a member, even with patience 0."""
        return (not improved and self.wait >= patience) or (max_epochs is not None and self.epoch >= max_epochs)


@dataclass
class MemberOutcome:
    """A stopped member: its curves, best epoch and the bits it paid for its scoring batches
    (the next block, or the test split for the final member) and for the held-out last block."""

    member: int
    n_train: int
    epochs: int
    best_val_loss: float  # nats, float64
    best_epoch: int  # 0-based index of the kept epoch; -1 = the untrained model
    scored_bits: float
    scored_count: int
    heldout_bits: float
    heldout_count: int
    val_loss_curve: list[float]
    train_loss_curve: list[float]
    val_accuracy_curve: list[float] = field(default_factory=list)  # fraction right per epoch (a logger's series)

    def block(self) -> BlockResult:
        """The results.json record of a prefix member."""
        return BlockResult(
            n_train=self.n_train,
            n_eval=self.scored_count,
            eval_bits=self.scored_bits,
            val_bits_per_example=self.best_val_loss / math.log(2),
            epochs=self.epochs,
            val_loss_curve=self.val_loss_curve,
            train_loss_curve=self.train_loss_curve,
            heldout_bits_per_example=self.heldout_bits / self.heldout_count,
            best_after_epochs=self.best_epoch + 1,
            val_accuracy_curve=self.val_accuracy_curve,
        )


def fits_of(num_members: int, members_per_fit: int | None) -> list[list[int]]:
    """The members, in order, in fits of ``members_per_fit`` (None: all in one fit)."""
    size = num_members if members_per_fit is None else max(1, min(members_per_fit, num_members))
    return [list(range(start, min(start + size, num_members))) for start in range(0, num_members, size)]


def scoring_ranges(boundaries: Sequence[int], member: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """Member ``member``'s scored block (None: the test split, for the final member) and its held-out
    block (None: the same as the scored one)."""
    num_blocks = len(boundaries) - 1
    held = heldout_block(boundaries)
    if member == num_blocks:
        return None, None
    scored = (boundaries[member], boundaries[member + 1])
    return scored, (None if scored[0] == held[0] else held)
