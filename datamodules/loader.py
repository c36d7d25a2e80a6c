"""Batches over tensors resident on the training device: an epoch's order and generator, and evaluation batches.

No worker processes and no per-batch host traffic: the whole split lives on one device, the
shuffle is a ``randperm`` on that device (``epoch_order``) and random crops and flips are drawn from a generator on
that device (``epoch_generator``), a whole epoch's at once (the airbench recipe; the training batches:
``datamodules.stacked_batches``). The shuffle and augmentation of epoch e depend only on (seed, e), so a resumed run
sees exactly the batches an uninterrupted one would (on the same kind of device: CPU and CUDA generators give
different streams).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import Tensor


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


class EvalBatches:
    """Iterable of (x, y) batches, in order, over tensors already on their device: a split to evaluate (validation,
    test, a prequential block). ``transform(x, y)``, if given, runs on every batch (augment-then-erase's eraser).
    The training batches are ``datamodules.stacked_batches.StackedBatches``'."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, transform: BatchTransform | None = None) -> None:
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x and y disagree on the number of examples: {x.shape[0]} vs {y.shape[0]}")
        if x.device != y.device:
            raise ValueError(f"x and y must live on one device, got {x.device} and {y.device}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.batch_size, self.transform = x, y, batch_size, transform

    @property
    def device(self) -> torch.device:
        return self.x.device

    def __len__(self) -> int:
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, self.x.shape[0], self.batch_size):
            xb, yb = self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]
            yield (xb if self.transform is None else self.transform(xb, yb)), yb
