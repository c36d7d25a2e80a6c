"""A batch iterator over tensors resident on the training device, with augmentation on the batch.

No worker processes and no per-batch host traffic: the whole split lives on one device, the
shuffle is a ``randperm`` on that device, batches are gathered by index, and random crops and
flips (``datamodules.augment``) are drawn from a generator on that device, a whole epoch's
at once, and applied to each batch where it lives (the airbench recipe). The shuffle and
augmentation of epoch e depend only on (seed, e), so a resumed run sees exactly the batches an
uninterrupted one would (on the same kind of device: CPU and CUDA generators give different
streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from datamodules.augment import Augmentation, apply_crop_flip, crop_flip_params

BatchTransform = Callable[[Tensor, Tensor], Tensor]


def class_balanced_weights(y: Tensor, num_classes: int) -> Tensor:
    """Per example, 1 / (the count of its class in ``y``): draws with these probabilities are
    class-balanced in expectation (RWY, gradient-starvation thesis Sec. 8.4). On y's device, no host read."""
    counts = torch.zeros(num_classes, dtype=torch.float64, device=y.device)
    counts.index_add_(0, y, torch.ones(y.shape[0], dtype=torch.float64, device=y.device))
    return 1.0 / counts[y]


def epoch_order(
    n: int, generator: torch.Generator | None, device: torch.device, weights: Tensor | None = None
) -> Tensor:
    """An epoch's n example indices into a prefix of n: a permutation, or with ``weights`` (RWY) n
    draws with replacement, example i with probability proportional to weights[i]. Both kinds of fit
    draw an epoch through this one function, from the epoch's own generator."""
    if weights is None:
        return torch.randperm(n, generator=generator, device=device)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


def epoch_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    """The generator of one epoch's shuffle and augmentation: a function of (seed, epoch) alone."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + epoch)
    return g


class DeviceBatches:
    """Iterable of (x, y) batches over tensors already on their device.

    ``set_epoch(e)`` (called by the training module each epoch) fixes the shuffle and the
    augmentation of that epoch. ``augment``: the crop and flip of every batch (None: none);
    ``augment_per_batch``: one crop offset and one flip per batch, as torchvision v2 transforms draw
    them for a batch tensor (the original code, experiments/cli.py@0cc7065). ``transform(x, y)``, if
    given, runs on every batch after the augmentation (augment-then-erase applies the eraser here). ``class_balance`` (the number of
    classes; shuffled loaders only) replaces the shuffle by class-balanced draws with replacement,
    redrawn every epoch (``data.balance=rwy``): the data itself, and so the blocks a prequential
    run scores, hold no copies.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        batch_size: int,
        shuffle: bool = False,
        augment: Augmentation | None = None,
        seed: int = 0,
        drop_last: bool = False,
        transform: BatchTransform | None = None,
        class_balance: int | None = None,
        augment_per_batch: bool = False,
    ) -> None:
        if class_balance is not None and not shuffle:
            raise ValueError("class-balanced sampling (data.balance=rwy) applies to shuffled training batches only")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x and y disagree on the number of examples: {x.shape[0]} vs {y.shape[0]}")
        if x.device != y.device:
            raise ValueError(f"x and y must live on one device, got {x.device} and {y.device}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if augment is not None and x.ndim != 4:
            raise ValueError(
                f"augmentation needs images (n, c, h, w), got shape {tuple(x.shape)}; set data.augment=false"
            )
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.shuffle, self.augment = shuffle, augment
        self.augment_per_batch = augment_per_batch  # one crop offset and one flip for a whole batch (protocol=original)
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.transform = transform
        self.pad_h, self.pad_w = augment.pads(x) if augment is not None else (0, 0)
        self.sample_weights = class_balanced_weights(y, class_balance) if class_balance is not None else None

    @property
    def device(self) -> torch.device:
        return self.x.device

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = self.x.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n = self.x.shape[0]
        augment = self.augment
        g = epoch_generator(self.seed, self.epoch, self.x.device) if (self.shuffle or augment is not None) else None
        order = epoch_order(n, g, self.x.device, self.sample_weights) if self.shuffle else None
        # the epoch's crops and flips in one draw, after its shuffle; batch b takes rows b*B.. of it
        draws = len(self) if self.augment_per_batch else n
        crops = (
            crop_flip_params(draws, self.pad_h, self.pad_w, augment.flip, g, self.x.device)
            if augment is not None
            else None
        )
        for b in range(len(self)):
            sl = slice(b * self.batch_size, min((b + 1) * self.batch_size, n))
            if order is None:
                xb, yb = self.x[sl], self.y[sl]
            else:
                idx = order[sl]
                xb, yb = self.x[idx], self.y[idx]
            if crops is not None:
                rows = crops.batch(b, xb.shape[0]) if self.augment_per_batch else crops.rows(sl)
                xb = apply_crop_flip(xb, rows, self.pad_h, self.pad_w, augment.pad_mode)
            if self.transform is not None:
                xb = self.transform(xb, yb)
            yield xb, yb


@dataclass
class BatchGroup:
    """Consecutive (x, y) batches of one epoch, trained in one Lightning step (models.manual_steps)."""

    batches: list[tuple[Tensor, Tensor]]

    @property
    def steps(self) -> int:
        return len(self.batches)

    def to(self, device: torch.device) -> BatchGroup:
        return BatchGroup([(x.to(device), y.to(device)) for x, y in self.batches])


class GroupedBatches:
    """A ``DeviceBatches`` handed out in groups of at most ``steps_per_group`` consecutive batches.

    The batches are exactly the inner loader's (same shuffle, augmentation and erasure, taken one
    by one); only the number of Lightning steps per epoch shrinks. A group never spans two epochs.
    """

    def __init__(self, batches: DeviceBatches, steps_per_group: int) -> None:
        if steps_per_group < 1:
            raise ValueError(f"mdl.steps_per_group must be >= 1, got {steps_per_group}")
        self.batches, self.steps_per_group = batches, steps_per_group

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-len(self.batches) // self.steps_per_group)

    def __iter__(self) -> Iterator[BatchGroup]:
        group: list[tuple[Tensor, Tensor]] = []
        for batch in self.batches:
            group.append(batch)
            if len(group) == self.steps_per_group:
                yield BatchGroup(group)
                group = []
        if group:
            yield BatchGroup(group)
