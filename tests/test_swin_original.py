"""model.options.variant=original (issue 35 D6): torchvision's Swin V2 as the original code built it (EleutherAI/mdl
mdl/vision_probe.py@5e66bb9 SwinProbe): the presets' shapes, a CIFAR-sized forward on the CPU, and its windows that
do not tile the grid: zero padding at the bottom and right, padded tokens unmasked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torchvision.models.swin_transformer import ShiftedWindowAttentionV2, SwinTransformer

from conftest import CONF
from models import create_model


def preset_swin(overrides: list[str] = ()) -> tuple:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config", overrides=["+experiment=paper/table16", "model=swin", "eraser=none", "seed=0", *overrides]
        )
    options = dict(cfg.model.options)
    model = create_model(
        "swin", cfg.width, cfg.depth, 10, (3, 32, 32), base_width=cfg.model.base_width, init=cfg.model.init, **options
    )
    return cfg, model


def test_the_presets_swin_is_the_originals_atto_and_runs_on_a_cifar_batch() -> None:
    cfg, model = preset_swin()
    assert isinstance(model, SwinTransformer) and cfg.model.options.variant == "original"
    stages = [m for m in model.features if isinstance(m, torch.nn.Sequential) and len(m) and hasattr(m[0], "attn")]
    assert [len(s) for s in stages] == [2, 2, 6, 2]  # original: vision_probe.py@5e66bb9:225
    assert [s[0].attn.num_heads for s in stages] == [2, 4, 8, 16]  # :204
    assert [s[0].norm1.normalized_shape[0] for s in stages] == [40, 80, 160, 320]  # embed_dim 40, :205
    assert {tuple(b.attn.window_size) for s in stages for b in s} == {(7, 7)}  # :227
    assert model.features[0][0].kernel_size == (2, 2)  # :223
    assert max(b.stochastic_depth.p for s in stages for b in s) == pytest.approx(0.2)  # :229, the last block
    model.eval()
    out = model(torch.rand(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_the_default_swin_is_unchanged() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["model=swin"])
    assert (cfg.model.options.variant, cfg.model.options.window_size, cfg.model.options.heads) == ("timm", 8, None)


@pytest.mark.parametrize("grid, shift", [((16, 16), 3), ((8, 8), 3), ((2, 2), 3)])
def test_a_window_that_does_not_tile_pads_with_zeros_that_attend_unmasked(grid, shift) -> None:
    """Known answer: attention on an HxW grid equals attention on the same grid explicitly zero-padded (bottom,
    right) to a multiple of 7 and cropped back, i.e. the padded tokens are ordinary zero tokens, not masked; and
    it differs from attention over the real tokens alone (a mask that removed the padding)."""
    torch.manual_seed(0)
    attn = ShiftedWindowAttentionV2(16, [7, 7], [shift, shift], num_heads=2).eval()
    torch.nn.init.normal_(attn.qkv.bias)  # padded zero tokens then carry the bias into q, k and v
    x = torch.randn(1, *grid, 16)
    h, w = grid
    padded = F.pad(x, (0, 0, 0, -w % 7, 0, -h % 7))
    with torch.no_grad():
        assert torch.allclose(attn(x), attn(padded)[:, :h, :w], atol=1e-6)
        if grid == (2, 2):  # one window over the padded 7x7 grid, no shift: masking the 45 zero tokens changes it
            masked = _attention_over_real_tokens(attn, x)
            assert not torch.allclose(attn(x), masked, atol=1e-3)


def _attention_over_real_tokens(attn: ShiftedWindowAttentionV2, x: torch.Tensor) -> torch.Tensor:
    """The same block's attention with the padded tokens masked out (what torchvision does not do): the 2x2 grid
    placed in the top-left of a 7x7 window, keys restricted to the 4 real tokens."""
    b, h, w, c = x.shape
    window = F.pad(x, (0, 0, 0, 7 - w, 0, 7 - h)).reshape(b, 49, c)
    bias = attn.qkv.bias.clone()
    bias[c : 2 * c] = 0
    q, k, v = (
        F.linear(window, attn.qkv.weight, bias)
        .reshape(b, 49, 3, attn.num_heads, c // attn.num_heads)
        .permute(2, 0, 3, 1, 4)
    )
    logits = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logits = (
        logits * torch.clamp(attn.logit_scale, max=torch.log(torch.tensor(100.0))).exp()
        + attn.get_relative_position_bias()
    )
    real = torch.zeros(7, 7, dtype=torch.bool)
    real[:h, :w] = True
    logits = logits.masked_fill(~real.reshape(1, 1, 1, 49), float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, 49, c)
    return attn.proj(out).reshape(b, 7, 7, c)[:, :h, :w]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="not multiples of their heads"):
        create_model("swin", 41, 1, 10, (3, 32, 32), base_width=40, variant="original", window_size=7)
    with pytest.raises(ValueError, match="head_scaling"):
        create_model("swin", 40, 1, 10, (3, 32, 32), base_width=40, variant="original", head_scaling="paper")
    with pytest.raises(ValueError, match="variant must be one of"):
        create_model("swin", 40, 1, 10, (3, 32, 32), base_width=40, variant="hf")
    with pytest.raises(ValueError, match="heads is for variant=original"):
        create_model("swin", 32, 1, 10, (3, 32, 32), base_width=32, heads=[2, 4, 8, 16])
