"""The control for the paper's Figure 1: remove a random subspace of a chosen rank.

x -> m + (I - U U^T)(x - m) with U a seeded, uniformly random orthonormal (d, r) basis (QR of a
Gaussian matrix) and m the data mean: an edit of rank r with no relation to the classes.
Label-free. To match another eraser's edit rank (the paper's Figure 1 matches ALF-QLEACE), pass
its rank (``rank=eraser.edit_rank``); in a run, ``eraser.options.rank_from=alf_qleace`` has the
data module fit that eraser on the same data and pass its rank (datamodules.datamodule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.linalg import random_orthonormal


@register_eraser("random")
@dataclass(frozen=True)
class RandomProjectionEraser(Eraser):
    mean: Tensor  # (d,)
    directions: Tensor  # (d, r) orthonormal
    dim: int
    num_classes: int
    rank: int
    seed: int

    @classmethod
    def fit(
        cls, x: Tensor, y: Tensor, num_classes: int, rank: int | None = None, seed: int = 0
    ) -> "RandomProjectionEraser":
        """rank None -> 2k - 1 (our arbitrary default: LEACE's k - 1 directions plus k). It is not the
        ALF-QLEACE edit rank, which depends on the data (28 on digits, where 2k - 1 = 19)."""
        d = x.shape[1]
        rank = 2 * num_classes - 1 if rank is None else int(rank)
        if not 0 <= rank <= d:
            raise ValueError(f"rank must lie in [0, {d}] (the number of features), got {rank}")
        mean = (x.sum(0, dtype=torch.float64) / x.shape[0]).cpu()
        return cls(
            mean=mean,
            directions=random_orthonormal(d, rank, torch.Generator(device="cpu").manual_seed(seed)),
            dim=d,
            num_classes=num_classes,
            rank=rank,
            seed=int(seed),
        )

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        mean, dirs = self.mean.to(x.device), self.directions.to(x.device)
        centred = x.to(torch.float64) - mean
        return mean + centred - (centred @ dirs) @ dirs.T
