"""muP bookkeeping through the mup library: base shapes, re-initialisation, optimizer groups.

Pitfalls handled here (DESIGN.md): ``set_base_shapes`` right after construction; hidden weights
re-initialised afterwards with variance 1/fan_in (timm's fixed-std init is not muP); the readout
must be ``MuReadout`` (zero-initialised); ``copy.deepcopy`` drops ``infshape``, so copies must
call ``restore_base_shapes``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from mup import MuReadout, set_base_shapes
from mup.shape import get_infshapes, apply_infshapes
from torch import nn


def apply_mup(model: nn.Module, base: nn.Module, delta: nn.Module) -> nn.Module:
    if not any(isinstance(m, MuReadout) for m in model.modules()):
        raise TypeError(f"{type(model).__name__} has no mup.MuReadout head; muP needs one (see models/mlp.py)")
    set_base_shapes(model, base, delta=delta)
    reinit_mup(model)
    model._mup_infshapes = get_infshapes(model)  # type: ignore[attr-defined]
    return model


def restore_base_shapes(model: nn.Module) -> nn.Module:
    """Re-attach ``infshape`` to every parameter (after deepcopy or loading into a fresh copy)."""
    infshapes = getattr(model, "_mup_infshapes", None)
    if infshapes is None:
        raise ValueError("model was not built with muP (no recorded base shapes)")
    apply_infshapes(model, infshapes)
    return model


@torch.no_grad()
def reinit_mup(model: nn.Module) -> None:
    """Hidden and input layers: N(0, 1/fan_in) truncated at 2 std; biases 0; readout 0.

    With fan_in proportional to width for hidden layers this is the muP initialisation; input
    layers have a fixed fan_in and so keep O(1) variance.
    """
    for module in model.modules():
        if isinstance(module, MuReadout):
            nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            fan_in = module.weight[0].numel()  # in_features (x kernel size; depthwise: kernel only)
            std = 1.0 / math.sqrt(max(fan_in, 1))
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def mup_param_groups(params: Iterable[nn.Parameter], lr: float) -> list[dict[str, Any]]:
    """Adam-style muP: matrix-like parameters get lr / width_mult, everything else lr.

    Works for any Adam-like optimizer (schedule-free AdamW included), which is why it is done
    here instead of through ``mup.MuAdamW``.
    """
    groups: dict[float, list[nn.Parameter]] = {}
    vector_like: list[nn.Parameter] = []
    for p in params:
        if not p.requires_grad:
            continue
        infshape = getattr(p, "infshape", None)
        if infshape is None:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} has no infshape: muP base shapes were lost "
                f"(deepcopy?); call models.restore_base_shapes(model)"
            )
        if infshape.ninf() == 2:
            groups.setdefault(infshape.width_mult(), []).append(p)
        elif infshape.ninf() > 2:
            raise NotImplementedError(f"parameter {tuple(p.shape)} has more than 2 infinite dimensions")
        else:
            vector_like.append(p)
    out = [{"params": ps, "lr": lr / mult, "width_mult": mult} for mult, ps in sorted(groups.items())]
    if vector_like:
        out.append({"params": vector_like, "lr": lr, "width_mult": 1.0})
    return out


def depth_scaled_lr(lr: float, depth: int, base_depth: int, exponent: float) -> float:
    """The paper's depth transfer: lr * (base_depth / depth) ** exponent."""
    return lr * (base_depth / depth) ** exponent


OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
