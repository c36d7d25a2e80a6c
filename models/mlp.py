"""The paper's MLP: Linear(d, h)-act, (depth - 1) x [Linear(h, h)-act], MuReadout(h, K).

Activations relu, gelu and swiglu. SwiGLU is the real gated unit, swish(x W_g) * (x V), so each
gated layer holds two weight matrices; its hidden size h' is chosen so that the whole network
has (as nearly as an integer allows) the parameter count of the relu/gelu MLP at the same width
and depth (``swiglu_width``): about h / 2 at depth 1, where the input layer dominates, tending to
h / sqrt(2) as depth grows.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from mup import MuReadout
from torch import Tensor, nn

from models import stacked_ops
from models.registry import register_model

ACTIVATIONS = ("relu", "gelu", "swiglu")


class SwiGLU(nn.Module):
    """swish(x W_g) * (x V): one fused Linear producing gate and value halves."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 2 * out_features)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.proj(x).chunk(2, dim=-1)
        return F.silu(gate) * value


def mlp_param_count(in_features: int, width: int, depth: int, num_classes: int) -> int:
    """Parameters (weights and biases) of the relu/gelu MLP."""
    return (in_features + 1) * width + (depth - 1) * (width + 1) * width + (width + 1) * num_classes


def swiglu_param_count(in_features: int, hidden: int, depth: int, num_classes: int) -> int:
    return 2 * (in_features + 1) * hidden + (depth - 1) * 2 * (hidden + 1) * hidden + (hidden + 1) * num_classes


def swiglu_width(width: int, depth: int = 2, in_features: int | None = None, num_classes: int = 10) -> int:
    """Hidden size of the SwiGLU MLP whose parameter count is closest to the relu MLP's.

    Solves 2(depth-1) h^2 + (2(d+1) + 2(depth-1) + K) h + K = target for h and keeps the better
    of the two neighbouring integers. Without ``in_features`` only hidden layers are matched
    (h / sqrt(2)).
    """
    if in_features is None:
        return max(1, int(round(width / math.sqrt(2))))
    target = mlp_param_count(in_features, width, depth, num_classes)
    a = 2 * (depth - 1)
    b = 2 * (in_features + 1) + 2 * (depth - 1) + num_classes
    c = num_classes - target
    root = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    candidates = {max(1, math.floor(root)), max(1, math.ceil(root))}
    return min(candidates, key=lambda h: (abs(swiglu_param_count(in_features, h, depth, num_classes) - target), h))


class MLP(nn.Module):
    # A member's bits do not depend on how many members share its batched matmuls (tests/test_pack.py: packs in one
    # fit equal their runs alone), so on a GPU a pack runs its runs' members as one stack (models.stacking).
    stack_size_independent = True

    def __init__(self, in_features: int, width: int, depth: int, num_classes: int, activation: str = "relu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; choose one of {ACTIVATIONS} (model.options.activation)"
            )
        layers: list[nn.Module] = []
        hidden = swiglu_width(width, depth, in_features, num_classes) if activation == "swiglu" else width
        dims = [in_features] + [hidden] * depth
        act = {"relu": nn.ReLU, "gelu": nn.GELU}.get(activation)  # None: SwiGLU, whose gate is its activation
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [SwiGLU(a, b)] if act is None else [nn.Linear(a, b), act()]
        self.body = nn.Sequential(*layers)
        self.head = MuReadout(dims[-1], num_classes, readout_zero_init=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x.flatten(1)))

    def forward_stacked(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        """M members at once, x (M, B, ...) -> (M, B, K), as batched matmuls: the faster form that
        models.stacking uses instead of vmap (about 25% less time per step on a CPU)."""

        h = x.flatten(2)
        for i, layer in enumerate(self.body):
            if isinstance(layer, nn.Linear):
                h = stacked_ops.linear(params, f"body.{i}", h)
            elif isinstance(layer, SwiGLU):
                gate, value = stacked_ops.linear(params, f"body.{i}.proj", h).chunk(2, dim=-1)
                h = F.silu(gate) * value
            else:
                h = layer(h)  # the activation
        return stacked_ops.mu_readout(self.head, params, "head", h)


@register_model("mlp")
def build_mlp(
    width: int, depth: int, num_classes: int, input_shape: tuple[int, ...], activation: str = "relu", **options: Any
) -> MLP:
    if options:
        raise ValueError(f"unknown MLP options {sorted(options)}; the MLP takes `activation`")
    return MLP(math.prod(input_shape), width, depth, num_classes, activation)
