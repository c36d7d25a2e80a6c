"""The control condition: no erasure, same interface."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from erasure.base import Eraser, register_eraser


@register_eraser("none")
@dataclass(frozen=True)
class NoErasure(Eraser):
    dim: int
    num_classes: int

    @classmethod
    def fit(cls, x: Tensor, y: Tensor, num_classes: int) -> "NoErasure":
        return cls(dim=x.shape[1], num_classes=num_classes)

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        return x.clone()
