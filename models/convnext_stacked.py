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

from typing import Callable

import torch
import torch.nn.functional as F
from timm.layers.activations import GELU
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
            and type(b.mlp.act) is GELU  # exact GELU (timm's "gelu"), what block_math applies
            and getattr(b.mlp.drop1, "p", 0.0) == 0.0
            and getattr(b.mlp.drop2, "p", 0.0) == 0.0
            and isinstance(getattr(b.mlp, "norm", nn.Identity()), nn.Identity)
            and isinstance(b.conv_dw.padding, tuple)
            and b.conv_dw.padding_mode == "zeros"
            and b.conv_dw.groups == b.conv_dw.in_channels
            for b in blocks
        )
    )


def forward_stacked(
    model: ConvNeXt, params: dict[str, Tensor], x: Tensor, run_block: Callable[..., Tensor] | None = None
) -> Tensor:
    """x (M, B, C, H, W) -> logits (M, B, K), member m with the weights params[name][m]. ``run_block``: the
    blocks' computation (``block_math``, or its compiled form: ``compile_blocks``)."""
    run_block = block_math if run_block is None else run_block
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
            h = _block(run_block, block, params, f"stages.{i}.blocks.{j}", h, members)
    pooled = h.mean((2, 3)).unflatten(1, (members, -1))  # (B, M, C): the head's average pool
    norm = model.head.norm
    pooled = ops.layer_norm(pooled, params["head.norm.weight"], params["head.norm.bias"], norm.eps)
    return ops.mu_readout(model.head.fc, params, "head.fc", pooled.transpose(0, 1))


def compile_blocks(backend: str) -> Callable[..., Tensor]:
    """``block_math`` compiled for the blocks of a fit: the repeated block, not the whole network, is what compiles
    (the stem, downsampling and head run eagerly). One graph per stage, whatever the number of members or the batch
    (their axes are symbolic: ``stacked_ops.mark_dynamic``), another per stage for evaluation (no autograd). A stack of 4
    ConvNeXts width 16 on 2 CPU cores, first step: 191 s compiled whole, 60 s by blocks; with the FX graph cache of
    an earlier job (``models.precision.share_compile_cache``) 3.7 s."""
    # a graph per stage, for training and evaluation, for a stack of several members and of one: 16 for ConvNeXt's
    # four stages, beyond dynamo's default of 8 per function (after which it would run the blocks uncompiled)
    return ops.compile_block(block_math, backend, 32)


def _block(
    run_block: Callable[..., Tensor],
    block: ConvNeXtBlock,
    params: dict[str, Tensor],
    name: str,
    h: Tensor,
    members: int,
) -> Tensor:
    """timm's ``ConvNeXtBlock.forward`` per member, through ``run_block`` (``block_math`` or its compiled form)."""
    grn = getattr(block.mlp, "grn", None)
    if run_block is not block_math:  # spatial and channel sizes stay fixed (inductor failed on symbolic ones)
        ops.mark_dynamic((t for key, t in params.items() if key.startswith(name)), h, (0, 1))
    return run_block(
        h,
        params[f"{name}.conv_dw.weight"],
        params[f"{name}.conv_dw.bias"],
        params[f"{name}.norm.weight"],
        params[f"{name}.norm.bias"],
        params[f"{name}.mlp.fc1.weight"],
        params[f"{name}.mlp.fc1.bias"],
        None if grn is None else params[f"{name}.mlp.grn.weight"],
        None if grn is None else params[f"{name}.mlp.grn.bias"],
        params[f"{name}.mlp.fc2.weight"],
        params[f"{name}.mlp.fc2.bias"],
        block.conv_dw.padding[0],
        block.norm.eps,
        1e-6 if grn is None else grn.eps,
    )


def block_math(
    h: Tensor,
    dw_weight: Tensor,
    dw_bias: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor,
    grn_weight: Tensor | None,
    grn_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor,
    padding: int,
    norm_eps: float,
    grn_eps: float,
) -> Tensor:
    """One ConvNeXt V2 block of M members on (B, M*C, H, W): depthwise conv, LayerNorm, Linear-GELU-GRN-Linear,
    residual. Tensors and numbers only (no module), so one compiled graph serves every block of every stage."""
    members = dw_weight.shape[0]
    shortcut = h
    h = F.conv2d(h, dw_weight.flatten(0, 1), dw_bias.flatten(), padding=padding, groups=h.shape[1])
    h = ops.members_folded(ops.layer_norm(ops.members_last(h, members), norm_weight, norm_bias, norm_eps))
    h = F.gelu(F.conv2d(h, fc1_weight.flatten(0, 1)[..., None, None], fc1_bias.flatten(), groups=members))
    if grn_weight is not None:  # timm's GlobalResponseNorm, channels last: per member, per channel, over the pixels
        v = ops.members_last(h, members)
        gx = v.norm(p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + grn_eps)
        v = v + torch.addcmul(grn_bias, grn_weight, v * nx)
        h = ops.members_folded(v)
    h = F.conv2d(h, fc2_weight.flatten(0, 1)[..., None, None], fc2_bias.flatten(), groups=members)
    return h + shortcut
