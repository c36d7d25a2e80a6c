"""LeNet is parameter-matched to the MLP over the paper's grid, and is the architecture it claims."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import create_model
from models.lenet import MATCH_TOLERANCE, lenet_param_count, parameter_match, parameter_match_table
from models.mlp import mlp_param_count

WIDTHS = (64, 128, 256, 512, 1024, 2048)
DEPTHS = tuple(range(1, 9))


def smallest_lenet(shape, width, depth) -> int:
    return lenet_param_count(shape, (1, 1), width, depth, 10)


@pytest.mark.parametrize("shape", [(3, 32, 32), (3, 64, 64), (1, 8, 8)], ids=lambda s: "x".join(map(str, s)))
def test_parameter_count_matches_the_mlp_on_the_paper_grid(shape):
    rows = parameter_match_table(shape, WIDTHS, DEPTHS)
    assert len(rows) == len(WIDTHS) * len(DEPTHS)
    # where even one channel per convolution costs more than the MLP's input layer, no match exists
    unachievable = [(r["width"], r["depth"]) for r in rows if smallest_lenet(shape, r["width"], r["depth"]) > r["mlp"] * (1 + MATCH_TOLERANCE)]
    assert unachievable == [], f"no LeNet can match the MLP at (width, depth) {unachievable}"
    off = {(r["width"], r["depth"]): f"{r['rel_gap']:+.2%}" for r in rows if abs(r["rel_gap"]) > MATCH_TOLERANCE}
    assert not off, f"LeNet parameter count more than 5% away from the MLP's at {off}"
    assert max(abs(r["rel_gap"]) for r in rows) < 0.01  # the search actually does better than 5%


def test_counts_are_the_real_modules():
    for shape, width, depth in [((3, 32, 32), 64, 1), ((3, 64, 64), 128, 3), ((1, 8, 8), 64, 2)]:
        match = parameter_match(shape, width, depth)
        lenet = create_model("lenet", width, depth, 10, shape, base_width=None)
        mlp = create_model("mlp", width, depth, 10, shape, base_width=None)
        assert sum(p.numel() for p in lenet.parameters()) == match["lenet"]
        assert sum(p.numel() for p in mlp.parameters()) == match["mlp"] == mlp_param_count(math.prod(shape), width, depth, 10)


def test_extremes_warn_with_the_numbers():
    """Tiny widths on 8x8 inputs: the convolutions alone outweigh the MLP's input layer."""
    with pytest.warns(UserWarning, match="nearest parameter count"):
        create_model("lenet", 1, 1, 10, (1, 8, 8), base_width=None)


def test_lenet_architecture_and_depth():
    model = create_model("lenet", 64, 3, 10, (3, 32, 32), base_width=32)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    dense = [m for m in model.dense if isinstance(m, nn.Linear)]
    assert [c.kernel_size for c in convs] == [(5, 5), (5, 5)] and len(pools) == 2
    assert [c.padding for c in convs] == [(0, 0), (0, 0)]  # classic geometry on 32x32: 5x5 feature maps
    assert dense[0].in_features == convs[1].out_channels * 25
    assert len(dense) == 3 and all(d.out_features == 64 for d in dense)  # depth = number of dense layers
    digits = create_model("lenet", 64, 2, 10, (1, 8, 8), base_width=32)
    assert [c.padding for c in digits.modules() if isinstance(c, nn.Conv2d)] == [(2, 2), (2, 2)]  # 'same' on 8x8


def test_channels_are_finite_dimensions_for_mup():
    """Channels are chosen once at the requested width, so muP does not scale them."""
    model = create_model("lenet", 256, 2, 10, (3, 32, 32), base_width=64)
    for conv in (m for m in model.modules() if isinstance(m, nn.Conv2d)):
        assert conv.weight.infshape.ninf() == 0
    first, second = [m for m in model.dense if isinstance(m, nn.Linear)][:2]
    assert first.weight.infshape.ninf() == 1  # input layer: fixed fan-in
    assert second.weight.infshape.ninf() == 2 and second.weight.infshape.width_mult() == 4
    assert torch.isfinite(model(torch.rand(2, 3, 32, 32))).all()
