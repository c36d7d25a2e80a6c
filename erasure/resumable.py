"""Fits that can stop and resume: the state a long fit hands out at its step boundaries, and where it goes.

A fit that takes a ``progress`` (QLEACE's) starts from ``progress.restore()`` when that holds a state, and offers its
state after every step (a batch of its moment statistics, the span of the classes, an iteration of its barycenter).
The keeper of the progress decides whether and when to write it (the data module: every few seconds and on SIGTERM,
datamodules.fit_progress); a resumed fit gives the bits of an uninterrupted one. Here only the state's shape: flat
dicts of tensors (safetensors-ready), their keys prefixed by the step they belong to.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from erasure.moments import MomentAccumulator

State = dict[str, Tensor]


class FitProgress(Protocol):
    """Where a resumable fit's state lives between processes."""

    def restore(self) -> State | None:
        """The state offered last by an earlier, stopped fit of the same data and options, or None."""

    def offer(self, state: Callable[[], State], stable: bool) -> None:
        """Called at every step boundary with the fit's state as of that boundary (``state()`` makes it). ``stable``:
        the fit does not change the tensors of that state afterwards, so it may be written later, e.g. from another
        thread; otherwise only now, before this call returns. May raise to stop the fit (a preemption)."""


def with_prefix(prefix: str, state: State) -> State:
    return {f"{prefix}.{name}": tensor for name, tensor in state.items()}


def part(prefix: str, state: State) -> State:
    """The entries of ``state`` under ``prefix``, without it (empty when none is)."""
    start = f"{prefix}."
    return {name[len(start) :]: tensor for name, tensor in state.items() if name.startswith(start)}


def accumulate_class_moments(
    x: Tensor,
    y: Tensor,
    num_classes: int,
    batch_size: int,
    progress: FitProgress | None,
    restored: State | None,
    dtype: torch.dtype = torch.float64,
) -> MomentAccumulator:
    """``class_moments``' pass in ``dtype`` (float64 unless asked) over ``x`` (n, d), resumed from the ``moments.`` part of ``restored`` (the
    rows it had taken are skipped), offering the running sums to ``progress`` after every batch. Not finished: the
    caller ``finish``\\ es it (the same bits as ``class_moments``)."""
    accumulator = MomentAccumulator(num_classes, x.shape[1], x.device, dtype)
    saved = part("moments", restored or {})
    if saved:
        accumulator.load_state_dict({k: v.to(x.device) for k, v in saved.items()})
    for start in range(accumulator.rows, x.shape[0], batch_size):
        accumulator.add(x[start : start + batch_size], y[start : start + batch_size])
        if progress is not None:
            progress.offer(lambda: with_prefix("moments", accumulator.state_dict()), stable=False)
    return accumulator
