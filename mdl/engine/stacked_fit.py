"""A fit of several members at once: one ``Trainer.fit`` of their stacked model.

Member m trains on the first n_m examples. Its epoch is one pass over its prefix
(ceil(n_m / batch) global steps). At the end of each of its epochs ``StackedProtocol`` validates
it (with its evaluation weights) and applies the member's protocol (mdl.engine.protocol). A
stopped member scores what it must with its best weights in float64 bits (its next block, or the
test split for the final member, and the held-out last block), leaves the stack and is reported
to ``on_finish``. The fit ends when no member is left. Each member is initialised exactly as a
fit of one member would initialise it (same seed, same builder) and draws its own batches from
its own prefix (datamodules.stacked_batches). The whole stacked state is checkpointed at the
end of every pass (whole epochs of the longest prefix, datamodules.stacked_batches), so a killed fit resumes bit for bit. Members of packed runs
with their own data (``data_of``) are validated on their own validation split, one pass per split.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from datamodules.stacked_batches import StackedBatches
from mdl.engine.protocol import LoopRules, MemberOutcome, MemberState, max_epochs_of, require_finite
from mdl.engine.fitting import EpochHook
from models.module import set_optimizer_mode
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

STATE_FIELDS = [f.name for f in fields(MemberState)]  # a checkpoint's others (finished_at, dropped) are left out


def build_members(
    make_model: Callable[[], nn.Module], seeds: Sequence[int], device: torch.device, channels_last: bool = False
) -> StackedModel:
    """The members' models, each built under its own seed as a fit of one member builds it, stacked
    (``channels_last``: a stack of one's, ``trainer.channels_last``)."""
    members = []
    for s in seeds:
        L.seed_everything(s, verbose=False)
        members.append(make_model().to(device))
    return StackedModel(members, channels_last)


@dataclass
class FitMembers:
    """What a stacked fit's members need beyond their batches, by stack id: their held-out batches, which data each
    has (members with equal values share their validation batches: one pass for all of them), where their
    results and epochs go, which are final fits and how the progress display names them."""

    heldout_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]] | None] = lambda m: None  # None: the scored ones
    data_of: Callable[[int], int] = lambda m: 0
    on_finish: Callable[[MemberOutcome], None] | None = None
    # member -> called at each of its epoch ends, after validation, with its evaluation weights (leading
    # dimension 1); e.g. the final member's max-ent probe curves (mdl.engine.final_fit_curves)
    on_member_epoch: dict[int, Callable[[StackedClassifier, Any], None]] = field(default_factory=dict)
    on_epoch: EpochHook | None = None  # (member, epoch from 0, train loss, val loss, accuracy): live logging
    final_members: Sequence[int] | None = None  # None: the last member
    labels: dict[int, str] = field(default_factory=dict)


class StackedProtocol(L.Callback):
    def __init__(
        self,
        loader: StackedBatches,
        val_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]]],
        score_batches: Callable[[int], Iterable[tuple[Tensor, Tensor]]],
        patience: int,
        max_epochs: int | None,
        lr: float,
        members: FitMembers | None = None,
        untrained_candidate: bool = False,
        rules: LoopRules = LoopRules(),
    ) -> None:
        """``val_batches(m)``, ``score_batches(m)``: member m's validation batches and the batches it is scored on;
        ``members``: the rest each member needs (default: one data set, no hooks, the last member the final fit);
        ``rules``: the loop's (``LoopRules``; ``backtrack`` only in a stack of one)."""
        self.hooks = members = members or FitMembers()
        self.loader = loader
        self.val_batches, self.score_batches = val_batches, score_batches
        self.untrained_candidate, self.rules, self.exact_stopping = untrained_candidate, rules, rules.exact_stopping
        # rules.backtrack (a stack of one): the best epoch's weights as trained and optimizer state, and whether the
        # optimizer's tensors are the snapshot's since the last backtrack (LoopRules: the original's load_state_dict)
        self.backtrack_to: dict[str, Any] | None = None
        self.optimizer_is_snapshot = False
        self.patience, self.max_epochs = patience, max_epochs_of(max_epochs)
        self.lr = lr
        self.members = {m: MemberState(m, s.n, s.steps_per_epoch) for m, s in loader.streams.items()}
        finals = members.final_members
        self.final_members = set(finals) if finals is not None else {max(self.members)}
        self.best: dict[int, dict[str, Tensor]] = {}  # member -> its best epoch's weights
        self.outcomes: dict[int, MemberOutcome] = {}

    @property
    def active(self) -> list[int]:
        return [m for m in self.members if m not in self.outcomes]

    def on_train_start(self, trainer: L.Trainer, module: StackedClassifier) -> None:
        """Before the first step (or the first after a resume): hand a resumed fit's earlier epochs to the logger,
        validate the untrained members when they are candidates, and set up what the loop rules need."""
        if not self.active:  # resumed after every member had stopped
            trainer.should_stop = True
        module.stack.as_trained = self.rules.evaluate_as_trained
        if self.optimizer_is_snapshot:  # resumed between a backtrack and the next improvement
            self._share_optimizer_tensors(trainer.optimizers[0])
        if (
            self.hooks.on_epoch is not None
        ):  # resumed: the epochs before the interruption, for this process's logger, of
            # every member, those finished before included (their accuracy curve is only here; fit_stack logs their bits)
            for m, state in self.members.items():
                accuracy = state.val_accuracy_curve
                for epoch, (train, val) in enumerate(zip(state.train_loss_curve, state.val_loss_curve)):
                    self.hooks.on_epoch(m, epoch, train, val, accuracy[epoch] if epoch < len(accuracy) else None)
        fresh = [m for m in module.members if self.members[m].initial_val_loss is None]
        if self.untrained_candidate and fresh:  # not again on a resume
            module.stack.as_trained = False  # the untrained model in eval mode (LoopRules.evaluate_as_trained)
            for members in self._by_data(fresh):
                self._validate_untrained(module, members)
            module.stack.as_trained = self.rules.evaluate_as_trained
            if self.rules.backtrack:  # the optimizer as it trains (the module's on_train_start comes after this)
                set_optimizer_mode(trainer.optimizers[0], train=True)
                self._snapshot(module, trainer)

    def _by_data(self, members: list[int]) -> list[list[int]]:
        """``members`` in groups that share their data (one group unless runs with their own data are packed)."""
        groups: dict[int, list[int]] = {}
        for m in members:
            groups.setdefault(self.hooks.data_of(m), []).append(m)
        return list(groups.values())

    def _validate_untrained(self, module: StackedClassifier, members: list[int]) -> None:
        """The untrained weights as every member's first candidate (one read of the device)."""
        rows = [module.members.index(m) for m in members]
        weights = module.eval_weights(rows)
        val_sums, count = module.loss_sums(
            weights,
            self.val_batches(members[0]),
            float64=False,
            chunks=module.chunks(rows),
            batch_means=self.rules.batch_mean_validation,
        )
        means = module.validation_means(val_sums, count, self.rules.batch_mean_validation)
        for j, (m, mean) in enumerate(zip(members, means.tolist())):
            state = self.members[m]
            self._require_finite(mean, "validation", state)
            state.initial_val_loss = mean
            state.judge(mean, epoch=-1, exact=self.exact_stopping)
            self._keep(m, weights, j, len(members))

    def _keep(self, m: int, weights: Any, j: int, rows: int) -> None:
        """Member m's candidate (row j of ``rows`` evaluated together) is its best so far."""
        # eval_weights made fresh tensors: one member's row is kept as is, shared rows are copied
        self.best[m] = {n: t[j] if rows == 1 else t[j].clone() for n, t in (weights[0] | weights[1]).items()}

    def on_train_batch_end(
        self, trainer: L.Trainer, module: StackedClassifier, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count every member's steps; the members whose epoch ended at this batch are validated together (one
        pass per data set) and judged by the protocol, and those that stop leave the stack. The fit ends when no
        member is left, which is why this runs per batch: members' epochs end at different steps."""
        ended = []
        for m in module.members:
            state = self.members[m]
            state.step += batch.steps  # a group never runs past a member's epoch end (StackedBatches)
            if state.step == state.steps_per_epoch:
                state.step, state.epoch = 0, state.epoch + 1
                ended.append(m)
        if not ended:
            return
        stopping = [m for group in self._by_data(ended) for m in self._end_epochs(module, group, trainer)]
        if stopping:
            self._finish(module, stopping)
        if not module.members:
            trainer.should_stop = True

    def _end_epochs(self, module: StackedClassifier, ended: list[int], trainer: L.Trainer) -> list[int]:
        """Validate the members that finished an epoch (all with the same data); return those that stop now. With
        ``rules.backtrack`` a member that did not improve and goes on is taken back to its best epoch."""
        rows = [module.members.index(m) for m in ended]
        weights = module.eval_weights(rows, as_trained=self.rules.evaluate_as_trained)
        val_sums, count, correct = module.loss_sums(
            weights,
            self.val_batches(ended[0]),
            float64=False,
            with_correct=True,
            chunks=module.chunks(rows),
            batch_means=self.rules.batch_mean_validation,
        )
        train_sums, val_means, accuracy = torch.stack(  # the one read
            [
                module.take_train_sums(rows),
                module.validation_means(val_sums, count, self.rules.batch_mean_validation),
                correct / max(count, 1),
            ]
        ).tolist()
        train = [s / self.members[m].n_train for s, m in zip(train_sums, ended)]
        stopping = []
        for j, m in enumerate(ended):
            state = self.members[m]
            self._require_finite(train[j], "training", state)
            self._require_finite(val_means[j], "validation", state)
            state.train_loss_curve.append(train[j])
            state.val_loss_curve.append(val_means[j])
            state.val_accuracy_curve.append(accuracy[j])
            if self.hooks.on_epoch is not None:
                self.hooks.on_epoch(m, len(state.val_loss_curve) - 1, train[j], val_means[j], accuracy[j])
            if m in self.hooks.on_member_epoch:  # its evaluation weights in eval mode, as Lightning's hooks see them
                module.stack.as_trained = False
                self.hooks.on_member_epoch[m](
                    module,
                    (
                        {n: t[j : j + 1] for n, t in weights[0].items()},
                        {n: t[j : j + 1] for n, t in weights[1].items()},
                    ),
                )
                module.stack.as_trained = self.rules.evaluate_as_trained
            improved = state.judge(val_means[j], epoch=state.epoch - 1, exact=self.exact_stopping)
            if improved:
                self._keep(m, weights, j, len(ended))
                if self.rules.backtrack:
                    self._snapshot(module, trainer)
            if state.should_stop(improved, self.patience, self.max_epochs):
                stopping.append(m)
            elif not improved and self.rules.backtrack:
                self._backtrack(module, trainer)
        return stopping

    def _snapshot(self, module: StackedClassifier, trainer: L.Trainer) -> None:
        """The stack of one's weights as trained and its optimizer state, to go back to (``rules.backtrack``)."""
        self.backtrack_to = {
            "weights": {
                n: t.detach().clone() for n, t in (module.stack.param_dict() | module.stack.buffer_dict()).items()
            },
            "optimizer": _cloned_state(trainer.optimizers[0].state_dict()),
        }
        self.optimizer_is_snapshot = False

    def _backtrack(self, module: StackedClassifier, trainer: L.Trainer) -> None:
        """The best epoch's weights and optimizer state back in place, training goes on from there. The optimizer's
        tensors become the snapshot's own (``load_state_dict`` does not copy tensors already of the parameter's dtype
        and device), as in the original code."""
        if self.backtrack_to is None:
            raise RuntimeError(
                "backtracking needs a snapshot: validate the untrained model (mdl.paper_loss=last_block)"
            )
        trainer.optimizers[0].load_state_dict(self.backtrack_to["optimizer"])
        self.optimizer_is_snapshot = True
        with torch.no_grad():
            for name, tensor in (module.stack.param_dict() | module.stack.buffer_dict()).items():
                tensor.copy_(self.backtrack_to["weights"][name])

    def _share_optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> None:
        """After a resume, the snapshot's optimizer tensors are the optimizer's again, as they were when the
        checkpoint was written (a checkpoint restores two equal copies): training drifts the snapshot until the next
        improvement as in a fit that was never interrupted."""
        live = optimizer.state_dict()["state"]  # the optimizer's own tensors, not copies
        for index, saved in self.backtrack_to["optimizer"]["state"].items():
            for key, value in live[index].items():
                if torch.is_tensor(value):
                    if not torch.equal(saved[key], value):
                        raise RuntimeError(f"the checkpoint's snapshot and optimizer differ in {key}: not resumable")
                    saved[key] = value

    def _finish(self, module: StackedClassifier, stopping: list[int]) -> None:
        """Score each stopping member with its best weights, record it, and take it off the stack."""
        for m in stopping:
            state = self.members[m]
            best = self.best[m]
            params = {n: best[n][None] for n in module.stack.names}
            buffers = {n: best[n][None] for n in module.stack.buffer_names}
            total, count = module.loss_sums((params, buffers), self.score_batches(m))
            scored_bits = float(total[0]) / math.log(2) if count else 0.0
            heldout = self.hooks.heldout_batches(m)
            if heldout is None:
                heldout_bits, heldout_count = scored_bits, count
            else:
                held_total, heldout_count = module.loss_sums((params, buffers), heldout)
                heldout_bits = float(held_total[0]) / math.log(2) if heldout_count else 0.0
            outcome = MemberOutcome(
                member=m,
                n_train=state.n_train,
                epochs=state.epoch,
                best_val_loss=state.best_val_loss,
                best_epoch=state.best_epoch,
                scored_bits=scored_bits,
                scored_count=count,
                heldout_bits=heldout_bits,
                heldout_count=heldout_count,
                val_loss_curve=list(state.val_loss_curve),
                train_loss_curve=list(state.train_loss_curve),
                val_accuracy_curve=list(state.val_accuracy_curve),
            )
            self.outcomes[m] = outcome
            del self.best[m]
            self.loader.remove(m)
            if self.hooks.on_finish is not None:
                self.hooks.on_finish(outcome)
        module.remove(stopping)

    def _require_finite(self, mean: float, what: str, state: MemberState) -> None:
        require_finite(
            mean, what, f"member {state.member} (prefix {state.n_train}) in epoch {state.epoch - 1}", self.lr
        )

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The protocol's state and the loader's stream positions. Lightning's fit loop also keeps a
        train loader's ``state_dict`` but does not restore it at an epoch boundary (a resume test
        fails without this copy), so the callback restores it itself."""
        state = {
            "members": {m: _plain(s) for m, s in self.members.items()},
            "best": self.best,
            "outcomes": {m: _plain(o) for m, o in self.outcomes.items()},
            "loader": self.loader.state_dict(),
        }
        if self.rules.backtrack:
            state["backtrack_to"], state["optimizer_is_snapshot"] = self.backtrack_to, self.optimizer_is_snapshot
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.members = {
            int(m): MemberState(**{k: s[k] for k in STATE_FIELDS if k in s}) for m, s in state["members"].items()
        }
        device = self.loader.device
        self.best = {int(m): {n: t.to(device) for n, t in w.items()} for m, w in state["best"].items()}
        self.outcomes = {int(m): MemberOutcome(**o) for m, o in state["outcomes"].items()}
        self.loader.load_state_dict(state["loader"])
        self.backtrack_to = state.get("backtrack_to")
        if self.backtrack_to is not None:
            self.backtrack_to["weights"] = {n: t.to(device) for n, t in self.backtrack_to["weights"].items()}
        self.optimizer_is_snapshot = state.get("optimizer_is_snapshot", False)


def _plain(record: Any) -> dict[str, Any]:
    """A record's fields as a dict of plain values (lists copied; cheaper than ``asdict``'s deep copy)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(record).items()}


def _cloned_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with its tensors cloned, as ``copy.deepcopy`` gives it without deepcopy's walk of
    every object (a snapshot per improving epoch: 75 us against 280 us for the paper MLP, a stack of one)."""
    return {
        "state": {
            index: {
                key: value.clone() if isinstance(value, Tensor) else copy.deepcopy(value) for key, value in s.items()
            }
            for index, s in state_dict["state"].items()
        },
        "param_groups": copy.deepcopy(state_dict["param_groups"]),
    }
