"""Swin V2 as the original code built it (``model.options.variant=original``; issue 35 D6): torchvision's
``SwinTransformer`` with ``SwinTransformerBlockV2`` and ``PatchMergingV2`` (EleutherAI/mdl
mdl/vision_probe.py@5e66bb9980286be3c3e40df029611651659e08f1, ``SwinProbe``, lines cited below), scaled by
width and depth, with a ``MuReadout`` head.

The original's atto: ``embed_dim`` 40 (vision_probe.py@5e66bb9:203-205), heads [2, 4, 8, 16] (:204), depths
[2, 2, 6, 2] (:225), patch 2x2 (:223), window 7x7 (:227), ``stochastic_depth_prob`` 0.2 (:229), V2 blocks and
patch merging (:230-231), the head a zero-initialised ``MuReadout`` (:234-240). Here the width is the
embedding dimension (40 in the presets: atto), the depths are [1, 1, 3, 1] * depth (atto at depth 2), the heads
stay [2, 4, 8, 16] at every width (the original's atto to nano, :203-214; its tiny used [3, 6, 12, 24], :215-217: ours,
one head layout for a muP family), and the builder's initialisation is torchvision's (trunc-N(0, 0.02) linear
weights, zero biases; PyTorch's default for the patch convolution).

A 7x7 window does not tile CIFAR-10's 16x16 token grid (nor 8x8, 4x4, 2x2 after each merge). torchvision's
``shifted_window_attention`` then pads the stage's (B, H, W, C) map with zeros at the bottom and right to
multiples of the window (16 -> 21, 8 -> 14, 4 -> 7, 2 -> 7), and the padded tokens take part in attention
unmasked: they get the qkv bias, are keys and values for the real tokens, and only the shift mask (the same
for every window count) applies; the padded rows are cut off after the output projection. Where the window
covers the padded grid (7 >= 7: the last two stages on CIFAR-10) there is no shift. This model does exactly
that (it is torchvision's code); tests/test_swin_original.py checks it against attention on an explicitly
zero-padded grid. The default ``swin`` (timm, models.swin) refuses such windows instead.

Our adaptations: an input with other than 3 channels gets a patch convolution with that many input channels
(torchvision's has 3; the original only saw RGB); ``torch.compile`` (:242) is ``trainer.compile``'s business.
"""

from __future__ import annotations

from typing import Sequence

from mup import MuReadout
from torch import nn
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

from models import swin_stacked
from models.registry import check_image_shape
from models.stacking import StackedForm

ORIGINAL_HEADS = (
    2,
    4,
    8,
    16,
)  # original: mdl/vision_probe.py@5e66bb9:204 (atto; femto, pico, nano the same: :207, 210, 213)
ORIGINAL_STAGE_DEPTHS = (1, 1, 3, 1)  # x depth 2 = [2, 2, 6, 2], original: mdl/vision_probe.py@5e66bb9:225
ORIGINAL_WINDOW = 7  # original: mdl/vision_probe.py@5e66bb9:227 window_size=[7, 7]


class StackableSwinTransformer(StackedForm, SwinTransformer):
    """torchvision's Swin with a stacked form: a fit of several members runs them as one network (models.swin_stacked,
    padding and all) instead of vmap over each member's forward."""

    stacked_form = swin_stacked


def build_original_swin(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    stage_depths: Sequence[int] | None,
    heads: Sequence[int] | None,
    window_size: int | None,
    patch_size: int,
    mlp_ratio: float,
    drop_path_rate: float,
) -> SwinTransformer:
    """torchvision's Swin V2 at this width and depth, as the original code built it (``variant=original``,
    reached through ``build_swin``). Heads, window and stage depths are the original's unless given. Values that would
    fail deep inside torchvision (heads that do not divide a stage's width, a patch that does not divide the input) are
    refused here, naming the setting; a window that does not tile the grid is padded, as in the original."""
    stage_depths = list(ORIGINAL_STAGE_DEPTHS if stage_depths is None else stage_depths)
    heads = list(ORIGINAL_HEADS if heads is None else heads)
    if len(stage_depths) < 1 or min(stage_depths) < 1:
        raise ValueError(f"swin stage_depths must be positive integers, got {stage_depths}")
    if len(heads) != len(stage_depths) or min(heads) < 1:
        raise ValueError(
            f"swin variant=original: model.options.heads needs one positive count per stage "
            f"({len(stage_depths)} stages), got {heads}"
        )
    widths = [width * 2**i for i in range(len(stage_depths))]
    if any(c % h for c, h in zip(widths, heads)):
        raise ValueError(
            f"swin variant=original: stage widths {widths} are not multiples of their heads {heads}; "
            f"use a width that is a multiple of {heads[0]} (the original's atto: 40)"
        )
    if window_size is None or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(
            f"swin variant=original: model.options.window_size must be a positive integer (the "
            f"original's: {ORIGINAL_WINDOW}), got {window_size!r}"
        )
    if not 0.0 <= float(drop_path_rate) < 1.0:
        raise ValueError(f"swin drop_path_rate must lie in [0, 1), got {drop_path_rate!r}")
    in_channels, h, w = check_image_shape(input_shape, "swin")
    if h % patch_size or w % patch_size:
        raise ValueError(
            f"swin: patch size {patch_size} does not divide the {h}x{w} input; set "
            f"model.options.patch_size to a divisor of both sides"
        )
    model = StackableSwinTransformer(
        patch_size=[patch_size, patch_size],
        embed_dim=width,
        depths=[depth * d for d in stage_depths],
        num_heads=heads,
        window_size=[window_size, window_size],
        mlp_ratio=mlp_ratio,
        stochastic_depth_prob=float(drop_path_rate),  # torchvision's rule: linear in the block index, 0 at the first
        num_classes=num_classes,
        block=SwinTransformerBlockV2,
        downsample_layer=PatchMergingV2,
    )
    if in_channels != 3:  # ours: torchvision's patch embedding takes RGB
        model.features[0][0] = nn.Conv2d(in_channels, width, kernel_size=patch_size, stride=patch_size)
    model.head = MuReadout(model.head.in_features, num_classes, readout_zero_init=True)
    if not swin_stacked.stackable(model):
        raise AssertionError(
            "swin variant=original: the stacked form does not match this structure (models.swin_stacked)"
        )
    return model
