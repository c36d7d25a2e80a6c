"""The prequential protocol for a stack of members trained in one ``Trainer.fit``.

Member m trains on the first n_m examples. Its epoch is one pass over its prefix
(ceil(n_m / batch) global steps). At the end of each of its epochs the callback validates it
(with its evaluation weights), keeps its best weights, and stops it after ``patience`` epochs
without improvement (Lightning's EarlyStopping rule, on the float32 mean it would compare) or
at ``max_epochs`` (None: 1000, as Lightning). A stopped member scores what it must with its best weights in float64 bits
(the next block, or the test split for the final model; and ``heldout_batches``, the chunk the
paper MDL's ``last_block`` estimate scores every prefix model on), leaves the stack and is reported
to ``on_finish``. The fit ends when no member is left. With ``untrained_candidate`` every member is
also validated before its first step and its untrained weights are a candidate, as the sequential
engine's ``EpochProtocol`` does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import lightning as L
import torch
from torch import Tensor

from datamodules.stacked_batches import StackedBatches
from mdl.callbacks import stopping_score
from models.stacked_module import StackedClassifier


@dataclass
class MemberState:
    """What the protocol knows of one member (saved in every checkpoint)."""

    member: int
    n_train: int
    steps_per_epoch: int
    epoch: int = 0  # epochs finished
    step: int = 0  # steps into the current epoch
    best_score: float = math.inf  # float32-rounded, as EarlyStopping compares
    best_epoch: int = -1  # 0-based index of the best epoch; -1 = none yet, or the untrained model
    best_val_loss: float = math.nan  # its mean validation loss (nats, float64)
    initial_val_loss: float | None = None  # the untrained model's, when it is a candidate
    wait: int = 0
    val_loss_curve: list[float] = field(default_factory=list)
    train_loss_curve: list[float] = field(default_factory=list)
    finished_at: float | None = None


@dataclass
class MemberOutcome:
    """A stopped member: its curves, best epoch and the bits it paid for its scoring batches."""

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


class PrequentialCallback(L.Callback):
    def __init__(
        self,
        loader: StackedBatches,
        val_batches: Callable[[], Iterable[tuple[Tensor, Tensor]]],
        score_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]]],
        patience: int,
        max_epochs: int | None,
        lr: float,
        on_finish: Callable[[MemberOutcome], None] | None = None,
        on_member_epoch: dict[int, Callable[[StackedClassifier, Any], None]] | None = None,
        heldout_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]] | None] = lambda m: None,
        untrained_candidate: bool = False,
        on_epoch: Callable[[int, int, float, float], None] | None = None,
    ) -> None:
        self.loader = loader
        self.on_epoch = on_epoch  # (member, epoch from 0, train loss, val loss) at each member's epoch end: live logging
        self.val_batches, self.score_batches = val_batches, score_batches
        self.heldout_batches = heldout_batches  # member -> its held-out chunk, or None: the same as score_batches
        self.untrained_candidate = untrained_candidate
        # as Lightning: max_epochs None means 1000, -1 means no limit
        self.patience, self.max_epochs = patience, (1000 if max_epochs is None else max_epochs if max_epochs > 0 else None)
        self.lr = lr
        self.on_finish = on_finish
        # member -> called at each of its epoch ends, after validation, with its evaluation weights
        # (leading dimension 1); e.g. the final member's max-ent probe curves (mdl/final_fit_curves.py)
        self.on_member_epoch = dict(on_member_epoch or {})
        self.members = {m: MemberState(m, s.n, s.steps_per_epoch) for m, s in loader.streams.items()}
        self.best: dict[int, dict[str, Tensor]] = {}  # member -> its best epoch's weights
        self.outcomes: dict[int, MemberOutcome] = {}
        self.started = time.monotonic()

    @property
    def active(self) -> list[int]:
        return [m for m in self.members if m not in self.outcomes]

    def on_train_start(self, trainer: L.Trainer, module: StackedClassifier) -> None:
        if not self.active:  # resumed after every member had stopped
            trainer.should_stop = True
        if self.on_epoch is not None:  # resumed: the epochs before the interruption, for this process's logger
            final = max(self.members)  # finished blocks are re-logged by the driver (on_block); the final fit is not
            for m in [m for m in self.members if m in self.active or m == final]:
                state = self.members[m]
                for epoch, (train, val) in enumerate(zip(state.train_loss_curve, state.val_loss_curve)):
                    self.on_epoch(m, epoch, train, val)
        fresh = [m for m in module.members if self.members[m].initial_val_loss is None]
        if self.untrained_candidate and fresh:  # not again on a resume
            self._validate_untrained(module, fresh)

    def _validate_untrained(self, module: StackedClassifier, members: list[int]) -> None:
        """The untrained weights as every member's first candidate (one read of the device)."""
        rows = [module.members.index(m) for m in members]
        weights = module.eval_weights(rows)
        val_sums, count = module.loss_sums(weights, self.val_batches(), float64=False)
        for j, (m, mean) in enumerate(zip(members, (val_sums / max(count, 1)).tolist())):
            state = self.members[m]
            self._require_finite(mean, "validation", state)
            state.initial_val_loss = mean
            self._keep(m, state, stopping_score(mean), mean, weights, j, len(members), epoch=-1)

    def _keep(self, m: int, state: MemberState, score: float, mean: float, weights: Any, j: int, rows: int, epoch: int) -> None:
        """Member m's candidate (row j of ``rows`` evaluated together) is its best so far."""
        state.best_score, state.best_val_loss, state.best_epoch, state.wait = score, mean, epoch, 0
        # eval_weights made fresh tensors: one member's row is kept as is, shared rows are copied
        self.best[m] = {n: t[j] if rows == 1 else t[j].clone() for n, t in (weights[0] | weights[1]).items()}

    def on_train_batch_end(self, trainer: L.Trainer, module: StackedClassifier, outputs: Any, batch: Any, batch_idx: int) -> None:
        ended = []
        for m in module.members:
            state = self.members[m]
            state.step += batch.steps  # a group never runs past a member's epoch end (StackedBatches)
            if state.step == state.steps_per_epoch:
                state.step, state.epoch = 0, state.epoch + 1
                ended.append(m)
        if not ended:
            return
        stopping = self._end_epochs(module, ended)
        if stopping:
            self._finish(module, stopping)
        if not module.members:
            trainer.should_stop = True

    def _end_epochs(self, module: StackedClassifier, ended: list[int]) -> list[int]:
        """Validate the members that finished an epoch; return those that stop now."""
        rows = [module.members.index(m) for m in ended]
        weights = module.eval_weights(rows)
        val_sums, count = module.loss_sums(weights, self.val_batches(), float64=False)  # as the sequential engine validates
        train_sums, val_means = torch.stack([module.take_train_sums(rows), val_sums / max(count, 1)]).tolist()  # the one read
        train = [s / self.members[m].n_train for s, m in zip(train_sums, ended)]
        stopping = []
        for j, m in enumerate(ended):
            state = self.members[m]
            self._require_finite(train[j], "training", state)
            self._require_finite(val_means[j], "validation", state)
            state.train_loss_curve.append(train[j])
            state.val_loss_curve.append(val_means[j])
            if self.on_epoch is not None:
                self.on_epoch(m, len(state.val_loss_curve) - 1, train[j], val_means[j])
            if m in self.on_member_epoch:
                self.on_member_epoch[m](module, ({n: t[j : j + 1] for n, t in weights[0].items()},
                                                 {n: t[j : j + 1] for n, t in weights[1].items()}))
            score = stopping_score(val_means[j])
            out_of_patience = False
            if score < state.best_score:
                self._keep(m, state, score, val_means[j], weights, j, len(ended), epoch=state.epoch - 1)
            else:  # as Lightning's EarlyStopping: only an epoch without improvement can run out of patience
                state.wait += 1
                out_of_patience = state.wait >= self.patience
            if out_of_patience or (self.max_epochs is not None and state.epoch >= self.max_epochs):
                stopping.append(m)
        return stopping

    def _finish(self, module: StackedClassifier, stopping: list[int]) -> None:
        """Score each stopping member with its best weights, record it, and take it off the stack."""
        for m in stopping:
            state = self.members[m]
            best = self.best[m]
            params = {n: best[n][None] for n in module.stack.names}
            buffers = {n: best[n][None] for n in module.stack.buffer_names}
            total, count = module.loss_sums((params, buffers), self.score_batches(m))
            scored_bits = float(total[0]) / math.log(2) if count else 0.0
            heldout = self.heldout_batches(m)
            if heldout is None:
                heldout_bits, heldout_count = scored_bits, count
            else:
                held_total, heldout_count = module.loss_sums((params, buffers), heldout)
                heldout_bits = float(held_total[0]) / math.log(2) if heldout_count else 0.0
            outcome = MemberOutcome(
                member=m, n_train=state.n_train, epochs=state.epoch, best_val_loss=state.best_val_loss,
                best_epoch=state.best_epoch, scored_bits=scored_bits, scored_count=count,
                heldout_bits=heldout_bits, heldout_count=heldout_count,
                val_loss_curve=list(state.val_loss_curve), train_loss_curve=list(state.train_loss_curve),
            )
            state.finished_at = time.monotonic() - self.started
            self.outcomes[m] = outcome
            del self.best[m]
            self.loader.remove(m)
            if self.on_finish is not None:
                self.on_finish(outcome)
        module.remove(stopping)

    def _require_finite(self, mean: float, what: str, state: MemberState) -> None:
        if not math.isfinite(mean):
            raise FloatingPointError(
                f"training diverged: member {state.member} (prefix {state.n_train}) has mean {what} loss {mean} in "
                f"epoch {state.epoch - 1} with learning rate {self.lr:g} (optimizer.lr, whose default is data.lr, "
                f"scaled for depth); lower it, e.g. optimizer.lr={self.lr / 10:g}"
            )

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The protocol's state and the loader's stream positions. Lightning's fit loop also keeps a
        train loader's ``state_dict`` but does not restore it at an epoch boundary (a resume test
        fails without this copy), so the callback restores it itself."""
        return {
            "members": {m: _plain(s) for m, s in self.members.items()},
            "best": self.best,
            "outcomes": {m: _plain(o) for m, o in self.outcomes.items()},
            "loader": self.loader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.members = {int(m): MemberState(**s) for m, s in state["members"].items()}
        device = self.loader.x.device
        self.best = {int(m): {n: t.to(device) for n, t in w.items()} for m, w in state["best"].items()}
        self.outcomes = {int(m): MemberOutcome(**o) for m, o in state["outcomes"].items()}
        self.loader.load_state_dict(state["loader"])


def _plain(record: Any) -> dict[str, Any]:
    """A record's fields as a dict of plain values (lists copied; cheaper than ``asdict``'s deep copy)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(record).items()}
