"""Swin Transformer V2 through timm, scaled by width and depth, with a MuReadout head.

``timm.models.swin_transformer_v2.SwinTransformerV2`` with patch size 2 (paper Appendix B: a
32x32 image is a 16x16 token grid), stage widths doubling from w, and one of two scalings of the
depths and heads (``head_scaling``):

- ``width`` (default): four stages, depths [1, 1, 3, 1] * D (as ConvNeXt, Appendix B) and a fixed
  head dimension (``head_dim``), so stage i has w * 2^i / head_dim heads: the heads grow with
  the width in every stage (Swin-T's heads 3, 6, 12, 24 are this rule with head_dim 32).
- ``paper``: Appendix B read literally, "the number of heads also scaling in the third stage
  according to [D, D, 3D]": three stages, depths and heads both [D, D, 3D], widths [w, 2w, 4w]
  (head dimension w / D, 2w / D, 4w / 3D). Stage i's width must be a multiple of its heads (the
  builder names the widths that work: multiples of 3 for D = 1 and 2, of 9 for D = 3).

Why ``width`` is the default: the paper's sentence is ambiguous (a three-entry list for a
structure it calls the same as ConvNeXt's four stages), its rule ties the attention layout to
depth, so a depth sweep also changes the number and size of heads, and it admits only widths
divisible by 3 (none of 16, 32, 64, 128, the widths used elsewhere here, work), while the width
rule keeps the head size fixed as the standard Swin models do. muP is unaffected either way
(cosine attention, see below); tests/test_swin_scaling.py checks coordinates for both.

Windows are sized to the token grid: stage i sees a grid of ceil(grid / 2^i) tokens per side
and uses windows of min(window_size, grid_i), i.e. timm's own rule (a window never exceeds the
grid; where it covers the whole grid there is no shift). With window_size 8, 8x8 digits (grid 4,
2, 1, 1) attend globally in every stage, CIFAR-10 (16, 8, 4, 2) uses shifted 8x8 windows in the
first stage. A window must tile its grid exactly, because timm pads a ragged grid with tokens
that take part in attention unmasked; when it does not (e.g. 24x24 inputs: grid 12 with windows
of 8) the builder stops and names the window sizes that would work. ``window_size: null`` makes
every stage attend over its whole grid. (``variant: original``, the paper presets' torchvision Swin, pads
instead, as the original code did: models.swin_original.) (timm pads odd grids before patch merging, so grids may
reach 1x1.)

Tiny inputs: 8x8 digits give token grids 4, 2, 1, 1, so the last two stages attend over a single
token. Softmax over one logit is 1, so those blocks compute proj(v) and act as per-token MLP
blocks; their query/key side (logit scale, q bias, position-bias MLP, q/k rows of qkv) gets no
gradient. The builder warns. Real attention in all four stages needs inputs of at least 32x32
(patch size 2) or 16x16 (patch size 1); otherwise fewer stages (``stage_depths`` with fewer
entries) avoid the degenerate ones.

muP and attention: muP replaces attention's 1/sqrt(d) logit scale by 1/d because, once trained,
q and k are correlated and q.k grows like d. Swin V2 uses cosine attention instead:
logits = cos(q, k) * exp(logit_scale) (+ a bounded position bias), which is independent of the
head dimension and of width by construction, so it is kept as it is, under either head rule
(``width``: fixed head size, more heads; ``paper``: fixed heads, larger head size). The per-head
logit scales and q/v biases are
vector-like parameters (unscaled lr); qkv, proj, MLP and patch-merging weights are hidden layers
(lr / width_mult, variance 1 / fan_in); the patch embedding and the continuous-position-bias MLP
(fixed fan-in) are input layers. timm's zero gain of the residual post-norms is kept (blocks
start as identities; the gains are vector-like and learn at lr).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import timm.models.swin_transformer_v2 as timm_swin_transformer_v2
from mup import MuReadout
from timm.models.swin_transformer_v2 import SwinTransformerV2

from torch import nn

from models import swin_stacked
from models.mup_setup import fast_timm_init
from models.registry import check_image_shape, register_model
from models.stacking import StackedForm
from models.swin_original import build_original_swin

# model.options.variant: timm (ours, the default; this module) | original (torchvision's, as the original code:
# models.swin_original, the paper presets)
VARIANTS = ("timm", "original")


class StackableSwinTransformerV2(StackedForm, SwinTransformerV2):
    """timm's Swin V2 with a stacked form: a fit of several members runs them as one network of batched matmuls and
    one attention call per block (models.swin_stacked) instead of vmap over each member's forward."""

    stacked_form = swin_stacked


def stage_grids(grid: tuple[int, int], num_stages: int) -> list[tuple[int, int]]:
    """Token grid of each stage: every stage after the first halves it (rounding up, as timm pads)."""
    return [tuple(math.ceil(g / 2**i) for g in grid) for i in range(num_stages)]  # type: ignore[misc]


def tiling_windows(grids: list[tuple[int, int]]) -> list[int]:
    """Every window size w for which min(w, grid) tiles the grid of every stage."""
    largest = max(g for grid in grids for g in grid)
    return [w for w in range(1, largest + 1) if all(g % w == 0 for grid in grids for g in grid if g > w)]


def stage_windows(grids: list[tuple[int, int]], window_size: int | None) -> list[tuple[int, int]]:
    """Window of each stage: min(window_size, grid); it must tile the grid exactly."""
    if window_size is None:
        return list(grids)
    if not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"swin window_size must be a positive integer or null (whole grid), got {window_size!r}")
    windows = [tuple(min(window_size, g) for g in grid) for grid in grids]
    for i, (grid, window) in enumerate(zip(grids, windows)):
        for g, w in zip(grid, window):
            if g % w:
                raise ValueError(
                    f"swin: stage {i + 1} has a {grid[0]}x{grid[1]} token grid that {w}x{w} windows do not tile "
                    f"(stage grids {[f'{a}x{b}' for a, b in grids]}); set model.options.window_size to one of {tiling_windows(grids)} "
                    f"or null (each stage attends over its whole grid), or use an input whose side over the patch "
                    f"size is a multiple of {window_size}"
                )
    return windows  # type: ignore[return-value]


def timm_window_size(grids: list[tuple[int, int]], window_size: int | None) -> int:
    """One window size for timm, which clamps it to each block's grid exactly as ``stage_windows``
    does (min(window, grid), no shift where it covers the grid). One int works in every timm
    1.0.x; per-stage tuples need timm >= 1.0.30."""
    return max(grids[0]) if window_size is None else window_size


# head_scaling -> stage depths (times depth) used when stage_depths is not given
HEAD_SCALINGS: dict[str, tuple[int, ...]] = {"width": (1, 1, 3, 1), "paper": (1, 1, 3)}


def stage_heads(widths: list[int], depths: list[int], head_scaling: str, head_dim: int) -> list[int]:
    """Heads per stage: width_i / head_dim (``width``) or depth_i (``paper``); each must divide width_i."""
    if head_scaling == "width":
        if head_dim < 1 or widths[0] % head_dim:
            raise ValueError(
                f"swin width {widths[0]} is not a multiple of head_dim {head_dim} (stage i has width * 2^i / head_dim "
                f"heads); use a width that is a multiple of {head_dim}, or set model.options.head_dim to a divisor of {widths[0]}"
            )
        return [c // head_dim for c in widths]
    if any(c % h for c, h in zip(widths, depths)):
        step = math.lcm(*(h // math.gcd(h, 2**i) for i, h in enumerate(depths)))
        raise ValueError(
            f"swin head_scaling=paper: stage widths {widths} are not multiples of their heads {depths} (= the stage "
            f"depths); use a width that is a multiple of {step}, or model.options.head_scaling=width"
        )
    return list(depths)


@register_model("swin")
def build_swin(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    stage_depths: Sequence[int] | None = None,
    head_dim: int = 16,
    head_scaling: str = "width",
    window_size: int | None = 8,
    patch_size: int = 2,
    mlp_ratio: float = 4.0,
    drop_path_rate: float = 0.0,
    variant: str = "timm",
    heads: Sequence[int] | None = None,
    **options: Any,
) -> nn.Module:
    """Swin V2 at this width and depth: timm's (the default; the head and window rules of the module docstring)
    or, with ``variant=original``, torchvision's as the paper presets ran it. Windows that timm would pad are
    refused and stages that attend over one token are warned of before the model is built, naming the option."""
    if options:
        raise ValueError(
            f"unknown swin options {sorted(options)}; it takes variant, stage_depths, head_dim, head_scaling, heads, "
            f"window_size, patch_size, mlp_ratio, drop_path_rate"
        )
    if variant not in VARIANTS:
        raise ValueError(f"swin variant must be one of {list(VARIANTS)}, got {variant!r}")
    if variant == "original":  # torchvision's Swin V2 as the original code built it (models.swin_original)
        if head_scaling != "width":
            raise ValueError(
                "swin variant=original has the original's fixed heads (model.options.heads), not "
                f"head_scaling={head_scaling!r}; leave head_scaling at width"
            )
        return build_original_swin(
            width,
            depth,
            num_classes,
            input_shape,
            stage_depths,
            heads,
            window_size,
            patch_size,
            mlp_ratio,
            drop_path_rate,
        )
    if heads is not None:
        raise ValueError(
            "swin model.options.heads is for variant=original; the default variant sets the heads "
            "by head_scaling and head_dim"
        )
    if head_scaling not in HEAD_SCALINGS:
        raise ValueError(f"swin head_scaling must be one of {list(HEAD_SCALINGS)}, got {head_scaling!r}")
    if stage_depths is None:
        stage_depths = HEAD_SCALINGS[head_scaling]
    if len(stage_depths) < 1 or min(stage_depths) < 1:
        raise ValueError(f"swin stage_depths must be positive integers, got {list(stage_depths)}")
    depths = [depth * d for d in stage_depths]
    widths = [width * 2**i for i in range(len(depths))]
    heads = stage_heads(widths, depths, head_scaling, head_dim)
    in_channels, h, w = check_image_shape(input_shape, "swin")
    if h % patch_size or w % patch_size:
        raise ValueError(
            f"swin: patch size {patch_size} does not divide the {h}x{w} input; pad or crop the images to a multiple "
            f"of {patch_size}, or set model.options.patch_size to a divisor of both sides"
        )
    num_stages = len(stage_depths)
    grids = stage_grids((h // patch_size, w // patch_size), num_stages)
    stage_windows(grids, window_size)  # refuses windows that do not tile a stage's grid
    single = [i + 1 for i, grid in enumerate(grids) if grid == (1, 1)]
    if single:
        warnings.warn(
            f"swin on a {h}x{w} input with patch size {patch_size}: stages {single} see a 1x1 token grid, so their "
            f"attention is over one token (per-token MLP blocks; q/k side gets no gradient); for attention there use "
            f"larger inputs, model.options.patch_size=1, or fewer stages in model.options.stage_depths",
            stacklevel=2,
        )
    with fast_timm_init(timm_swin_transformer_v2):  # timm's init, faster (the muP init replaces it anyway)
        model = StackableSwinTransformerV2(
            img_size=(h, w),
            patch_size=patch_size,
            in_chans=in_channels,
            num_classes=num_classes,
            embed_dim=width,
            depths=tuple(depths),
            num_heads=tuple(heads),
            window_size=timm_window_size(grids, window_size),
            mlp_ratio=mlp_ratio,
            drop_path_rate=drop_path_rate,  # stochastic depth, linear in the block index (timm's rule)
        )
    model.head.fc = MuReadout(model.num_features, num_classes, readout_zero_init=True)
    if not swin_stacked.stackable(model):
        raise AssertionError("swin: the stacked form does not match this structure (models.swin_stacked)")
    return model
