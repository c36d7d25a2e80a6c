"""The LightningModule of a stacked fit: every member of a prequential run trained at once.

One optimizer step takes each member's own batch (rows of a stacked batch, ``models.batches.MemberBatches``), and the loss is
the sum over members of each member's mean cross-entropy, so each member's gradient is exactly
the gradient of its own loss. One Lightning training step runs a whole group of such steps
(manual optimization), so the half millisecond of host work Lightning spends per training step
is paid once per group (models.manual_steps); ``trainer.global_step`` does not count these
steps (the protocol counts each member's steps itself). Adam-like optimizers act elementwise, so one optimizer over the
stacked parameters is M independent optimizers (schedule-free's step count, warm-up and
averaging weights are per group and equal for members that all step together).

Members are validated with their schedule-free evaluation weights x = lerp(y, z, 1 - 1/beta1),
computed out of place for the members asked for (the optimizer stays in train mode), and leave
the stack with ``remove``: their parameters and optimizer state are cut out, so they cost nothing
afterwards.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.batches import MemberBatches
from models.losses import SpectralDecoupling, spectral_penalty
from models.manual_steps import StepHooks, optimizer_step
from models.module import OptimizerFactory, optimizer_train_mode, set_optimizer_mode
from models.precision import autocast_context, check_precision
from models.stacking import StackedModel


class StackedClassifier(L.LightningModule):
    def __init__(
        self,
        stack: StackedModel,
        optimizer: OptimizerFactory,
        lr: float,
        precision: str = "fp32",
        loss: SpectralDecoupling | None = None,
        member_ids: list[int] | None = None,
        run_of: dict[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.loss_regulariser = loss  # enters the training objective only (models.losses)
        self.stack = stack
        self.optimizer_factory = optimizer
        self.lr = lr
        self.precision = check_precision(precision)
        # member id of each stack row (e.g. a run's block indices; default 0, 1, ...)
        self.members: list[int] = list(range(stack.num_members)) if member_ids is None else list(member_ids)
        if len(self.members) != stack.num_members:
            raise ValueError(f"{len(self.members)} member ids for a stack of {stack.num_members}")
        # member id -> its run, in a fit of several runs (a pack); each run's rows compute as a stack of their own
        self.run_of = dict(run_of or {})
        # this epoch's loss sums per row; a buffer, so moving the module (.to, .cuda) moves it with the stack
        # (not saved in the state dict: on_save_checkpoint stores it)
        self.register_buffer("train_sums", torch.zeros(stack.num_members, dtype=torch.float64), persistent=False)
        self.automatic_optimization = False  # training_step steps the optimizer once per step of its group
        self.step_hooks = StepHooks()  # the trainer's, from on_train_start

    # --- training -----------------------------------------------------------------------------

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.stack.param_groups(self.lr))

    def on_train_start(self) -> None:
        self.step_hooks = StepHooks(self.trainer, self)
        self.train_sums = self.train_sums.to(self.device)
        for opt in self.trainer.optimizers:
            set_optimizer_mode(opt, train=True)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Batches are built on the training device (device-resident data); Lightning's generic
        transfer would walk and deep-copy the dataclass at every step."""
        if isinstance(batch, MemberBatches):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch: MemberBatches, batch_idx: int) -> None:
        self.train_group(batch, self.optimizers(use_pl_optimizer=False), self.step_hooks)

    def train_group(
        self, batch: MemberBatches, optimizer: torch.optim.Optimizer, hooks: StepHooks | None = None
    ) -> None:
        """One optimizer step per step of the group, each on every active member's own batch."""
        hooks = hooks or StepHooks()
        x, y, w = self._rows_of_active(batch)
        for i in range(batch.steps):
            optimizer_step(self.step_loss(x[i], y[i], w[i]), optimizer, hooks)

    def step_loss(self, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        """The sum over members of each one's mean loss on its batch: x (M, B, ...), y and w (M, B)."""
        with autocast_context(self.precision, x.device.type):
            logits = self.stack(x, self.chunks()).float()
        nats = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(w) * w
        per_member = nats.sum(1)
        self.train_sums.add_(per_member.detach().double())  # the curves stay plain cross-entropy (in place: no setattr)
        if self.loss_regulariser is not None:  # each member's own mean over its real examples
            per_member = per_member + (spectral_penalty(logits, y, self.loss_regulariser) * w).sum(1)
        return (per_member / w.sum(1)).sum()

    def _rows_of_active(self, batch: MemberBatches) -> tuple[Tensor, Tensor, Tensor]:
        """The batch rows of the members still in the stack. Defensive: Lightning 2.6 draws a sized
        loader's next batch only after the last step's callbacks ran, but a loader that prefetched
        would hand over a batch drawn before a member left."""
        if batch.members == self.members:
            return batch.x, batch.y, batch.weight
        rows = torch.tensor([batch.members.index(m) for m in self.members], dtype=torch.long, device=batch.x.device)
        return batch.x[:, rows], batch.y[:, rows], batch.weight[:, rows]

    def chunks(self, rows: list[int] | None = None) -> list[int] | None:
        """Sizes of the consecutive groups of these rows (all: None) that belong to one run, for
        ``StackedModel.run``: in a pack each run's members compute as they do in their run alone (a pack
        stacks runs one after another, so a run's rows are consecutive). None outside packs."""
        if not self.run_of or rows == []:
            return None
        runs = [self.run_of[self.members[r]] for r in (range(len(self.members)) if rows is None else rows)]
        return [len(list(group)) for _, group in itertools.groupby(runs)]

    def take_train_sums(self, rows: list[int]) -> Tensor:
        """The finished epoch's training loss sums of these rows (on the device, not read), reset."""
        sums = self.train_sums[rows]
        self.train_sums[rows] = 0.0
        return sums

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def eval_weights(self, rows: list[int], as_trained: bool = False) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The weights to evaluate for these rows: schedule-free's x, or the parameters themselves (``as_trained``:
        schedule-free's y, ``LoopRules.evaluate_as_trained``)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.stack.stacked[0].device)
        trained = not as_trained and self._trainer is not None and self.trainer.optimizers
        opt = self.trainer.optimizers[0] if trained else None
        params = {name: _eval_weight(opt, p, index) for name, p in self.stack.param_dict().items()}
        buffers = {n: b[index] for n, b in self.stack.buffer_dict().items()}
        return params, buffers

    @torch.no_grad()
    def loss_sums(
        self,
        weights: tuple[dict[str, Tensor], dict[str, Tensor]],
        batches: Any,
        float64: bool = True,
        with_correct: bool = False,
        chunks: list[int] | None = None,
        batch_means: bool = False,
    ) -> tuple[Tensor, int] | tuple[Tensor, int, Tensor]:
        """Per member, the sum of cross-entropies (nats) over ``batches`` (accumulated in float64) and
        the count. ``float64=False`` computes each batch's sum in float32 from float32 logits, as the
        validation of a fit of one member does (so early stopping compares the same numbers).
        ``with_correct``: also each member's count of examples its argmax classifies right (same pass).
        ``chunks``: ``self.chunks(rows)`` of the rows the weights are of (a pack's runs apart). ``batch_means``: each
        batch's float32 mean in bits times its size, summed in float64, as the original added them up
        (``LoopRules.batch_mean_validation``): these sums are in bits (``validation_means`` makes means in nats)."""
        params, buffers = weights
        members = len(next(iter(params.values())))
        total, count, correct = None, 0, None
        for x, y in batches:
            with autocast_context(self.precision, x.device.type):
                logits = self.stack.run(params, buffers, x, shared_input=True, chunks=chunks)
            m = logits.shape[0]
            if with_correct:
                hits = (logits.argmax(-1) == y).sum(1)
                correct = hits if correct is None else correct + hits
            logits = logits.double() if float64 else logits.float()
            if batch_means:  # bits: the original's (cross_entropy / log 2).item() * len (mdl/probe.py@5e66bb9)
                means = torch.stack([F.cross_entropy(row, y) for row in logits])
                nats = (means / math.log(2)).double() * y.shape[0]
            else:
                nats = F.cross_entropy(logits.flatten(0, 1), y.repeat(m), reduction="none").view(m, -1).sum(1).double()
            total = nats if total is None else total + nats
            count += y.shape[0]
        if total is None:
            total = torch.zeros(members, dtype=torch.float64, device=self.train_sums.device)
        if not with_correct:
            return total, count
        return total, count, (torch.zeros_like(total) if correct is None else correct.double())

    @staticmethod
    def validation_means(sums: Tensor, count: int, batch_means: bool = False) -> Tensor:
        """Mean losses in nats from ``loss_sums``' sums (``batch_means``: in bits, the mean then times log 2, as the
        original's)."""
        means = sums / max(count, 1)
        return means * math.log(2) if batch_means else means

    # --- members leaving ----------------------------------------------------------------------

    def remove(self, members: list[int]) -> None:
        """Cut these members out of the stack, the optimizer state and the loss sums."""
        keep = [r for r, m in enumerate(self.members) if m not in members]
        index = torch.tensor(keep, dtype=torch.long, device=self.stack.stacked[0].device)
        replaced = self.stack.keep(index)
        if self._trainer is not None:
            for opt in self.trainer.optimizers:
                _swap_params(opt, replaced, index)
        self.train_sums = self.train_sums[index]
        self.members = [self.members[r] for r in keep]

    # --- checkpoints --------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["stack_members"] = list(self.members)
        checkpoint["stack_train_sums"] = self.train_sums.clone()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Shrink the stack to the saved members before Lightning loads their weights into it."""
        self.members = list(checkpoint["stack_members"])
        self.stack.resize(len(self.members))
        self.train_sums = checkpoint["stack_train_sums"].clone()


def _eval_weight(opt: torch.optim.Optimizer | None, p: Tensor, index: Tensor) -> Tensor:
    if opt is None or not optimizer_train_mode(opt):
        return p.detach()[index]
    state = opt.state.get(p, {})
    if "z" not in state:  # no step taken yet: x = y = z
        return p.detach()[index]
    beta1 = next(g for g in opt.param_groups if any(q is p for q in g["params"]))["betas"][0]
    return torch.lerp(p.detach()[index], state["z"][index], 1 - 1 / beta1)  # schedule-free's eval()


def _swap_params(opt: torch.optim.Optimizer, replaced: dict[nn.Parameter, nn.Parameter], index: Tensor) -> None:
    """Point the optimizer at the shrunk parameters and cut their per-member state the same way."""
    for group in opt.param_groups:
        group["params"] = [replaced.get(p, p) for p in group["params"]]
    for old, new in replaced.items():
        state = opt.state.pop(old, None)
        if state is None:
            continue
        opt.state[new] = {
            k: (v[index].clone() if torch.is_tensor(v) and v.ndim > 0 and v.shape == old.shape else v)
            for k, v in state.items()
        }
