"""What the LightningModule needs of a training batch: the stacked members' batches of a group of steps.

The data side (``datamodules.stacked_batches.StackedBatch``) builds them; models only say what they read, so models import nothing from datamodules (docs/architecture.md's
layers: mdl -> (models, datamodules) -> erasure).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


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
