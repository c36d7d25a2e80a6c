"""Swin's two depth/head scalings (models/swin.py): the paper's Appendix B rule (three stages,
depths and heads [D, D, 3D]) and the default width rule (four stages [1, 1, 3, 1] x D, heads =
stage width / head_dim), and a muP coordinate check for each (the pattern of tests/test_mup.py)."""

from __future__ import annotations

import pytest
import schedulefree
import torch
import torch.nn.functional as F

from models import create_model, mup_param_groups
from test_mup import FACTOR, layer_outputs, spread

pytestmark = pytest.mark.filterwarnings("ignore:swin on a")


def layout(model) -> dict[str, list]:
    return {
        "depths": [len(stage.blocks) for stage in model.layers],
        "heads": [stage.blocks[0].attn.num_heads for stage in model.layers],
        "widths": [stage.blocks[0].dim for stage in model.layers],
    }


@pytest.mark.parametrize("width, depth", [(48, 1), (96, 2), (144, 3)])
def test_paper_scaling_matches_appendix_b(width: int, depth: int) -> None:
    model = create_model("swin", width, depth, 10, (3, 32, 32), base_width=None, head_scaling="paper")
    d = depth
    assert layout(model) == {"depths": [d, d, 3 * d], "heads": [d, d, 3 * d], "widths": [width, 2 * width, 4 * width]}


@pytest.mark.parametrize("width, depth", [(32, 1), (64, 2)])
def test_width_scaling_is_the_default(width: int, depth: int) -> None:
    model = create_model("swin", width, depth, 10, (3, 32, 32), base_width=None, head_dim=16)
    assert layout(model) == {
        "depths": [depth, depth, 3 * depth, depth],
        "heads": [width // 16, 2 * width // 16, 4 * width // 16, 8 * width // 16],
        "widths": [width, 2 * width, 4 * width, 8 * width],
    }


def test_paper_scaling_names_the_widths_that_work() -> None:
    with pytest.raises(ValueError, match="multiple of 3"):
        create_model("swin", 32, 1, 10, (3, 32, 32), base_width=None, head_scaling="paper")
    with pytest.raises(ValueError, match="multiple of 9"):
        create_model("swin", 48, 3, 10, (3, 32, 32), base_width=None, head_scaling="paper")
    with pytest.raises(ValueError, match="head_scaling must be one of"):
        create_model("swin", 32, 1, 10, (3, 32, 32), base_width=None, head_scaling="heads")


def swin_coordinates(widths: list[int], mup: bool, **options) -> dict[str, list[float]]:
    """{layer: [mean |output| at each width]} after a few schedule-free AdamW steps on one batch."""
    gen = torch.Generator().manual_seed(1234)
    x, y = torch.rand(4, 1, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    table: dict[str, list[float]] = {}
    for width in widths:
        torch.manual_seed(0)
        model = create_model("swin", width, 1, 10, (1, 16, 16), base_width=widths[0] if mup else None, **options)
        groups = mup_param_groups(model, 1e-2) if mup else [{"params": list(model.parameters()), "lr": 1e-2}]
        opt = schedulefree.AdamWScheduleFree(groups, lr=1e-2, warmup_steps=0)
        opt.train()
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for layer, value in layer_outputs(model, x).items():
            table.setdefault(layer, []).append(value)
    return table


@pytest.mark.slow
@pytest.mark.parametrize(
    "widths, options",
    [([16, 32, 64, 128], {"head_scaling": "width", "head_dim": 16}), ([24, 48, 96, 192], {"head_scaling": "paper"})],
    ids=["width", "paper"],
)
def test_swin_coordinates_stay_put_under_mup(widths: list[int], options: dict) -> None:
    """Every layer's mean |output| within 2x over an 8x width range under muP. That the check can
    fail is shown under the width rule, whose standard-parametrisation logits grow > 2x; under the
    paper rule (fixed heads) they grow too but less regularly at this lr (1.1-1.5x), so only muP is asserted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mup = swin_coordinates(widths, True, **options)
        standard = swin_coordinates(widths, False, **options) if options["head_scaling"] == "width" else None
    finally:
        torch.set_num_threads(threads)
    bad = {layer: v for layer, v in mup.items() if spread(v) > FACTOR}
    assert not bad, f"muP swin {options}: mean |activation| varies by more than {FACTOR}x over widths {widths}: {bad}"
    if standard is not None:
        logits = standard["head.fc"]
        assert logits[-1] / logits[0] > FACTOR, f"standard parametrisation: logits should grow with width, got {logits}"
