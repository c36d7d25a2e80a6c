"""ConvNeXt V2 through timm, scaled by width and depth, with a MuReadout head.

``timm.models.convnext.ConvNeXt`` configured as timm's ConvNeXt V2 models are (global response
norm in the MLP, no layer scale), with the paper's scaling (Appendix B): patch size 1 (a 1x1
stem, so no spatial reduction before the first stage: 32x32 images keep 32x32 feature maps),
stage widths [w, 2w, 4w, 8w] and stage depths [1, 1, 3, 1] * depth. Each later stage halves the
feature map (2x2 stride-2 convolution), so an input needs at least 8 pixels on a side (8x8 digits
end at 1x1 in the last stage, where the 7x7 depthwise convolution acts per channel).

muP: timm's head.fc is replaced by a MuReadout; every conv and linear weight is re-initialised by
``models.mup_setup.reinit_mup`` (1x1 stem and 7x7 depthwise convolutions have fixed fan-in: O(1)
init, unscaled lr; 2x2 downsampling convs and the MLP's linears are hidden layers). LayerNorm and
GRN parameters are vector-like and keep timm's init (GRN starts as the identity).
"""

from __future__ import annotations

from typing import Any, Sequence

import timm.models.convnext as timm_convnext
from mup import MuReadout
from timm.models.convnext import ConvNeXt

from models import convnext_stacked
from models.mup_setup import fast_timm_init
from models.registry import check_image_shape, register_model
from models.stacking import StackedForm

NUM_STAGES = 4  # timm's ConvNeXt always has four stages


class StackableConvNeXt(StackedForm, ConvNeXt):
    """timm's ConvNeXt with a stacked form: a fit of several members runs them as one network with
    grouped convolutions (models.convnext_stacked) instead of vmap's per-member fallbacks."""

    stacked_form = convnext_stacked


def stage_widths(width: int) -> list[int]:
    return [width * 2**i for i in range(NUM_STAGES)]


def check_convnext_input(input_shape: Sequence[int]) -> None:
    _, h, w = check_image_shape(input_shape, "convnext")
    need = 2 ** (NUM_STAGES - 1)
    if min(h, w) < need:
        sides = [min(h, w) // 2**i for i in range(NUM_STAGES)]
        raise ValueError(
            f"convnext: its {NUM_STAGES - 1} stride-2 downsamplings shrink a {h}x{w} input to nothing "
            f"(sides {' -> '.join(map(str, sides))}); it needs inputs of at least {need}x{need}: resize or pad the data"
        )


@register_model("convnext")
def build_convnext(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    stage_depths: Sequence[int] = (1, 1, 3, 1),
    kernel_size: int = 7,
    patch_size: int = 1,
    conv_mlp: bool = False,
    drop_path_rate: float = 0.0,
    **options: Any,
) -> ConvNeXt:
    """ConvNeXt V2 at this width and depth with a MuReadout head (the module docstring has the scaling).
    The stackable subclass is used wherever a stacked form exists, so a fit of several members runs grouped
    convolutions; ``conv_mlp`` and stochastic depth have no stacked form and fall back to vmap."""
    if options:
        raise ValueError(
            f"unknown convnext options {sorted(options)}; it takes stage_depths, kernel_size, patch_size, conv_mlp, "
            f"drop_path_rate"
        )
    if len(stage_depths) != NUM_STAGES or min(stage_depths) < 1:
        raise ValueError(
            f"convnext stage_depths must be {NUM_STAGES} positive integers (timm's ConvNeXt has {NUM_STAGES} stages), got {list(stage_depths)}"
        )
    in_channels, h, w = check_image_shape(input_shape, "convnext")
    if h % patch_size or w % patch_size:
        raise ValueError(f"convnext patch_size {patch_size} must divide the {h}x{w} input; use patch_size 1")
    check_convnext_input((in_channels, h // patch_size, w // patch_size))
    # conv_mlp (1x1 convolutions and channels-first norms) has no stacked form: vmap stacks it
    # stochastic depth (drop_path_rate > 0) has no stacked form either
    architecture = ConvNeXt if conv_mlp or drop_path_rate > 0 else StackableConvNeXt
    with fast_timm_init(timm_convnext):  # timm's init, faster (the muP init replaces it anyway)
        model = architecture(
            in_chans=in_channels,
            num_classes=num_classes,
            depths=tuple(depth * d for d in stage_depths),
            dims=tuple(stage_widths(width)),
            kernel_sizes=kernel_size,
            patch_size=patch_size,
            use_grn=True,  # ConvNeXt V2
            ls_init_value=None,  # ConvNeXt V2 drops layer scale
            conv_mlp=conv_mlp,
            drop_path_rate=drop_path_rate,  # stochastic depth, linear in the block index (timm's rule)
        )
    model.head.fc = MuReadout(model.num_features, num_classes, readout_zero_init=True)
    if architecture is StackableConvNeXt and not convnext_stacked.stackable(model):
        raise AssertionError("convnext: the stacked form does not match this structure (models.convnext_stacked)")
    return model
