"""A fit of one member: the plain model in its own ``Trainer.fit``.

Everything a single model can have works here (``trainer.compile``, ``channels_last``, gradient
clipping, batch norm, dropout). The protocol (mdl.engine.protocol) runs in place at each epoch
end (``EpochProtocol``); the kept weights then score the member's block in float64 bits.
"""

from __future__ import annotations

import functools
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import lightning as L
import torch

from datamodules.datamodule import ErasedDataModule
from mdl.engine.checkpoints import resumable
from mdl.engine.trainer import SaveLastCheckpoint, make_trainer
from mdl.engine.protocol import LoopRules, MemberOutcome, MemberState, max_epochs_of, scoring_ranges
from mdl.engine.fitting import Fitting
from mdl.engine.trainer_settings import refuse_for_sequential, settings_needing_single_steps
from models.module import Classifier, total_bits


class EpochProtocol(L.Callback):
    """The protocol at the end of every training epoch of one model, run in place: validate the
    evaluation weights, keep the best epoch's weights, stop after ``patience`` epochs without
    improvement or at ``max_epochs`` (``MemberState.judge`` and ``should_stop``, as every fit).

    Lightning's validation loop with a logged metric, ``EarlyStopping`` and a best-weights callback
    do the same for about a millisecond of host work per epoch, as much as a whole epoch of a small
    model on digits. After each validation the callbacks that override ``on_validation_end`` are
    called, as Lightning would (the module in eval mode, a schedule-free optimizer's evaluation
    weights in it): e.g. the final fit's probe curves. The snapshot holds every parameter and buffer
    (persistent or not) on the training device, so ``restore`` rebuilds the module there from the
    snapshot alone, wherever Lightning's teardown has moved it since.

    With ``untrained_candidate`` the model is also validated before its first epoch, and the
    untrained weights are a candidate like any epoch's (``best_epoch`` -1 when they stay best), as
    the original code validated before training (quad-mlp mdl/probe.py:120-130): a fit can never
    end worse on validation than the model it started from.
    """

    def __init__(
        self,
        val_batches: Callable[[], Iterable[Any]],
        patience: int,
        device: torch.device | str,
        untrained_candidate: bool = False,
        state: MemberState | None = None,
        rules: LoopRules = LoopRules(),
        max_epochs: int | None = None,
    ) -> None:
        """``max_epochs``: as ``max_epochs_of`` reads trainer.kwargs.max_epochs (None: no limit)."""
        self.val_batches, self.patience, self.device = val_batches, patience, torch.device(device)
        self.max_epochs = max_epochs
        self.untrained_candidate = untrained_candidate
        self.rules = rules
        self.best_optimizer_state: dict | None = None  # with rules.backtrack: the best epoch's optimizer state
        self.optimizer_is_snapshot = False  # since the last backtrack the optimizer's tensors are the snapshot's
        self.state = state or MemberState(member=0, n_train=0)
        self.best_state: dict[str, torch.Tensor] | None = None
        self.after_validation: list[Callable[..., None]] = []

    @property
    def best_val_loss(self) -> float:
        return self.state.best_val_loss

    @property
    def best_epoch(self) -> int:
        return self.state.best_epoch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_validation = [
            cb.on_validation_end
            for cb in trainer.callbacks
            if type(cb).on_validation_end is not L.Callback.on_validation_end
        ]
        if self.optimizer_is_snapshot:  # resumed between a backtrack and the next improvement
            self._share_optimizer_tensors(trainer.optimizers[0])
        if self.untrained_candidate and self.state.initial_val_loss is None:  # not again on a resume
            mean = pl_module.validate(self.val_batches())
            pl_module.val_loss_curve.pop()  # the curves hold trained epochs only
            pl_module.val_accuracy_curve.pop()
            self.state.initial_val_loss = mean
            self.state.judge(mean, epoch=-1, exact=self.rules.exact_stopping)
            self._snapshot(pl_module, trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The protocol at the end of an epoch: validate the evaluation weights, let the callbacks that wait for
        validation see them, keep the best epoch's weights, then stop, or backtrack to the best epoch when the
        protocol says so. Done here rather than in Lightning's validation loop, whose host work per epoch costs as
        much as an epoch of a small model."""
        pl_module.zero_grad(set_to_none=True)  # as Lightning before validating: no gradients held meanwhile
        mean = pl_module.validate(self.val_batches(), as_trained=self.rules.evaluate_as_trained)
        if self.after_validation:  # as Lightning calls them: the model in eval mode, no autograd
            with torch.no_grad():
                pl_module.eval()
                for hook in self.after_validation:
                    hook(trainer, pl_module)
                pl_module.train()
        self.state.epoch = len(pl_module.val_loss_curve)  # epochs trained, this one included (resumed with the module)
        improved = self.state.judge(mean, epoch=self.state.epoch - 1, exact=self.rules.exact_stopping)
        if improved:
            self._snapshot(pl_module, trainer)
        if self.state.should_stop(improved, self.patience, self.max_epochs):
            trainer.should_stop = True
        elif not improved and self.rules.backtrack:
            self._backtrack(pl_module, trainer)

    def _snapshot(self, pl_module: L.LightningModule, trainer: L.Trainer) -> None:
        self.best_state = {name: t.detach().clone() for name, t in named_tensors(pl_module)}
        if self.rules.backtrack:
            self.best_optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict())
            self.optimizer_is_snapshot = False

    def _backtrack(self, pl_module: L.LightningModule, trainer: L.Trainer) -> None:
        """The best epoch's weights and optimizer state back in place, training goes on from there. The
        optimizer's tensors become the snapshot's own (``load_state_dict`` does not copy tensors that are
        already of the parameter's dtype and device), as in the original code."""
        if self.best_state is None or self.best_optimizer_state is None:
            raise RuntimeError(
                "backtracking needs a snapshot: validate the untrained model (mdl.paper_loss=last_block)"
            )
        trainer.optimizers[0].load_state_dict(self.best_optimizer_state)
        self.optimizer_is_snapshot = True
        with torch.no_grad():
            for name, tensor in named_tensors(pl_module):
                tensor.copy_(self.best_state[name])

    def _share_optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> None:
        """After a resume, the snapshot's optimizer tensors are the optimizer's again, as they were when the
        checkpoint was written (a checkpoint restores two equal copies): training drifts the snapshot until the next
        improvement as in a fit that was never interrupted."""
        live = optimizer.state_dict()["state"]  # the optimizer's own tensors, not copies
        for index, saved in self.best_optimizer_state["state"].items():
            for key, value in live[index].items():
                if torch.is_tensor(value):
                    if not torch.equal(saved[key], value):
                        raise RuntimeError(f"the checkpoint's snapshot and optimizer differ in {key}: not resumable")
                    saved[key] = value

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
        s = self.state
        saved = {
            "best_score": s.best_score,
            "best_epoch": s.best_epoch,
            "wait": s.wait,
            "best_val_loss": s.best_val_loss,
            "initial_val_loss": s.initial_val_loss,
            "best_state": self.best_state,
        }
        if self.rules.backtrack:
            saved["best_optimizer_state"] = self.best_optimizer_state
            saved["optimizer_is_snapshot"] = self.optimizer_is_snapshot
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        s = self.state
        s.best_score, s.best_epoch, s.wait = state_dict["best_score"], state_dict["best_epoch"], state_dict["wait"]
        s.best_val_loss, s.initial_val_loss = state_dict["best_val_loss"], state_dict["initial_val_loss"]
        best = state_dict["best_state"]
        self.best_state = None if best is None else {k: v.to(self.device) for k, v in best.items()}
        self.best_optimizer_state = state_dict.get("best_optimizer_state")
        self.optimizer_is_snapshot = state_dict.get("optimizer_is_snapshot", False)


def named_tensors(module: torch.nn.Module):
    """Every parameter and buffer, non-persistent ones included (a snapshot must rebuild the module)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


@dataclass
class FitOutcome:
    module: Classifier
    epochs: int
    best_val_loss: float  # nats
    best_epoch: int  # 0-based index of the kept epoch; -1 = the untrained model
    seconds: float


def fit_prefix(
    dm: ErasedDataModule,
    n_train: int | None,
    make_module: Callable[[], Classifier],
    fitting: Fitting,
    checkpoint: Path | None = None,
    identity: str = "",
    extra_callbacks: Sequence[L.Callback] = (),
    member: int = 0,
) -> FitOutcome:
    """Train a fresh model on the first n_train examples (None = all) with early stopping, as ``fitting`` says.

    The model trains on the data module's device and is returned there, holding its best
    epoch's weights. With ``checkpoint`` set, the fit saves its state there every epoch and, if
    an intact file already exists (an interrupted earlier attempt), continues from it; a damaged
    one is discarded with a warning and the fit starts over. ``fitting.checkpoint_every_s`` > 0 skips the
    saves of epochs that end less than that long after the last one (the first epoch and the
    stopping one are always saved). ``extra_callbacks`` join the fit (and its checkpoints), e.g. the
    final fit's max-ent probe curves. One Lightning step trains ``fitting.steps_per_group`` consecutive
    batches (manual optimization) unless a trainer setting needs one step per Lightning step.
    With ``fitting.untrained_candidate`` the untrained model is validated too and kept if no epoch beats it.
    ``identity`` (``mdl.engine.checkpoints.run_identity``) stamps the checkpoint; only a checkpoint with the
    same stamp is resumed.
    """
    trainer_kwargs, patience, rules = fitting.trainer_kwargs, fitting.patience, fitting.rules
    untrained_candidate = fitting.untrained_candidate
    start = time.perf_counter()
    refuse_for_sequential(trainer_kwargs)
    device = dm.device
    steps = 1 if settings_needing_single_steps(trainer_kwargs) else fitting.steps_per_group
    dm.use_prefix(n_train, steps, rules.reshuffle, rules.augment_per_batch)
    module = make_module()
    module.automatic_optimization = steps == 1
    module.evaluate_as_trained = rules.evaluate_as_trained
    module.batch_mean_validation = rules.batch_mean_validation
    best = EpochProtocol(
        functools.partial(dm.val_dataloader, dm.options.batch_size)
        if rules.batch_mean_validation
        else dm.val_dataloader,
        patience,
        device,
        untrained_candidate,
        MemberState(member, dm.num_train if n_train is None else n_train),
        rules,
        max_epochs_of(fitting.max_epochs),
    )
    callbacks: list[L.Callback] = [best, *extra_callbacks]
    if checkpoint is not None:
        callbacks.append(SaveLastCheckpoint(checkpoint, fitting.checkpoint_every_s))
    resume_from = resumable(checkpoint, identity)
    trainer = make_trainer(trainer_kwargs, device, callbacks, checkpointing=checkpoint is not None, identity=identity)
    with warnings.catch_warnings():  # no val_dataloader on purpose: EpochProtocol validates
        warnings.filterwarnings("ignore", message=".*defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(module, train_dataloaders=dm.train_dataloader(), ckpt_path=resume_from)
    best.restore(module)  # back on the training device: Lightning's teardown moved it to the CPU
    # best_val_loss: the float64 value of the compared float32 one
    return FitOutcome(module, trainer.current_epoch, best.best_val_loss, best.best_epoch, time.perf_counter() - start)


def fit_one_member(
    dm: ErasedDataModule, boundaries: Sequence[int], member: int, seed: int, fit: Callable[..., FitOutcome]
) -> tuple[MemberOutcome, float]:
    """Seed, fit (``fit(n_train)``: ``fit_prefix`` with the run's settings) and score one member
    with its kept weights; returns its outcome and the fit's seconds."""
    num_blocks = len(boundaries) - 1
    L.seed_everything(seed, verbose=False)
    result = fit(None if member == num_blocks else boundaries[member])
    scored, held = scoring_ranges(boundaries, member)
    batches = dm.test_dataloader() if scored is None else dm.eval_loader(*scored)
    as_trained = result.module.evaluate_as_trained  # protocol=original: the kept weights in train mode
    bits, count = total_bits(result.module, batches, as_trained)
    held_bits, held_count = (
        (bits, count) if held is None else total_bits(result.module, dm.eval_loader(*held), as_trained)
    )
    outcome = MemberOutcome(
        member=member,
        n_train=dm.num_train if scored is None else boundaries[member],
        epochs=result.epochs,
        best_val_loss=result.best_val_loss,
        best_epoch=result.best_epoch,
        scored_bits=bits,
        scored_count=count,
        heldout_bits=held_bits,
        heldout_count=held_count,
        val_loss_curve=result.module.val_loss_curve,
        train_loss_curve=result.module.train_loss_curve,
        val_accuracy_curve=list(result.module.val_accuracy_curve),
    )
    return outcome, result.seconds


__all__ = ["EpochProtocol", "FitOutcome", "fit_one_member", "fit_prefix"]
