"""muP bookkeeping through the mup library: base shapes, re-initialisation, optimizer groups.

Pitfalls handled here (the mup library's known ones):

- ``set_base_shapes`` right after construction, against base and delta models built at the base
  width and twice it (``models.registry.create_model`` builds them on the meta device, once per
  configuration).
- Hidden weights re-initialised afterwards with variance 1/fan_in: timm initialises with a
  fixed std of 0.02, which is standard parametrisation, not muP (see ``reinit_mup``).
- The readout must be ``mup.MuReadout`` (zero-initialised; it divides its input by width_mult).
- ``copy.deepcopy`` drops the ``infshape`` attribute of every parameter. The base shapes are
  also recorded on the model itself (``_mup_infshapes``, deep-copied with it) and a forward
  pre-hook re-attaches them, so a deep copy just works; ``restore_base_shapes`` does it by hand.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch
from mup import MuReadout, set_base_shapes
from mup.shape import apply_infshapes, get_infshapes
from torch import nn
from torch.nn.modules.conv import _ConvNd

INFSHAPES_ATTR = "_mup_infshapes"


def apply_mup(model: nn.Module, base: nn.Module | dict, delta: nn.Module | dict) -> nn.Module:
    """muP: base shapes from (base, delta) models or their {name: shape} dicts, then muP init."""
    _require_readout(model)
    set_base_shapes(model, base, delta=delta, rescale_params=False)  # reinit_mup sets every variance
    reinit_mup(model)
    _record_infshapes(model)
    return model


def apply_mup_over_builder_init(model: nn.Module, base: nn.Module | dict, delta: nn.Module | dict) -> nn.Module:
    """muP base shapes over the builder's own initialisation (``model.init=original``): nn.Linear's and nn.Conv's
    PyTorch defaults (U(+-1/sqrt(fan_in)), non-zero biases), timm's for ConvNeXt/Swin, the readout zero. The
    original's models were built so (mdl/mlp_probe.py@5e66bb9: nn.Linear layers, MuReadout(readout_zero_init=True),
    set_base_shapes with its default rescale_params=True, which rescales only the zero readout)."""
    _require_readout(model)
    set_base_shapes(model, base, delta=delta)
    _record_infshapes(model)
    return model


INITS = ("mup", "original")  # model.init: muP's variances (ours) | the builder's own (apply_mup_over_builder_init)


def apply_standard(model: nn.Module) -> nn.Module:
    """Standard parametrisation (the control of the coordinate check).

    All dimensions finite (``set_base_shapes(model, None)``, so MuReadout is a plain Linear with
    width_mult 1), the builder's own initialisation kept (PyTorch defaults, timm's std 0.02) and
    the readout given nn.Linear's default initialisation instead of zeros.
    """
    _require_readout(model)
    set_base_shapes(model, None, rescale_params=False)
    for module in model.modules():
        if isinstance(module, MuReadout):
            nn.Linear.reset_parameters(module)
    _record_infshapes(model)
    return model


def _require_readout(model: nn.Module) -> None:
    if not any(isinstance(m, MuReadout) for m in model.modules()):
        raise TypeError(f"{type(model).__name__} has no mup.MuReadout head; muP needs one (see models.mlp)")


def _record_infshapes(model: nn.Module) -> None:
    setattr(model, INFSHAPES_ATTR, get_infshapes(model))
    model.register_forward_pre_hook(_reattach_infshapes_hook)


def _reattach_infshapes_hook(module: nn.Module, args: Any) -> None:
    """After copy.deepcopy the parameters are new objects without ``infshape``: re-attach."""
    first = next(module.parameters(), None)
    if first is not None and not hasattr(first, "infshape"):
        restore_base_shapes(module)


def restore_base_shapes(model: nn.Module) -> nn.Module:
    """Re-attach ``infshape`` to every parameter (after deepcopy or loading into a fresh copy)."""
    infshapes = getattr(model, INFSHAPES_ATTR, None)
    if infshapes is None:
        raise ValueError("model was not built by models.create_model (no recorded muP base shapes)")
    apply_infshapes(model, infshapes)
    return model


def fan_in(weight: torch.Tensor) -> int:
    """Inputs feeding one output unit: in_features, or in_channels / groups x kernel area."""
    return max(int(weight[0].numel()), 1)


@torch.no_grad()
def fast_trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> torch.Tensor:
    """``trunc_normal_(tensor, mean, std, a, b)`` (absolute bounds a, b, timm's signature), by redrawing the (about
    5%) entries outside from the truncated distribution itself: the same distribution as ``nn.init.trunc_normal_``,
    several times faster on large CPU tensors (that one goes through erfinv), which matters for a driver that builds a
    model per block."""
    tensor.normal_(mean, std)
    if tensor.device.type == "meta":
        return tensor
    outside = (tensor < a) | (tensor > b)
    count = int(outside.sum())
    if count:
        redraw = torch.empty(count, dtype=tensor.dtype, device=tensor.device)
        tensor[outside] = nn.init.trunc_normal_(redraw, mean=mean, std=std, a=a, b=b)
    return tensor


@contextlib.contextmanager
def fast_timm_init(*timm_modules: Any) -> Iterator[None]:
    """Let timm constructors use ``fast_trunc_normal_`` (same distribution, a fraction of the time)."""
    saved = [(m, m.trunc_normal_) for m in timm_modules]
    try:
        for m, _ in saved:
            m.trunc_normal_ = fast_trunc_normal_
        yield
    finally:
        for m, original in saved:
            m.trunc_normal_ = original


@torch.no_grad()
def reinit_mup(model: nn.Module) -> None:
    """muP initialisation (Yang et al. 2021, Table 3, Adam): after ``set_base_shapes``.

    - every Linear and Conv weight (hidden, input and depthwise alike): N(0, 1/fan_in) truncated
      at 2 std; hidden layers have fan_in proportional to width, so their variance shrinks as
      1/width; input layers and depthwise convolutions have a fixed fan_in and keep O(1) variance;
    - their biases: 0;
    - the MuReadout: 0 (it also divides its input by width_mult in forward);
    - normalisation layers (LayerNorm, LayerNorm2d, GRN) and other vector-like parameters (Swin's
      logit scale and q/v biases) keep the builder's initialisation: their shape is O(width) but
      each entry acts on one coordinate, so an O(1) init is already muP (timm's zero gain of the
      Swin V2 residual post-norms is kept on purpose: blocks start as identities).

    Any other parameter with two width dimensions would be silently left at a non-muP init, so it
    is an error.
    """
    handled: set[int] = set()
    for module in model.modules():
        if isinstance(module, MuReadout):
            nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, _ConvNd)):
            std = 1.0 / math.sqrt(fan_in(module.weight))
            fast_trunc_normal_(module.weight, 0.0, std, -2 * std, 2 * std)  # N(0, 1/fan_in) truncated at 2 std
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        else:
            continue
        handled.update(id(p) for p in module.parameters(recurse=False))
    for name, p in model.named_parameters():
        infshape = getattr(p, "infshape", None)
        if id(p) not in handled and infshape is not None and infshape.ninf() >= 2:
            raise NotImplementedError(
                f"parameter {name} {tuple(p.shape)} has two width dimensions but is not in a Linear or Conv "
                f"layer; reinit_mup does not know its muP initialisation"
            )


def mup_param_groups(params: nn.Module | Iterable[nn.Parameter], lr: float) -> list[dict[str, Any]]:
    """Adam-style muP: matrix-like parameters get lr / width_mult, everything else lr.

    Matrix-like = two width dimensions (hidden Linear / Conv weights); width_mult is that of the
    fan-in. Vector-like (biases, norms, input layers, depthwise convs, the MuReadout, which scales
    its own output) keep lr. Works for any Adam-like optimizer (schedule-free AdamW included),
    which is why it is done here instead of through ``mup.MuAdamW``. Given a module, its base
    shapes are re-attached first (so a deep-copied model works).
    """
    if isinstance(params, nn.Module):
        if hasattr(params, INFSHAPES_ATTR):
            restore_base_shapes(params)
        params = params.parameters()
    groups: dict[float, list[nn.Parameter]] = {}
    vector_like: list[nn.Parameter] = []
    for p in params:
        if not p.requires_grad:
            continue
        infshape = getattr(p, "infshape", None)
        if infshape is None:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} has no infshape: muP base shapes were lost "
                f"(deepcopy?); call models.restore_base_shapes(model) or pass the model itself"
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
    """The paper's depth transfer: lr * (base_depth / depth) ** exponent (3/2 MLPs, 1/2 others)."""
    if depth < 1 or base_depth < 1:
        raise ValueError(f"depth and base_depth must be >= 1, got depth={depth}, base_depth={base_depth}")
    return lr * (base_depth / depth) ** exponent
