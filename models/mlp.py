"""The paper's MLP: Linear(d, h)-act, (depth - 1) x [Linear(h, h)-act], MuReadout(h, K)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from mup import MuReadout
from torch import Tensor, nn

from models.registry import register_model

ACTIVATIONS = ("relu", "gelu", "swiglu")


class SwiGLU(nn.Module):
    """swish(x W_g) * (x W_v): one fused Linear producing gate and value halves."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 2 * out_features)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.proj(x).chunk(2, dim=-1)
        return F.silu(gate) * value


def swiglu_width(width: int) -> int:
    """A gated layer h -> 2h' has 2h'^2 weights; h' = h / sqrt(2) matches Linear(h, h)'s h^2."""
    return max(1, int(round(width / math.sqrt(2))))


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, num_classes: int, activation: str = "relu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {ACTIVATIONS}")
        layers: list[nn.Module] = []
        if activation == "swiglu":
            hidden = swiglu_width(width)
            dims = [in_features] + [hidden] * depth
            for a, b in zip(dims[:-1], dims[1:]):
                layers.append(SwiGLU(a, b))
        else:
            act = nn.ReLU if activation == "relu" else nn.GELU
            dims = [in_features] + [width] * depth
            for a, b in zip(dims[:-1], dims[1:]):
                layers += [nn.Linear(a, b), act()]
        self.body = nn.Sequential(*layers)
        self.head = MuReadout(dims[-1], num_classes, readout_zero_init=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x.flatten(1)))


@register_model("mlp")
def build_mlp(width: int, depth: int, num_classes: int, input_shape: tuple[int, ...], activation: str = "relu", **options: Any) -> MLP:
    if options:
        raise ValueError(f"unknown MLP options {sorted(options)}; the MLP takes `activation`")
    return MLP(math.prod(input_shape), width, depth, num_classes, activation)
