"""Layers of M members at once, from stacked weights (member axis first): the pieces models'
``forward_stacked`` forms are built from, each one kernel whatever M is.

Two layouts: a member-major batch (M, B, features) for linear layers, and images with the
members folded into the channel axis, (B, M*C, H, W), for convolutions: a convolution of M
members is one grouped convolution (groups = M x the layer's own groups) over it. Images are
kept in channels-last memory, so the per-member view (B, H, W, M, C) that layer norms need is
free (``members_last``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mark_dynamic(tensors: Iterable[Tensor], x: Tensor, x_axes: Iterable[int]) -> None:
    """For torch.compile: the member axis of ``tensors`` and ``x_axes`` of ``x`` may change within a fit (members
    leave; a short last batch), so they are symbolic from the start (a size of 1 is specialised anyway)."""
    import torch._dynamo

    for t in tensors:
        if t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for axis in x_axes:
        if x.shape[axis] > 1:
            torch._dynamo.maybe_mark_dynamic(x, axis)


def compile_block(block: Callable[..., Tensor], backend: str, recompile_limit: int) -> Callable[..., Tensor]:
    """``block`` compiled for the blocks of a fit (a model's ``compile_stacked``), at most ``recompile_limit`` graphs;
    the stacked weights' member axis is symbolic (dynamo takes parameters' shapes as static by default)."""
    import torch._dynamo

    torch._dynamo.config.force_parameter_static_shapes = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, recompile_limit)
    return torch.compile(block, backend=backend, dynamic=False)


def linear(params: dict[str, Tensor], name: str, h: Tensor) -> Tensor:
    """Each member's ``nn.Linear`` on its own rows: h (M, B, in) -> (M, B, out)."""
    return torch.baddbmm(params[f"{name}.bias"].unsqueeze(1), h, params[f"{name}.weight"].transpose(1, 2))


def mu_readout(readout: nn.Module, params: dict[str, Tensor], name: str, h: Tensor) -> Tensor:
    """muP's ``MuReadout`` forward (output_mult * x / width_mult, then the linear layer) per member."""
    return linear(params, name, readout.output_mult * h / readout.width_mult())


def fold_members(x: Tensor) -> Tensor:
    """Images (M, B, C, H, W) -> (B, M*C, H, W) in channels-last memory: member m owns channels m*C..m*C+C-1."""
    m, b, c, h, w = x.shape
    folded = x.permute(1, 3, 4, 0, 2).reshape(b, h, w, m * c).permute(0, 3, 1, 2)
    # one channel: the reshape is a view whose strides depend on the member count, which inductor cannot order; the
    # convolution copied it to this contiguous layout anyway, so the numbers are unchanged
    return folded.contiguous() if c == 1 else folded


def members_last(h: Tensor, members: int) -> Tensor:
    """(B, M*C, H, W) -> the view (B, H, W, M, C) (a copy only if h is not in channels-last memory)."""
    b, mc, height, width = h.shape
    return h.permute(0, 2, 3, 1).reshape(b, height, width, members, mc // members)


def members_folded(h: Tensor) -> Tensor:
    """(B, H, W, M, C) -> (B, M*C, H, W), the inverse of ``members_last``."""
    b, height, width, m, c = h.shape
    return h.reshape(b, height, width, m * c).permute(0, 3, 1, 2)


def conv2d(conv: nn.Conv2d, params: dict[str, Tensor], name: str, h: Tensor, members: int) -> Tensor:
    """Each member's ``conv`` (same stride, padding, dilation) on its own channels of h, as one grouped convolution."""
    if not isinstance(conv.padding, tuple) or conv.padding_mode != "zeros":
        raise ValueError(
            f"{name}: only zero padding of fixed size can be stacked, got {conv.padding!r} ({conv.padding_mode})"
        )
    weight = params[f"{name}.weight"]
    bias = params.get(f"{name}.bias")
    return F.conv2d(
        h,
        weight.flatten(0, 1),
        None if bias is None else bias.flatten(),
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups * members,
    )


def layer_norm(h: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Each member's LayerNorm over the last axis of h (..., M, C), with its own weight and bias (M, C)."""
    return torch.addcmul(bias, F.layer_norm(h, h.shape[-1:], eps=eps), weight)


def layer_norm_member_major(h: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Each member's LayerNorm over the last axis of member-major h (M, ..., C), with its own weight and bias (M, C)."""
    shape = (weight.shape[0],) + (1,) * (h.ndim - 2) + (weight.shape[1],)
    return torch.addcmul(bias.view(shape), F.layer_norm(h, h.shape[-1:], eps=eps), weight.view(shape))


def channel_norm(params: dict[str, Tensor], name: str, eps: float, h: Tensor, members: int) -> Tensor:
    """timm's ``LayerNorm2d`` (a LayerNorm over the channels of each pixel) per member of (B, M*C, H, W)."""
    normed = layer_norm(members_last(h, members), params[f"{name}.weight"], params[f"{name}.bias"], eps)
    return members_folded(normed)
