"""LeNet is parameter-matched to the MLP over the paper's grid, and is the architecture it claims:
the original code's (variant=original, the default) and this project's earlier one (variant=dense_stack)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import create_model
from models.lenet import (
    MATCH_TOLERANCE,
    build_lenet,
    param_count,
    resolve_lenet,
    original_sizes,
    parameter_match,
    parameter_match_table,
)
from models.mlp import mlp_param_count

WIDTHS = (64, 128, 256, 512, 1024, 2048)
DEPTHS = tuple(range(1, 9))


# The original code's search run as published (EleutherAI/mdl experiments/generate_parameter_matched_conv.py at
# 2a41748: find_closest_config over the MLP's count at input 3x32x32, 10 classes) on its own grid
# (sweep_eraser.py: widths 64..2048, depths 1, 2, 3, 4, 6, 8): "depth_width" -> (conv, fc, LeNet parameters).
# Produced by running that function outside this repository; not derived from our code.
ORIGINAL_SEARCH = {
    "1_64": ((48, 40), (128, 128), 197618),
    "1_128": ((128, 64), (64, 1024), 393866),
    "1_256": ((32, 48), (512, 256), 789690),
    "1_512": ((64, 48), (1024, 256), 1576506),
    "1_1024": ((48, 40), (2048, 512), 3155954),
    "1_2048": ((40, 40), (2048, 2048), 6309970),
    "2_64": ((32, 32), (128, 512), 201770),
    "2_128": ((128, 40), (256, 64), 411122),
    "2_256": ((48, 40), (256, 2048), 854770),
    "2_512": ((64, 48), (1024, 512), 1841466),
    "2_1024": ((48, 40), (2048, 1024), 4210162),
    "2_2048": ((32, 128), (2048, 2048), 10877450),
    "3_64": ((64, 40), (128, 64), 205938),
    "3_128": ((48, 64), (128, 1024), 427786),
    "3_256": ((40, 64), (512, 64), 920298),
    "3_512": ((128, 64), (512, 2048), 2105418),
    "3_1024": ((32, 64), (2048, 1024), 5440970),
    "3_2048": ((128, 128), (2048, 2048), 11191946),
    "4_64": ((64, 40), (64, 1024), 209778),
    "4_128": ((48, 40), (256, 512), 444658),
    "4_256": ((48, 32), (512, 1024), 987754),
    "4_512": ((48, 40), (2048, 128), 2365298),
    "4_1024": ((40, 40), (2048, 2048), 6309970),
    "4_2048": ((128, 128), (2048, 2048), 11191946),
    "6_64": ((64, 64), (64, 128), 219402),
    "6_128": ((40, 32), (512, 64), 478666),
    "6_256": ((64, 40), (512, 1024), 1116978),
    "6_512": ((128, 48), (2048, 128), 2886586),
    "6_1024": ((32, 128), (2048, 1024), 8769034),
    "6_2048": ((128, 128), (2048, 2048), 11191946),
    "8_64": ((48, 48), (128, 64), 223930),
    "8_128": ((40, 64), (256, 128), 511146),
    "8_256": ((48, 128), (256, 1024), 1250250),
    "8_512": ((48, 48), (1024, 2048), 3410810),
    "8_1024": ((32, 128), (2048, 2048), 10877450),
    "8_2048": ((128, 128), (2048, 2048), 11191946),
}


@pytest.mark.slow
def test_the_original_lenet_sizes_are_the_original_searchs():
    for key, (conv, fc, params) in ORIGINAL_SEARCH.items():
        depth, width = map(int, key.split("_"))
        assert original_sizes((3, 32, 32), width, depth, 10) == (conv, fc), key
        model = create_model("lenet", width, depth, 10, (3, 32, 32), base_width=None)
        if key in ("2_128", "8_2048", "1_64"):  # building every model would take long; counts are checked below
            assert sum(p.numel() for p in model.parameters()) == params, key
        assert parameter_match((3, 32, 32), width, depth)["lenet"] == params, key


def test_the_original_lenet_is_conv_conv_fc_fc_readout_whatever_the_depth():
    for depth in (1, 2, 8):
        model = create_model("lenet", 128, depth, 10, (3, 32, 32), base_width=128)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        dense = [m for m in model.dense if isinstance(m, nn.Linear)]
        assert len(convs) == 2 and len(dense) == 2 and [c.padding for c in convs] == [(0, 0), (0, 0)]
    model = create_model("lenet", 128, 2, 10, (3, 32, 32), base_width=128)
    assert [c.out_channels for c in model.modules() if isinstance(c, nn.Conv2d)] == [128, 40]  # the example
    assert [d.out_features for d in model.dense if isinstance(d, nn.Linear)] == [256, 64]
    assert model.head.in_features == 64 and torch.isfinite(model(torch.rand(2, 3, 32, 32))).all()
    # as the original (base model built with the same sizes), muP scales no LeNet dimension
    assert all(p.infshape.ninf() == 0 for n, p in model.named_parameters() if not n.startswith("head"))
    digits = create_model("lenet", 128, 2, 10, (1, 8, 8), base_width=128)  # padded to fit 8x8
    assert torch.isfinite(digits(torch.rand(2, 1, 8, 8))).all()


def test_the_original_grid_cannot_reach_the_widest_mlps_and_says_so():
    """Its largest configuration has 11.2M parameters; the MLP at width 2048, depth 8 has 35.7M."""
    match = parameter_match((3, 32, 32), 2048, 8)
    assert match["channels"] == (128, 128) and match["dense"] == (2048, 2048) and match["rel_gap"] < -0.6
    with pytest.warns(UserWarning, match="original's size grid"):
        create_model("lenet", 2048, 8, 10, (3, 32, 32), base_width=None)


def smallest_lenet(shape, width, depth) -> int:
    return param_count(shape, (1, 1), [width] * depth, 10)


@pytest.mark.parametrize("shape", [(3, 32, 32), (3, 64, 64), (1, 8, 8)], ids=lambda s: "x".join(map(str, s)))
def test_parameter_count_matches_the_mlp_on_the_paper_grid(shape):
    rows = parameter_match_table(shape, WIDTHS, DEPTHS, variant="dense_stack")
    assert len(rows) == len(WIDTHS) * len(DEPTHS)
    # where even one channel per convolution costs more than the MLP's input layer, no match exists
    unachievable = [
        (r["width"], r["depth"])
        for r in rows
        if smallest_lenet(shape, r["width"], r["depth"]) > r["mlp"] * (1 + MATCH_TOLERANCE)
    ]
    assert unachievable == [], f"no LeNet can match the MLP at (width, depth) {unachievable}"
    off = {(r["width"], r["depth"]): f"{r['rel_gap']:+.2%}" for r in rows if abs(r["rel_gap"]) > MATCH_TOLERANCE}
    assert not off, f"LeNet parameter count more than 5% away from the MLP's at {off}"
    assert max(abs(r["rel_gap"]) for r in rows) < 0.01  # the search actually does better than 5%


def test_counts_are_the_real_modules():
    for shape, width, depth in [((3, 32, 32), 64, 1), ((3, 64, 64), 128, 3), ((1, 8, 8), 64, 2)]:
        match = parameter_match(shape, width, depth, variant="dense_stack")
        lenet = create_model("lenet", width, depth, 10, shape, base_width=None, variant="dense_stack")
        mlp = create_model("mlp", width, depth, 10, shape, base_width=None)
        assert sum(p.numel() for p in lenet.parameters()) == match["lenet"]
        assert (
            sum(p.numel() for p in mlp.parameters())
            == match["mlp"]
            == mlp_param_count(math.prod(shape), width, depth, 10)
        )


def test_extremes_warn_with_the_numbers():
    """Tiny widths on 8x8 inputs: the convolutions alone outweigh the MLP's input layer."""
    with pytest.warns(UserWarning, match="nearest parameter count"):
        create_model("lenet", 1, 1, 10, (1, 8, 8), base_width=None, variant="dense_stack")


def test_lenet_architecture_and_depth():
    model = create_model("lenet", 64, 3, 10, (3, 32, 32), base_width=32, variant="dense_stack")
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    dense = [m for m in model.dense if isinstance(m, nn.Linear)]
    assert [c.kernel_size for c in convs] == [(5, 5), (5, 5)] and len(pools) == 2
    assert [c.padding for c in convs] == [(0, 0), (0, 0)]  # classic geometry on 32x32: 5x5 feature maps
    assert dense[0].in_features == convs[1].out_channels * 25
    assert len(dense) == 3 and all(d.out_features == 64 for d in dense)  # depth = number of dense layers
    digits = create_model("lenet", 64, 2, 10, (1, 8, 8), base_width=32, variant="dense_stack")
    assert [c.padding for c in digits.modules() if isinstance(c, nn.Conv2d)] == [(2, 2), (2, 2)]  # 'same' on 8x8


def test_channels_are_finite_dimensions_for_mup():
    """Channels are chosen once at the requested width, so muP does not scale them."""
    model = create_model("lenet", 256, 2, 10, (3, 32, 32), base_width=64, variant="dense_stack")
    for conv in (m for m in model.modules() if isinstance(m, nn.Conv2d)):
        assert conv.weight.infshape.ninf() == 0
    first, second = [m for m in model.dense if isinstance(m, nn.Linear)][:2]
    assert first.weight.infshape.ninf() == 1  # input layer: fixed fan-in
    assert second.weight.infshape.ninf() == 2 and second.weight.infshape.width_mult() == 4
    assert torch.isfinite(model(torch.rand(2, 3, 32, 32))).all()


@pytest.mark.parametrize(
    "options",
    [
        {"variant": "dense_stack", "channels": [6, 16, 32]},
        {"channels": [6, 16, 32], "dense": [64, 64]},
        {"variant": "dense_stack", "channels": []},
    ],
)
def test_given_channels_of_the_wrong_length_are_refused_by_name(options: dict) -> None:
    """Sizes a user gives are not searched: the resolver passes them on and the model refuses them in words."""
    with pytest.raises(ValueError, match=r"lenet channels must be two positive integers"):
        build_lenet(64, 2, 10, (1, 8, 8), **resolve_lenet(64, 2, 10, (1, 8, 8), **options))
