"""Swin V2 of M members as one network, for both Swins ``models.swin.build_swin`` makes: timm's
``SwinTransformerV2`` (ours) and torchvision's ``SwinTransformer`` with V2 blocks (``variant=original``).

Under vmap a stack of Swins ran op by op through vmap's batching rules, and stochastic depth's random draws not
at all; here the tokens are member-major,
(M, B, H, W, C), and every layer is one kernel whatever M is: a linear layer is one batched matmul over the
members (``_linear``), a layer norm normalises each member's tokens with its own gain and bias, the patch
embedding (a convolution whose kernel is its stride) is a batched matmul over the patches, and a block's window
attention is one ``scaled_dot_product_attention`` over every member's windows: cosine attention as q and k
normalised, each member's per-head logit scale (clamped as the libraries do) folded into q, its continuous
position bias (16 * sigmoid of the cpb MLP) plus the shift mask as a float mask, scale 1. Stochastic depth draws
each member's own per-sample keep factors (one (M, B) draw: ``keep_factors``); it acts only in training mode with
gradients on, because the stacked engine scores its members under ``torch.no_grad`` without leaving training
mode (models.stacked_module.StackedClassifier.loss_sums).

The template ``forward_stacked`` is called on lives on the meta device and gets no buffers, so the constant
buffers (relative coordinates table and position index, shift masks, timm's zero k bias) are made on the input's
device each call, by the libraries' own functions where they have them (timm) or their code verbatim
(torchvision). Each piece cites the library code it follows (timm 1.0's ``swin_transformer_v2``, torchvision's
``swin_transformer``); ``stackable`` says whether a model has the structure handled. Member m's result equals
its own ``forward`` up to float rounding (tests/test_swin_stacked.py checks outputs and gradients).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from mup import MuReadout
from timm.layers import DropPath
from timm.models.swin_transformer_v2 import PatchMerging, SwinTransformerV2, SwinTransformerV2Block
from torch import Tensor, nn
from torchvision.models.swin_transformer import (
    PatchMergingV2,
    ShiftedWindowAttentionV2,
    SwinTransformer,
    SwinTransformerBlockV2,
)

from models import stacked_ops as ops
from models.swin_tables import torchvision_relative_positions, torchvision_shift_mask

TIMM_MAX_LOGIT_SCALE = math.log(1.0 / 0.01)  # timm WindowAttention.forward: clamp(logit_scale, max=log(1 / 0.01))
TORCHVISION_MAX_LOGIT_SCALE = math.log(100.0)  # torchvision shifted_window_attention: clamp(max=log(100.0))
POSITION_BIAS_RANGE = 16  # both: relative_position_bias = 16 * torch.sigmoid(relative_position_bias)


def stackable(model: nn.Module) -> bool:
    """Whether ``forward_stacked`` reproduces this model's forward (the structures ``build_swin`` makes)."""
    if isinstance(model, SwinTransformerV2):
        return _timm_stackable(model)
    if isinstance(model, SwinTransformer):
        return _torchvision_stackable(model)
    return False


def forward_stacked(model: nn.Module, params: dict[str, Tensor], x: Tensor, compiled: Callable | None = None) -> Tensor:
    """x (M, B, C, H, W) -> logits (M, B, K), member m with the weights params[name][m]. ``compiled``: the blocks'
    computation compiled (``compile_blocks``), or None to run them eagerly."""
    run_block = _run_block if compiled is None else partial(_run_compiled_block, compiled)
    if isinstance(model, SwinTransformerV2):
        return _timm_forward(model, params, x, run_block)
    return _torchvision_forward(model, params, x, run_block)


def compile_blocks(backend: str) -> Callable:
    """The repeated block compiled, not the whole network (a stacked Swin compiled whole took 424 s on 2 CPU cores):
    blocks of one structure (stage, shift, window, heads) share a graph, the member and batch axes are symbolic
    (``_run_compiled_block``), so members leaving the stack recompile nothing; patch embedding, merging and the head
    run eagerly."""
    # a graph per block structure, for training and evaluation, a stack of several members and of one
    return ops.compile_block(_run_block, backend, 64)


def _run_block(block_fn: Callable, block: nn.Module, params: dict[str, Tensor], h: Tensor, training: bool) -> Tensor:
    """One block: ``block_fn`` (``_timm_block`` or ``_torchvision_block``) on this block's own parameters, named
    ``block.<name in the block>``, so every block of a structure is the same call."""
    return block_fn(block, params, "block", h, training)


def _run_compiled_block(
    compiled: Callable, block_fn: Callable, block: nn.Module, params: dict[str, Tensor], h: Tensor, training: bool
) -> Tensor:
    ops.mark_dynamic(params.values(), h, (0, 1))
    return compiled(block_fn, block, params, h, training)


def _block_params(params: dict[str, Tensor], name: str) -> dict[str, Tensor]:
    """The parameters under ``name``, renamed ``block.<rest>`` (what ``_run_block`` passes on)."""
    prefix = f"{name}."
    return {f"block.{k[len(prefix) :]}": v for k, v in params.items() if k.startswith(prefix)}


def keep_factors(members: int, batch: int, keep: float, like: Tensor) -> Tensor:
    """(M, B) factors of a residual branch under stochastic depth: each member's own per-sample draw, as timm's
    ``drop_path`` and torchvision's ``stochastic_depth(mode="row")`` make one: bernoulli(keep) / keep."""
    noise = like.new_empty((members, batch)).bernoulli_(keep)
    if keep > 0.0:
        noise.div_(keep)
    return noise


# --- shared pieces -----------------------------------------------------------------------------------------------


def _linear(h: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Each member's linear layer on its own tokens: h (M, ..., in), weight (M, out, in), bias (M, out)."""
    flat = h.reshape(h.shape[0], -1, h.shape[-1])
    out = (
        torch.bmm(flat, weight.transpose(1, 2))
        if bias is None
        else torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    )
    return out.view(*h.shape[:-1], weight.shape[1])


def _pad(h: Tensor, bottom: int, right: int) -> Tensor:
    """Zeros below and right of the grid of h (M, B, H, W, C), as the libraries' ``F.pad(x, (0, 0, 0, right, 0,
    bottom))``; nothing (no copy) where none is needed."""
    return F.pad(h, (0, 0, 0, right, 0, bottom)) if bottom or right else h


def _norm(params: dict[str, Tensor], name: str, norm: nn.Module, h: Tensor) -> Tensor:
    """Each member's ``nn.LayerNorm`` over the channels of its tokens h (M, ..., C)."""
    return ops.layer_norm_member_major(h, params[f"{name}.weight"], params[f"{name}.bias"], norm.eps)


def _patch_embed(params: dict[str, Tensor], name: str, conv: nn.Conv2d, x: Tensor) -> Tensor:
    """The patch convolution (kernel = stride, no padding) as a batched matmul over the patches:
    x (M, B, C, H, W) -> tokens (M, B, H / p, W / p, C')."""
    members, batch, channels, height, width = x.shape
    ph, pw = conv.kernel_size
    patches = x.reshape(members, batch, channels, height // ph, ph, width // pw, pw).permute(0, 1, 3, 5, 2, 4, 6)
    weight = params[f"{name}.weight"]  # (M, C', C, ph, pw): flattened as the patches are, (C, ph, pw)
    return _linear(patches.flatten(4), weight.flatten(2), params.get(f"{name}.bias"))


def _merge_patches(params: dict[str, Tensor], name: str, norm: nn.Module, h: Tensor) -> Tensor:
    """Patch merging V2: 2x2 neighbours concatenated (bottom/right zero-padded to even sides), reduced, normed.
    timm ``PatchMerging.forward`` (reshape(B, H/2, 2, W/2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)) and
    torchvision ``_patch_merging_pad`` (cat of x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]) order
    the four alike: the row offset varies fastest; both reduce (no bias) and then norm (``PatchMergingV2``)."""
    members, batch, height, width, channels = h.shape
    h = _pad(h, height % 2, width % 2)
    height, width = h.shape[2], h.shape[3]
    h = h.reshape(members, batch, height // 2, 2, width // 2, 2, channels).permute(0, 1, 2, 4, 5, 3, 6).flatten(4)
    return _norm(params, f"{name}.norm", norm, _linear(h, params[f"{name}.reduction.weight"]))


def _position_bias(params: dict[str, Tensor], name: str, table: Tensor, index: Tensor, tokens: int) -> Tensor:
    """Each member's continuous position bias (M, heads, N, N): its cpb MLP (Linear(2, 512), ReLU, Linear(512,
    heads, no bias)) on the relative coordinates table, 16 * sigmoid, gathered at the window's token pairs (timm
    ``WindowAttention.forward``, torchvision ``ShiftedWindowAttentionV2.get_relative_position_bias``; the sigmoid,
    elementwise, is taken before the gather here)."""
    members = params[f"{name}.0.weight"].shape[0]
    coords = table.reshape(1, -1, 2).expand(members, -1, -1)
    hidden = torch.relu(_linear(coords, params[f"{name}.0.weight"], params[f"{name}.0.bias"]))
    bias = POSITION_BIAS_RANGE * torch.sigmoid(_linear(hidden, params[f"{name}.2.weight"]))  # (M, T, heads)
    return bias[:, index.reshape(-1)].view(members, tokens, tokens, -1).permute(0, 3, 1, 2)


def _window_attention(
    h: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    logit_scale: Tensor,
    max_logit_scale: float,
    position_bias: Tensor,
    shift_mask: Tensor | None,
    window: tuple[int, int],
) -> Tensor:
    """Cosine attention within each window of h (M, B, Hp, Wp, C), windows tiling it; the heads' outputs
    (M, B, Hp, Wp, C) before the output projection. Follows timm ``WindowAttention.forward`` and torchvision
    ``shifted_window_attention``: qkv as (3, heads, d) channels, logits normalize(q) . normalize(k) times
    exp(clamp(logit_scale)), plus the position bias and the shift mask per window, softmax, times v."""
    members, batch, height, width, channels = h.shape
    heads = logit_scale.shape[1]
    wh, ww = window
    rows, cols, n = height // wh, width // ww, wh * ww
    qkv = _linear(h, qkv_weight, qkv_bias).view(members, batch, rows, wh, cols, ww, 3, heads, channels // heads)
    # batch first, then (member, window, head) as attention heads: the mask (per member, window and head) is one
    # tensor broadcast over the batch, so the whole stack is one 4-d attention call
    qkv = qkv.permute(6, 1, 0, 2, 4, 7, 3, 5, 8).reshape(3, batch, members, rows * cols, heads, n, -1)
    q, k, v = qkv.unbind(0)
    scale = torch.clamp(logit_scale, max=max_logit_scale).exp()  # (M, heads, 1, 1)
    q = F.normalize(q, dim=-1) * scale.unsqueeze(1)
    k = F.normalize(k, dim=-1)
    mask = position_bias.unsqueeze(1)  # (M, 1, heads, N, N)
    if shift_mask is not None:  # (windows, N, N)
        mask = mask + shift_mask[None, :, None]
    mask = mask.expand(members, rows * cols, heads, n, n).reshape(1, -1, n, n)
    out = F.scaled_dot_product_attention(
        q.flatten(1, 3), k.flatten(1, 3), v.flatten(1, 3), attn_mask=mask.to(q.dtype), scale=1.0
    )
    out = out.view(batch, members, rows, cols, heads, wh, ww, -1).permute(1, 0, 2, 5, 3, 6, 4, 7)
    return out.reshape(members, batch, height, width, channels)


def _drop_path(branch: Tensor, p: float, training: bool) -> Tensor:
    """timm ``drop_path`` (scale_by_keep) / torchvision ``stochastic_depth(mode="row")`` per member and sample."""
    if not training or p == 0.0:
        return branch
    factors = keep_factors(branch.shape[0], branch.shape[1], 1.0 - p, branch)
    return branch * factors.view(*factors.shape, *[1] * (branch.ndim - 2))


def _drops_paths(model: nn.Module) -> bool:
    """Stochastic depth acts in training mode with gradients on (the engine scores under no_grad in training mode)."""
    return model.training and torch.is_grad_enabled()


def _zeroed_k(bias: Tensor) -> Tensor:
    """(M, 3C) qkv bias with its k third zero (and no gradient there)."""
    third = bias.shape[1] // 3
    return torch.cat((bias[:, :third], torch.zeros_like(bias[:, third : 2 * third]), bias[:, 2 * third :]), 1)


# --- timm's SwinTransformerV2 -----------------------------------------------------------------------------------


def _timm_stackable(model: SwinTransformerV2) -> bool:
    embed = model.patch_embed
    head = model.head
    blocks = [b for stage in model.layers for b in stage.blocks]
    return (
        _is_patch_conv(embed.proj)
        and isinstance(embed.norm, nn.LayerNorm)
        and not embed.dynamic_img_pad
        and isinstance(model.norm, nn.LayerNorm)
        and head.global_pool.pool_type == "avg"
        and _no_dropout(head.drop)
        and isinstance(head.flatten, nn.Identity)
        and isinstance(head.fc, MuReadout)
        and all(
            isinstance(s.downsample, (nn.Identity, PatchMerging))
            and (isinstance(s.downsample, nn.Identity) or isinstance(s.downsample.norm, nn.LayerNorm))
            for s in model.layers
        )
        and all(_timm_block_stackable(b) for b in blocks)
    )


def _timm_block_stackable(block: SwinTransformerV2Block) -> bool:
    attn, mlp = block.attn, block.mlp
    return (
        type(block) is SwinTransformerV2Block
        and not block.dynamic_mask
        and isinstance(block.norm1, nn.LayerNorm)
        and isinstance(block.norm2, nn.LayerNorm)
        and all(isinstance(d, (nn.Identity, DropPath)) for d in (block.drop_path1, block.drop_path2))
        and all(getattr(d, "scale_by_keep", True) for d in (block.drop_path1, block.drop_path2))
        and all(_no_dropout(d) for d in (attn.attn_drop, attn.proj_drop, mlp.drop1, mlp.drop2))
        and isinstance(mlp.norm, nn.Identity)
        and not any(True for _ in mlp.act.parameters())
        and attn.proj.bias is not None
    )


def _timm_forward(model: SwinTransformerV2, params: dict[str, Tensor], x: Tensor, run_block: Callable) -> Tensor:
    """timm ``SwinTransformerV2.forward``: patch_embed, layers, norm, head (mean over the grid, fc)."""
    expected = model.patch_embed.img_size
    if expected is not None and model.patch_embed.strict_img_size and tuple(x.shape[-2:]) != tuple(expected):
        raise ValueError(f"swin: the model takes {expected[0]}x{expected[1]} inputs, got {x.shape[-2]}x{x.shape[-1]}")
    training = _drops_paths(model)
    h = _patch_embed(params, "patch_embed.proj", model.patch_embed.proj, x)  # PatchEmbed, output_fmt NHWC
    h = _norm(params, "patch_embed.norm", model.patch_embed.norm, h)
    for i, stage in enumerate(model.layers):  # SwinTransformerV2Stage.forward
        if not isinstance(stage.downsample, nn.Identity):
            h = _merge_patches(params, f"layers.{i}.downsample", stage.downsample.norm, h)
        for j, block in enumerate(stage.blocks):
            h = run_block(_timm_block, block, _block_params(params, f"layers.{i}.blocks.{j}"), h, training)
    h = _norm(params, "norm", model.norm, h)
    return ops.mu_readout(model.head.fc, params, "head.fc", h.mean((2, 3)))


def _timm_block(block: SwinTransformerV2Block, params: dict[str, Tensor], name: str, h: Tensor, training: bool):
    """timm ``SwinTransformerV2Block.forward``: x + drop_path1(norm1(_attn(x))), x + drop_path2(norm2(mlp(x)))."""
    attended = _norm(params, f"{name}.norm1", block.norm1, _timm_attention(block, params, f"{name}.attn", h))
    h = h + _drop_path(attended, getattr(block.drop_path1, "drop_prob", 0.0), training)
    mlp = block.mlp  # timm Mlp: fc1, act, drop1 (p 0), norm (Identity), fc2, drop2 (p 0)
    hidden = mlp.act(_linear(h, params[f"{name}.mlp.fc1.weight"], params[f"{name}.mlp.fc1.bias"]))
    out = _norm(params, f"{name}.norm2", block.norm2, _linear(hidden, *_weight_bias(params, f"{name}.mlp.fc2")))
    return h + _drop_path(out, getattr(block.drop_path2, "drop_prob", 0.0), training)


def _timm_attention(block: SwinTransformerV2Block, params: dict[str, Tensor], name: str, h: Tensor) -> Tensor:
    """timm ``SwinTransformerV2Block._attn``: roll by -shift, pad bottom/right to whole windows, window attention
    with the block's mask (``get_attn_mask``, over the padded grid), crop, roll back; then the projection."""
    _, _, height, width, _ = h.shape
    window, shift = block.window_size, block.shift_size
    has_shift = any(shift)
    if has_shift:
        h = torch.roll(h, shifts=(-shift[0], -shift[1]), dims=(2, 3))
    pad_h = (window[0] - height % window[0]) % window[0]
    pad_w = (window[1] - width % window[1]) % window[1]
    h = _pad(h, pad_h, pad_w)
    q_bias = params.get(f"{name}.q_bias")
    qkv_bias = None if q_bias is None else torch.cat((q_bias, torch.zeros_like(q_bias), params[f"{name}.v_bias"]), 1)
    weight = params[f"{name}.qkv.weight"]
    table, index = block.attn._make_pair_wise_relative_positions(device=h.device, dtype=weight.dtype)
    bias = _position_bias(params, f"{name}.cpb_mlp", table, index, window[0] * window[1])
    mask = block.get_attn_mask(device=h.device, dtype=bias.dtype) if has_shift else None
    logit_scale = params[f"{name}.logit_scale"]
    h = _window_attention(h, weight, qkv_bias, logit_scale, TIMM_MAX_LOGIT_SCALE, bias, mask, window)
    h = h[:, :, :height, :width]
    if has_shift:
        h = torch.roll(h, shifts=shift, dims=(2, 3))
    return _linear(h, params[f"{name}.proj.weight"], params[f"{name}.proj.bias"])


# --- torchvision's SwinTransformer with V2 blocks -----------------------------------------------------------------


def _torchvision_stackable(model: SwinTransformer) -> bool:
    embed = model.features[0]
    stages = list(model.features)[1:]
    blocks = [b for s in stages if isinstance(s, nn.Sequential) for b in s]
    return (
        len(embed) == 3
        and _is_patch_conv(embed[0])
        and isinstance(embed[2], nn.LayerNorm)
        and all(isinstance(s, (nn.Sequential, PatchMergingV2)) for s in stages)
        and all(isinstance(s.norm, nn.LayerNorm) for s in stages if isinstance(s, PatchMergingV2))
        and all(_torchvision_block_stackable(b) for b in blocks)
        and isinstance(model.norm, nn.LayerNorm)
        and isinstance(model.avgpool, nn.AdaptiveAvgPool2d)
        and model.avgpool.output_size in (1, (1, 1))
        and isinstance(model.head, MuReadout)
    )


def _torchvision_block_stackable(block: nn.Module) -> bool:
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    return (
        type(block) is SwinTransformerBlockV2
        and type(attn) is ShiftedWindowAttentionV2
        and attn.attention_dropout == 0.0
        and attn.dropout == 0.0
        and attn.proj.bias is not None
        and block.stochastic_depth.mode == "row"
        and isinstance(block.norm1, nn.LayerNorm)
        and isinstance(block.norm2, nn.LayerNorm)
        and len(mlp) == 5  # torchvision MLP: Linear, GELU, Dropout, Linear, Dropout
        and isinstance(mlp[0], nn.Linear)
        and isinstance(mlp[3], nn.Linear)
        and not any(True for _ in mlp[1].parameters())
        and _no_dropout(mlp[2])
        and _no_dropout(mlp[4])
    )


def _torchvision_forward(model: SwinTransformer, params: dict[str, Tensor], x: Tensor, run_block: Callable) -> Tensor:
    """torchvision ``SwinTransformer.forward``: features (patch conv, permute, norm; stages and patch merging),
    norm, the average pool, head."""
    training = _drops_paths(model)
    embed = model.features[0]
    h = _norm(params, "features.0.2", embed[2], _patch_embed(params, "features.0.0", embed[0], x))
    for i, module in enumerate(model.features):
        if i == 0:
            continue
        if isinstance(module, PatchMergingV2):
            h = _merge_patches(params, f"features.{i}", module.norm, h)
            continue
        for j, block in enumerate(module):
            h = run_block(_torchvision_block, block, _block_params(params, f"features.{i}.{j}"), h, training)
    h = _norm(params, "norm", model.norm, h)
    return ops.mu_readout(model.head, params, "head", h.mean((2, 3)))


def _torchvision_block(block: SwinTransformerBlockV2, params: dict[str, Tensor], name: str, h: Tensor, training: bool):
    """torchvision ``SwinTransformerBlockV2.forward``: x + stochastic_depth(norm1(attn(x))), the same with mlp."""
    p = block.stochastic_depth.p
    attended = _norm(
        params, f"{name}.norm1", block.norm1, _torchvision_attention(block.attn, params, f"{name}.attn", h)
    )
    h = h + _drop_path(attended, p, training)
    hidden = block.mlp[1](_linear(h, params[f"{name}.mlp.0.weight"], params[f"{name}.mlp.0.bias"]))
    out = _norm(params, f"{name}.norm2", block.norm2, _linear(hidden, *_weight_bias(params, f"{name}.mlp.3")))
    return h + _drop_path(out, p, training)


def _torchvision_attention(attn: ShiftedWindowAttentionV2, params: dict[str, Tensor], name: str, h: Tensor) -> Tensor:
    """torchvision ``shifted_window_attention`` (V2: logit_scale given): pad bottom/right with zeros to whole
    windows (the padded tokens attend unmasked), no shift where the window covers the padded side, roll by
    -shift, window attention with the k third of the qkv bias zeroed, the mask over the padded grid, roll back,
    crop; the projection (per token) after the crop."""
    _, _, height, width, _ = h.shape
    window = list(attn.window_size)
    pad_r = (window[1] - width % window[1]) % window[1]
    pad_b = (window[0] - height % window[0]) % window[0]
    h = _pad(h, pad_b, pad_r)
    pad_height, pad_width = h.shape[2], h.shape[3]
    shift = list(attn.shift_size)
    if window[0] >= pad_height:
        shift[0] = 0
    if window[1] >= pad_width:
        shift[1] = 0
    if sum(shift) > 0:
        h = torch.roll(h, shifts=(-shift[0], -shift[1]), dims=(2, 3))
    weight = params[f"{name}.qkv.weight"]
    qkv_bias = params.get(f"{name}.qkv.bias")
    qkv_bias = None if qkv_bias is None else _zeroed_k(qkv_bias)
    table, index = torchvision_relative_positions(window, h.device, weight.dtype)
    bias = _position_bias(params, f"{name}.cpb_mlp", table, index, window[0] * window[1])
    mask = torchvision_shift_mask(pad_height, pad_width, window, shift, bias) if sum(shift) > 0 else None
    logit_scale = params[f"{name}.logit_scale"]
    h = _window_attention(h, weight, qkv_bias, logit_scale, TORCHVISION_MAX_LOGIT_SCALE, bias, mask, tuple(window))
    if sum(shift) > 0:
        h = torch.roll(h, shifts=(shift[0], shift[1]), dims=(2, 3))
    h = h[:, :, :height, :width]
    return _linear(h, params[f"{name}.proj.weight"], params[f"{name}.proj.bias"])


def _weight_bias(params: dict[str, Tensor], name: str) -> tuple[Tensor, Tensor | None]:
    return params[f"{name}.weight"], params.get(f"{name}.bias")


def _is_patch_conv(conv: nn.Module) -> bool:
    """A convolution that maps non-overlapping patches: kernel = stride, no padding or dilation, one group."""
    return (
        type(conv) is nn.Conv2d
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and tuple(conv.padding) == (0, 0)
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
    )


def _no_dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and module.p == 0.0)
