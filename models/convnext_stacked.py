"""ConvNeXt V2 of M members as one network: the members folded into the channel axis.

vmap runs a stack of ConvNeXts as a loop of per-member kernels wherever it lacks a batching rule
(adaptive pooling's ``as_strided_`` falls back to one call per member); here every layer is one
kernel whatever M is: convolutions are grouped convolutions (groups = M x the layer's groups), the
block's MLP is a grouped 1x1 convolution, layer norms and GRN act on the view (B, H, W, M, C) of
channels-last images (models.stacked_ops). Member m's result equals its own ``forward`` up to
float rounding (tests/test_conv_stacked.py checks outputs and gradients member by member).

Only the structure ``models.convnext.build_convnext`` gives is handled (Linear MLP, no layer scale,
no drop path, head norm after pooling); ``stackable`` says whether a model has it.
"""

from __future__ import annotations

import torch
from timm.models.convnext import ConvNeXt, ConvNeXtBlock
from torch import Tensor, nn

from models import stacked_ops as ops


def stackable(model: ConvNeXt) -> bool:
    """Whether ``forward_stacked`` reproduces this model's forward."""
    blocks = [b for s in model.stages for b in s.blocks]
    return (
        isinstance(model.norm_pre, nn.Identity)
        and isinstance(model.head.pre_logits, nn.Identity)
        and all(
            not b.use_conv_mlp
            and b.gamma is None
            and isinstance(b.drop_path, nn.Identity)
            and isinstance(b.shortcut, nn.Identity)
            for b in blocks
        )
    )


def forward_stacked(model: ConvNeXt, params: dict[str, Tensor], x: Tensor) -> Tensor:
    """x (M, B, C, H, W) -> logits (M, B, K), member m with the weights params[name][m]."""
    members = x.shape[0]
    h = ops.fold_members(x)
    h = ops.conv2d(model.stem[0], params, "stem.0", h, members)
    h = ops.channel_norm(params, "stem.1", model.stem[1].eps, h, members)
    for i, stage in enumerate(model.stages):
        if not isinstance(stage.downsample, nn.Identity):
            norm, conv = stage.downsample
            h = ops.channel_norm(params, f"stages.{i}.downsample.0", norm.eps, h, members)
            h = ops.conv2d(conv, params, f"stages.{i}.downsample.1", h, members)
        for j, block in enumerate(stage.blocks):
            h = _block(block, params, f"stages.{i}.blocks.{j}", h, members)
    pooled = h.mean((2, 3)).unflatten(1, (members, -1))  # (B, M, C): the head's average pool
    norm = model.head.norm
    pooled = ops.layer_norm(pooled, params["head.norm.weight"], params["head.norm.bias"], norm.eps)
    return ops.mu_readout(model.head.fc, params, "head.fc", pooled.transpose(0, 1))


def _block(block: ConvNeXtBlock, params: dict[str, Tensor], name: str, h: Tensor, members: int) -> Tensor:
    """timm's ``ConvNeXtBlock.forward`` (depthwise conv, LayerNorm, Linear-GELU-GRN-Linear, residual) per member."""
    shortcut = h
    h = ops.conv2d(block.conv_dw, params, f"{name}.conv_dw", h, members)
    h = ops.channel_norm(params, f"{name}.norm", block.norm.eps, h, members)
    h = block.mlp.act(ops.linear_1x1(params, f"{name}.mlp.fc1", h, members))
    grn = getattr(block.mlp, "grn", None)
    if grn is not None:  # timm's GlobalResponseNorm, channels last: per member, per channel, over the pixels
        v = ops.members_last(h, members)
        gx = v.norm(p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + grn.eps)
        v = v + torch.addcmul(params[f"{name}.mlp.grn.bias"], params[f"{name}.mlp.grn.weight"], v * nx)
        h = ops.members_folded(v)
    h = ops.linear_1x1(params, f"{name}.mlp.fc2", h, members)
    return h + shortcut
