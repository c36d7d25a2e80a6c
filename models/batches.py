"""What the LightningModules need of a batch that is more than one (x, y) pair.

The data side (``datamodules.loader.BatchGroup``, ``datamodules.stacked_batches.StackedBatch``)
builds them; models only say what they read, so models import nothing from datamodules (docs/architecture.md's
layers: mdl -> (models, datamodules) -> erasure).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class StepGroup(Protocol):
    """Consecutive (x, y) batches of one epoch, trained in one Lightning step (models.manual_steps)."""

    batches: list[tuple[Tensor, Tensor]]

    def to(self, device: torch.device) -> StepGroup: ...


@runtime_checkable
class MemberBatches(Protocol):
    """G consecutive steps' batches of M stacked members: x (G, M, B, ...), y and weight (G, M, B), weight 1
    for a real example and 0 for padding; ``members`` names the member of each row."""

    x: Tensor
    y: Tensor
    weight: Tensor
    members: list[int]

    @property
    def steps(self) -> int: ...

    def to(self, device: torch.device) -> MemberBatches: ...
