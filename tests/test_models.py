"""The model zoo: every registered model on every input shape, muP plumbing, bad input.

Models are built with the options of their conf/model/<name>.yaml, at small widths (base width
8, width 16; Swin with head_dim 8 so that base width 8 has a head) to keep the file fast on 2
shared CPU cores.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from mup import MuReadout
from omegaconf import OmegaConf

from models import available_models, create_model, depth_scaled_lr, mup_param_groups, restore_base_shapes
from models.mlp import SwiGLU, mlp_param_count, swiglu_param_count
from models.swin import tiling_windows
from mdl.run.config_checks import group_file

# 8x8 digits leave Swin's last stages with a single token; the builder says so (tested below).
pytestmark = pytest.mark.filterwarnings("ignore:swin on a 8x8 input")

SHAPES = [(1, 8, 8), (3, 32, 32), (3, 64, 64)]
WIDTH, BASE = 16, 8
NUM_CLASSES = 10


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster and kinder here
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def model_conf(name: str):
    return group_file("model", name)


def yaml_options(name: str) -> dict:
    return OmegaConf.to_container(model_conf(name).options, resolve=True) or {}


def build(name: str, shape=(1, 8, 8), width: int = WIDTH, depth: int = 1, base_width: int | None = BASE, **extra):
    options = yaml_options(name)
    if name == "swin":
        options["head_dim"] = 8
    return create_model(name, width, depth, NUM_CLASSES, shape, base_width=base_width, **{**options, **extra})


def test_every_model_has_a_config():
    for name in available_models():
        conf = model_conf(name)
        assert conf.name == name
        assert conf.lr_depth_exponent == (1.5 if name == "mlp" else 0.5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", available_models())
def test_forward_backward_reach_every_parameter(name, shape):
    model = build(name, shape)
    # muP zero-initialises the readout (and GRN / Swin post-norm gains start at zero), which
    # blocks every gradient behind them at step 0: perturb those so the check means something.
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().any():
                p.normal_(0, 0.1)
    x = torch.rand(3, *shape)
    logits = model(x)
    assert logits.shape == (3, NUM_CLASSES)
    assert torch.isfinite(logits).all()
    F.cross_entropy(logits, torch.tensor([0, 1, 2])).backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().any()}
    assert missing == single_token_attention_parameters(model), f"no gradient reaches {sorted(missing)}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def single_token_attention_parameters(model) -> set[str]:
    """Swin blocks whose grid is 1x1 attend over one token: softmax = 1, so the query/key side
    (logit scale, q bias, position-bias MLP) cannot get a gradient (models/swin.py says so)."""
    dead = set()
    for name, module in model.named_modules():
        if getattr(module, "window_area", None) == 1:
            dead |= {
                f"{name}.attn.{n}"
                for n, _ in module.attn.named_parameters()
                if n.startswith(("logit_scale", "q_bias", "cpb_mlp"))
            }
    return dead


@pytest.mark.parametrize("name", available_models())
def test_mup_base_shapes_and_init(name):
    # LeNet's original variant has no width dimension (as the original: muP scales nothing; test_lenet_params.py)
    model = build(name, width=64, depth=2, **({"variant": "dense_stack"} if name == "lenet" else {}))
    assert all(hasattr(p, "infshape") for p in model.parameters())
    heads = [m for m in model.modules() if isinstance(m, MuReadout)]
    assert len(heads) == 1 and not heads[0].weight.any()
    assert heads[0].width_mult() == pytest.approx(64 / BASE)
    # hidden weights (two width dimensions): variance 1 / fan_in, not timm's fixed std 0.02
    hidden = [p for p in model.parameters() if p.infshape.ninf() == 2 and p.numel() > 2000]
    assert hidden
    for p in hidden:
        fan_in = p[0].numel()
        assert p.std().item() == pytest.approx(0.88 / math.sqrt(fan_in), rel=0.15)  # 0.88: truncation at 2 std
    groups = mup_param_groups(model, lr=1.0)
    hidden_lrs = {g["lr"] for g in groups if g["width_mult"] != 1.0}
    assert hidden_lrs == {BASE / 64}  # every width dimension of these models is a multiple of the width


def test_standard_parametrisation_keeps_builder_init():
    model = build("convnext", base_width=None)
    assert all(p.infshape.ninf() == 0 for p in model.parameters())
    linear = model.stages[2].blocks[0].mlp.fc1.weight
    assert linear.std().item() == pytest.approx(0.02, rel=0.2)  # timm's init, untouched
    head = [m for m in model.modules() if isinstance(m, MuReadout)][0]
    assert head.weight.abs().sum() > 0 and head.width_mult() == 1


@pytest.mark.parametrize("name", available_models())
def test_base_shapes_survive_deepcopy(name):
    model = build(name)
    x = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    twin = copy.deepcopy(model)
    assert not hasattr(next(twin.parameters()), "infshape")  # what deepcopy does to mup...
    assert torch.equal(twin(x), model(x))  # ...and the forward hook puts it back
    assert [g["lr"] for g in mup_param_groups(copy.deepcopy(model), 1.0)] == [
        g["lr"] for g in mup_param_groups(model, 1.0)
    ]
    bare = copy.deepcopy(model)
    restore_base_shapes(bare)
    assert all(p.infshape == q.infshape for p, q in zip(bare.parameters(), model.parameters()))


@pytest.mark.parametrize("name", ["lenet", "swin"])
def test_base_shapes_survive_checkpoint(name, tmp_path):
    model = build(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    x = torch.rand(2, 1, 8, 8)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    fresh = build(name)
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt"))
    assert torch.equal(fresh(x), model(x))
    assert [g["lr"] for g in mup_param_groups(fresh, 1.0)] == [g["lr"] for g in mup_param_groups(model, 1.0)]
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a pickled whole model (what some users do) keeps them too
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(p.infshape == q.infshape for p, q in zip(loaded.parameters(), model.parameters()))
    assert torch.equal(loaded(x), model(x))


def test_depth_scaled_lr():
    assert depth_scaled_lr(1e-3, 8, 2, 1.5) == pytest.approx(1e-3 / 8)
    assert depth_scaled_lr(1e-3, 8, 2, 0.5) == pytest.approx(1e-3 / 2)
    assert depth_scaled_lr(1e-3, 2, 2, 1.5) == 1e-3


def test_convnext_and_swin_follow_the_paper_scaling():
    convnext = build("convnext", (3, 32, 32), width=16, depth=2)
    assert [s.blocks[0].mlp.fc1.in_features for s in convnext.stages] == [16, 32, 64, 128]
    assert [len(s.blocks) for s in convnext.stages] == [2, 2, 6, 2]
    assert convnext.stem[0].stride == (1, 1)  # patch size 1
    swin = build("swin", (3, 32, 32), width=32, depth=2, base_width=16, head_dim=16)
    assert [s.blocks[0].dim for s in swin.layers] == [32, 64, 128, 256]
    assert [len(s.blocks) for s in swin.layers] == [2, 2, 6, 2]
    assert [s.blocks[0].attn.num_heads for s in swin.layers] == [2, 4, 8, 16]  # head_dim 16: heads grow with width
    assert [s.blocks[0].window_size for s in swin.layers] == [(8, 8), (8, 8), (4, 4), (2, 2)]  # 16x16 token grid
    assert swin.patch_embed.patch_size == (2, 2)


def test_swiglu_is_gated_and_parameter_matched():
    layer = SwiGLU(5, 3)
    x = torch.randn(4, 5)
    gate, value = layer.proj(x)[:, :3], layer.proj(x)[:, 3:]
    assert torch.allclose(layer(x), gate * torch.sigmoid(gate) * value)
    for in_features in (64, 3072):
        for width in (64, 256, 1024):
            for depth in (1, 2, 8):
                relu = build("mlp", (in_features,), width=width, depth=depth, base_width=None)
                glu = build("mlp", (in_features,), width=width, depth=depth, base_width=None, activation="swiglu")
                n_relu = sum(p.numel() for p in relu.parameters())
                n_glu = sum(p.numel() for p in glu.parameters())
                assert n_relu == mlp_param_count(in_features, width, depth, NUM_CLASSES)
                hidden = glu.head.in_features
                one_unit = swiglu_param_count(in_features, hidden + 1, depth, NUM_CLASSES) - n_glu
                assert abs(n_glu - n_relu) <= one_unit / 2, (in_features, width, depth, n_glu, n_relu)  # nearest
                assert abs(n_glu / n_relu - 1) < 0.02


def test_unknown_model_and_options():
    with pytest.raises(ValueError, match="unknown model 'resnet'.*lenet"):
        create_model("resnet", 32, 1, 10, (1, 8, 8))
    with pytest.raises(ValueError, match="unknown convnext options \\['heads'\\]"):
        build("convnext", heads=3)


def test_swin_width_must_fit_the_heads():
    with pytest.raises(ValueError, match="width 24 is not a multiple of head_dim 16.*multiple of 16"):
        build("swin", width=24, head_dim=16)
    with pytest.raises(ValueError, match="muP base swin model at width 8.*model.base_width"):
        build("swin", width=32, base_width=8, head_dim=16)


def test_swin_windows_must_tile_the_grid():
    assert tiling_windows([(12, 12), (6, 6), (3, 3), (2, 2)]) == [1, 3, 6, 12]
    with pytest.raises(ValueError, match="12x12 token grid that 8x8 windows do not tile.*one of \\[1, 3, 6, 12\\]"):
        build("swin", (3, 24, 24))
    model = build("swin", (3, 24, 24), window_size=6)
    assert model(torch.rand(1, 3, 24, 24)).shape == (1, NUM_CLASSES)
    with pytest.raises(ValueError, match="patch size 2 does not divide the 7x7 input"):
        build("swin", (1, 7, 7))


def test_swin_warns_about_single_token_stages():
    with pytest.warns(UserWarning, match="stages \\[3, 4\\] see a 1x1 token grid"):
        build("swin", (1, 8, 8))


def test_inputs_too_small():
    with pytest.raises(ValueError, match="convnext.*4x4 input.*at least 8x8"):
        build("convnext", (1, 4, 4))
    with pytest.raises(ValueError, match="lenet.*3x3 input.*at least 4x4"):
        build("lenet", (1, 3, 3))
    with pytest.raises(ValueError, match="lenet needs images shaped"):
        build("lenet", (64,))
    with pytest.raises(ValueError, match="width must be a positive integer"):
        build("mlp", width=0)


@pytest.mark.parametrize("name,rate", [("convnext", 0.1), ("swin", 0.2)])
def test_stochastic_depth_option(name: str, rate: float) -> None:
    """model.options.drop_path_rate (the paper presets: the original's 0.1 ConvNeXt, 0.2 Swin): timm's DropPath, linear
    in the block index up to the rate; 0 builds none (and ConvNeXt keeps its stacked form)."""
    from timm.layers import DropPath

    from models import create_model

    shape = (3, 16, 16)
    model = create_model(name, 16, 1, 10, shape, base_width=16, drop_path_rate=rate)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert rates and max(rates) == pytest.approx(rate)
    plain = create_model(name, 16, 1, 10, shape, base_width=16)
    assert not any(isinstance(m, DropPath) for m in plain.modules())


ONE_MODEL = """
import sys
from models import available_models, create_model
create_model("mlp", 16, 2, 10, (1, 8, 8))
print(len(available_models()), sorted(m for m in ("models.lenet", "models.convnext", "models.swin", "timm") if m in sys.modules))
"""


@pytest.mark.slow
def test_a_run_imports_only_its_own_models_code_and_every_name_is_listed() -> None:
    """models.registry._ON_DEMAND: a model's module is imported when its name is first asked for, so an MLP run imports
    neither LeNet's code nor timm (ConvNeXt's and Swin's); every shipped name is listed before that."""
    from conftest import run_python

    proc = run_python(ONE_MODEL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "4 []", proc.stdout
