"""Batches for a stack of models, each drawing from its own prefix of a training set.

Member m trains on train[:n_m]. Its epoch e is a shuffle ``randperm(n_m)`` (with ``class_balance``,
n_m class-balanced draws with replacement) and crop/flip draws from its own generator, seeded by its seed and e
alone (datamodules.loader ``epoch_generator``), so a member sees the batches it sees in a fit of its own. One global
step takes the next batch of every member still training; the batches are padded to a common
batch size with per-example weights 0 where a member's last batch is short.

The loader hands out *groups* of consecutive global steps (at most ``steps_per_group``), each
ending at the latest where some member's epoch ends, so the protocol (validation, early
stopping, members leaving) still acts between steps exactly where it would one step at a
time. A group's batches are gathered from the resident training set with one index, augmented
and (augment-then-erase) erased together: a few large kernels instead of many small ones, and
one Lightning step (whose fixed host cost is about half a millisecond) per group.

Members of several runs packed into one fit (a pack: mdl.engine.driver.train_runs) may each have their own training set
(another eraser, another data seed): ``TrainSource`` is one of them, and a group is gathered, augmented
and erased per source, so a member's batches are what they are with its source alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from datamodules.augment import Augmentation, CropFlip, apply_crop_flip, crop_flip_params
from datamodules.loader import BatchTransform, class_balanced_weights, epoch_generator, epoch_order


@dataclass
class TrainSource:
    """One training set members draw from: its examples, labels and (augment-then-erase) batch eraser."""

    x: Tensor
    y: Tensor
    transform: BatchTransform | None = None


@dataclass(frozen=True)
class Pacing:
    """How the steps are cut up for Lightning; changes no number, only how often Lightning's fixed host cost is paid
    (conf/mdl/default.yaml: mdl.steps_per_group, mdl.min_steps_per_pass)."""

    steps_per_group: int = 1  # most optimizer steps per Lightning training step
    min_steps_per_pass: int = 1  # least steps per pass (Lightning's epoch), in whole epochs of the longest member

    def __post_init__(self) -> None:
        for key, value in vars(self).items():
            if value < 1:
                raise ValueError(f"mdl.{key} must be >= 1, got {value}")


@dataclass
class StackedBatch:
    """G consecutive steps' batches: x (G, M, B, ...), y (G, M, B), weight (G, M, B) 1 for real
    examples, 0 for padding."""

    x: Tensor
    y: Tensor
    weight: Tensor
    members: list[int]  # which member each row of the stack belongs to

    @property
    def steps(self) -> int:
        return self.x.shape[0]

    def to(self, device: torch.device) -> StackedBatch:
        return StackedBatch(self.x.to(device), self.y.to(device), self.weight.to(device), self.members)


class MemberStream:
    """One member's endless sequence of epochs over train[:n]."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        augment: bool,
        pads: tuple[int, int],
        flip: bool,
        weights: Tensor | None = None,
        shuffle: bool = True,
        per_batch: bool = False,
    ):
        """``shuffle`` False: every epoch the prefix in its order; ``per_batch``: one crop and flip per batch (both
        protocol=original, ``mdl.engine.protocol.LoopRules``)."""
        self.n, self.batch_size, self.seed, self.device = n, batch_size, seed, device
        self.weights = weights  # class-balanced sampling weights of the prefix (data.balance=rwy), or None
        self.augment, self.pads, self.flip = augment, pads, flip
        self.shuffle, self.per_batch = shuffle, per_batch
        self.steps_per_epoch = -(-n // batch_size)
        self.epoch, self.step = 0, 0  # the next batch to draw
        self._start_epoch()

    def _start_epoch(self) -> None:
        """This epoch's shuffle, laid out as (steps, batch_size) rows padded with example 0."""
        self.generator = epoch_generator(self.seed, self.epoch, self.device)
        order = (
            epoch_order(self.n, self.generator, self.device, self.weights)
            if self.shuffle
            else torch.arange(self.n, device=self.device)
        )
        padded = self.steps_per_epoch * self.batch_size
        self.rows = torch.zeros(padded, dtype=torch.long, device=self.device)
        self.rows[: self.n] = order
        self.rows = self.rows.view(self.steps_per_epoch, self.batch_size)
        self.valid = (
            (torch.arange(padded, device=self.device) < self.n).float().view(self.steps_per_epoch, self.batch_size)
        )
        self.crops = None  # the epoch's crop/flip draws, laid out as the rows
        if self.augment and self.per_batch:  # one draw per batch, for each of its images
            drawn = crop_flip_params(self.steps_per_epoch, *self.pads, self.flip, self.generator, self.device)
            shape = (self.steps_per_epoch, self.batch_size)
            self.crops = CropFlip(*(t[:, None].expand(shape) for t in (drawn.dy, drawn.dx, drawn.flip)))
        elif self.augment:
            drawn = _pad(crop_flip_params(self.n, *self.pads, self.flip, self.generator, self.device), padded)
            self.crops = CropFlip(
                *(t.view(self.steps_per_epoch, self.batch_size) for t in (drawn.dy, drawn.dx, drawn.flip))
            )

    def next(self) -> tuple[Tensor, Tensor, CropFlip | None]:
        """The next batch's padded indices, its weights and crop/flip draws (views: no kernel per
        member and step); then the next epoch."""
        rows, valid = self.rows[self.step], self.valid[self.step]
        params = None if self.crops is None else self.crops.rows(self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._start_epoch()
        return rows, valid, params

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to (epoch, step): regenerate that epoch's shuffle and augmentation draws."""
        self.epoch = state["epoch"]
        self._start_epoch()
        self.step = state["step"]


class StackedBatches:
    """An iterable of ``StackedBatch`` groups: ``steps_per_pass`` global steps per iteration (Lightning's
    epoch), in groups of at most ``steps_per_group`` steps that never run past a member's epoch end. A pass is
    the fewest whole epochs of the longest member that hold ``min_steps_per_pass`` steps: Lightning's fixed cost
    per epoch (about a millisecond of host time) is then paid once per pass, not once per epoch of a small prefix.
    ``end_pass_early`` (asked at the longest member's epoch ends) ends a pass there: a SIGTERM's checkpoint then
    waits for one of its epochs, not a whole pass.

    Members leave with ``remove``; their streams stop being drawn. ``state_dict`` holds every
    member's position, so a resumed fit draws the batches an uninterrupted one would.
    """

    def __init__(
        self,
        sources: Sequence[TrainSource],
        prefixes: list[int],
        batch_size: int,
        seeds: int | list[int] = 0,
        augment: Augmentation | None = None,
        pacing: Pacing = Pacing(),
        class_balance: int | None = None,
        member_ids: list[int] | None = None,
        source_of: list[int] | None = None,
        reshuffle: bool = True,
    ) -> None:
        """``reshuffle`` False: every epoch each prefix in its order (protocol=original). ``sources``: the training sets members draw from (of one shape), each prefix from ``source_of``'s (index
        into ``sources``; default: every member from the first); ``member_ids``: each prefix's member id (default
        0, 1, ...), e.g. a run's block indices; ``seeds``: each prefix's batch-order seed (one int: the same for all,
        the members of one run; packed runs each have theirs); ``augment``: the crop and flip (None: none)."""
        self.sources = list(sources)
        x, y = self.sources[0].x, self.sources[0].y
        source_of = [0] * len(prefixes) if source_of is None else list(source_of)
        if len(source_of) != len(prefixes) or any(not 0 <= s < len(self.sources) for s in source_of):
            raise ValueError(
                f"source_of {source_of}: one source in 0..{len(self.sources) - 1} for each of the {len(prefixes)} prefixes"
            )
        if any(s.x.shape[1:] != x.shape[1:] for s in self.sources):
            raise ValueError(f"training sets of shapes {[tuple(s.x.shape) for s in self.sources]} cannot share a stack")
        if any(not 0 < n <= self.sources[s].x.shape[0] for n, s in zip(prefixes, source_of)):
            raise ValueError(f"prefixes {prefixes} must lie in 1..{x.shape[0]}")
        if augment is not None and x.ndim != 4:
            raise ValueError(
                f"augmentation needs images (n, c, h, w), got shape {tuple(x.shape)}; set data.augment=false"
            )
        if class_balance is not None and not reshuffle:
            raise ValueError(
                "class-balanced sampling (data.balance=rwy) draws every epoch anew: not with protocol.reshuffle=false"
            )
        self.x, self.y, self.batch_size, self.steps_per_group = x, y, batch_size, pacing.steps_per_group
        self.pad_mode = augment.pad_mode if augment is not None else "constant"
        self.pads = pads = augment.pads(x) if augment is not None else (0, 0)
        flip = augment is not None and augment.flip

        def weights(n: int, source: int) -> Tensor | None:  # each member balances the classes of its own prefix
            return (
                class_balanced_weights(self.sources[source].y[:n], class_balance) if class_balance is not None else None
            )

        ids = list(range(len(prefixes))) if member_ids is None else list(member_ids)
        if len(ids) != len(prefixes) or len(set(ids)) != len(ids):
            raise ValueError(f"member ids {ids} must name each of the {len(prefixes)} prefixes once")
        seeds = [seeds] * len(prefixes) if isinstance(seeds, int) else list(seeds)
        if len(seeds) != len(prefixes):
            raise ValueError(f"{len(seeds)} batch-order seeds for {len(prefixes)} prefixes")
        self.streams = {
            m: MemberStream(
                n,
                batch_size,
                s,
                x.device,
                augment is not None,
                pads,
                flip,
                weights(n, source),
                reshuffle,
                augment is not None and augment.per_batch,
            )
            for m, n, s, source in zip(ids, prefixes, seeds, source_of)
        }
        self.source_of = dict(zip(ids, source_of))
        self.longest = max(s.steps_per_epoch for s in self.streams.values())
        self.steps_per_pass = self.longest * -(-pacing.min_steps_per_pass // self.longest)  # its whole epochs
        self.end_pass_early: Callable[[], bool] = lambda: False  # asked at each of its epoch ends (the engine: SIGTERM)

    @property
    def active(self) -> list[int]:
        return list(self.streams)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def remove(self, member: int) -> None:
        self.streams.pop(member, None)

    def __len__(self) -> int:
        """An upper bound (every group one step): Lightning ends the pass when the iterator does."""
        return self.steps_per_pass

    def __iter__(self) -> Iterator[StackedBatch]:
        left = self.steps_per_pass
        while left > 0 and self.streams:
            group = self.next(min(left, self.steps_per_group, self.steps_to_next_epoch_end()))
            left -= group.steps
            yield group  # trained and validated when the loop asks for the next one
            if left and (self.steps_per_pass - left) % self.longest == 0 and self.end_pass_early():
                return

    def steps_to_next_epoch_end(self) -> int:
        """Global steps until the first active member finishes an epoch (a group must end there)."""
        return min(s.steps_per_epoch - s.step for s in self.streams.values())

    def next(self, steps: int = 1) -> StackedBatch:
        """The next ``steps`` global steps of every active member, as one gathered, augmented, erased group."""
        members = self.active
        draws = [[self.streams[m].next() for m in members] for _ in range(steps)]  # [step][member]
        shape = (steps, len(members), self.batch_size)
        index = torch.stack([rows for step in draws for rows, _, _ in step]).view(shape)
        weight = torch.stack([valid for step in draws for _, valid, _ in step]).view(shape)
        crops = None
        if draws[0][0][2] is not None:
            crops = CropFlip(
                *(torch.cat([getattr(p, f) for step in draws for _, _, p in step]) for f in ("dy", "dx", "flip"))
            )
        by_source: dict[int, list[int]] = {}
        for j, m in enumerate(members):
            by_source.setdefault(self.source_of[m], []).append(j)
        if len(by_source) == 1:  # one training set: one gather for the whole group
            xb, yb = self._gather(self.sources[self.source_of[members[0]]], index, crops)
        else:  # each source's rows gathered, augmented and erased as they would be alone, then put in place
            xb = yb = None
            for source, rows in by_source.items():
                picked = torch.tensor(rows, device=index.device)
                part = (
                    None
                    if crops is None
                    else CropFlip(*(t.view(shape)[:, picked].flatten() for t in (crops.dy, crops.dx, crops.flip)))
                )
                xs, ys = self._gather(self.sources[source], index[:, picked], part)
                if xb is None:
                    xb, yb = xs.new_empty(*shape, *xs.shape[3:]), ys.new_empty(shape)
                xb[:, picked], yb[:, picked] = xs, ys
        return StackedBatch(xb, yb, weight, members)

    def _gather(self, source: TrainSource, index: Tensor, crops: CropFlip | None) -> tuple[Tensor, Tensor]:
        """One source's examples at ``index`` (G, M, B), augmented with ``crops`` and erased: x (G, M, B, ...), y."""
        flat = index.flatten()
        xb, yb = source.x[flat], source.y[flat]
        if crops is not None:
            xb = apply_crop_flip(xb, crops, *self.pads, self.pad_mode)
        if source.transform is not None:
            xb = source.transform(xb, yb)
        return xb.view(*index.shape, *xb.shape[1:]), yb.view(index.shape)

    def state_dict(self) -> dict[str, Any]:
        return {m: s.state_dict() for m, s in self.streams.items()}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        """Keep the members in ``state`` (the others had left) at their saved positions."""
        kept = {int(m) for m in state}
        for m in list(self.streams):
            if m not in kept:
                self.remove(m)
        for m, s in state.items():
            self.streams[int(m)].load_state_dict(s)


def _pad(params: CropFlip, size: int) -> CropFlip:
    """Crop/flip draws padded with no-ops (offset 0, no flip) to ``size`` rows."""
    missing = size - params.dy.shape[0]
    if missing == 0:
        return params
    return CropFlip(*(torch.cat([t, t.new_zeros(missing)]) for t in (params.dy, params.dx, params.flip)))
