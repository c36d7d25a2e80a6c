"""The stacked Swin V2 (models/swin_stacked.py) for both variants build_swin makes: each member's outputs and
gradients are its own model's (timm's with shifted windows, torchvision's with windows that do not tile the grid, so
zero padding), stochastic depth is drawn per member and per sample, and StackedModel runs it instead of vmap."""

from __future__ import annotations

import sys

import pytest
import timm.layers.drop
import torch
import torchvision.ops.stochastic_depth  # noqa: F401 (the module, in sys.modules; torchvision.ops names the function)
from mup import MuReadout

import models.stacking
from conftest import FAST, run_in_process
from models import create_model, swin_stacked, swin_tables
from models.stacking import StackedModel
from models.swin import StackableSwinTransformerV2
from models.swin_original import StackableSwinTransformer

SHAPE = (3, 16, 16)  # patch 2: an 8x8 token grid, then 4x4
VARIANTS = {
    # timm (ours): 4x4 windows on the 8x8 grid, the second block shifted, a stage with windows covering the grid
    "timm": {"window_size": 4, "stage_depths": [2, 1]},
    # torchvision (the paper's): 7x7 windows pad the 8x8 grid to 14x14 (shifted second block) and 4x4 to 7x7
    "original": {"variant": "original", "window_size": 7, "heads": [2, 4], "stage_depths": [2, 2]},
}


def members(count: int, variant: str, **options) -> list[torch.nn.Module]:
    """Swins of different initial weights whose zero- or constant-initialised parameters (muP's readout, timm's
    residual post-norm gains, biases, logit scales) are randomised too, so every parameter shapes the outputs and
    gets a gradient, each member's different."""
    made = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = create_model("swin", 16, 1, 10, SHAPE, base_width=16, **VARIANTS[variant], **options)
        with torch.no_grad():
            for name, p in model.named_parameters():
                head = isinstance(model.get_submodule(name.rsplit(".", 1)[0]), MuReadout)
                if head or "norm" in name or "bias" in name or "logit_scale" in name:
                    p.normal_(0.0, 0.5)
        made.append(model.to(torch.get_default_dtype()))  # torchvision's coordinates table is made in float32
    return made


def assert_each_member_is_its_own_model(models: list[torch.nn.Module], atol: float) -> None:
    """The stack's outputs (own batches and one shared batch) and every parameter's gradient, member by member,
    against each model's own forward and backward."""
    stack = StackedModel(models)
    x = torch.rand(len(models), 2, *SHAPE)
    stacked = stack(x)
    singles = torch.stack([m(x[i]) for i, m in enumerate(models)])
    torch.testing.assert_close(stacked, singles, rtol=atol, atol=atol)
    with torch.no_grad():
        shared = stack.run(stack.param_dict(), stack.buffer_dict(), x[0], shared_input=True)
        torch.testing.assert_close(shared, torch.stack([m(x[0]) for m in models]), rtol=atol, atol=atol)
    target = torch.randn_like(stacked)
    ((stacked - target) ** 2).sum().backward()
    ((singles - target) ** 2).sum().backward()
    for name, p in stack.param_dict().items():
        each = torch.stack([m.get_parameter(name).grad for m in models])
        assert each.abs().max() > 0, name  # every parameter shapes the outputs
        torch.testing.assert_close(p.grad, each, rtol=10 * atol, atol=atol, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("count", [1, 3])
def test_each_member_gets_its_own_models_outputs_and_gradients(float64, variant: str, count: int) -> None:
    models = members(count, variant)
    assert all(isinstance(m, (StackableSwinTransformerV2, StackableSwinTransformer)) for m in models)
    assert swin_stacked.stackable(models[0])
    assert_each_member_is_its_own_model(models, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_in_float32_too(variant: str) -> None:
    assert_each_member_is_its_own_model(members(3, variant), atol=1e-5)


def test_the_stacks_tested_shift_and_pad_and_make_torchvisions_tables() -> None:
    """What the tests above exercise: timm's 4x4 windows on the 8x8 grid, shifted by 2; torchvision's 7x7 windows over
    the 8x8 grid padded to 14x14 and shifted by 3 (the padded tokens attending unmasked). torchvision's coordinates
    table and position index, which the stacked form makes itself, are its buffers to the bit."""
    block = members(1, "timm")[0].layers[0].blocks[1]
    assert (block.window_size, block.shift_size) == ((4, 4), (2, 2))
    model = members(1, "original")[0]
    block = model.features[1][1]
    assert (block.attn.window_size, block.attn.shift_size) == ([7, 7], [3, 3])
    table, index = swin_tables.torchvision_relative_positions([7, 7], torch.device("cpu"), torch.float32)
    torch.testing.assert_close(table, block.attn.relative_coords_table, rtol=0, atol=0)
    torch.testing.assert_close(index, block.attn.relative_position_index, rtol=0, atol=0)


def test_structures_the_stacked_form_does_not_reproduce_are_not_stackable() -> None:
    timm_swin, torchvision_swin = members(1, "timm")[0], members(1, "original")[0]
    assert swin_stacked.stackable(timm_swin) and swin_stacked.stackable(torchvision_swin)
    timm_swin.layers[0].blocks[1].attn.attn_drop = torch.nn.Dropout(0.1)  # attention dropout: no stacked form
    torchvision_swin.features[1][1].stochastic_depth.mode = "batch"  # one draw for the whole batch
    assert not swin_stacked.stackable(timm_swin) and not swin_stacked.stackable(torchvision_swin)
    assert not swin_stacked.stackable(create_model("convnext", 8, 1, 10, SHAPE, base_width=8))


def test_a_stacked_swin_runs_its_stacked_form_not_vmap(monkeypatch) -> None:
    def no_vmap(*args, **kwargs):
        raise AssertionError("vmap used")

    monkeypatch.setattr(models.stacking, "vmap", no_vmap)
    for variant in VARIANTS:
        stack = StackedModel(members(2, variant))
        assert stack(torch.rand(2, 3, *SHAPE)).shape == (2, 3, 10)


def test_the_stack_is_in_its_models_mode() -> None:
    stack = StackedModel(members(2, "timm"))
    assert stack.template.training
    stack.eval()
    assert not stack.template.training
    stack.train()
    assert stack.template.training


# --- stochastic depth ---------------------------------------------------------------------------------------------


class SharedDraws:
    """The stack's keep factors, recorded as drawn (an (M, B) draw per residual branch, rows and columns different),
    and replayed to each member's own model through the libraries' drop-path functions, row m for member m."""

    def __init__(self) -> None:
        self.drawn: list[torch.Tensor] = []
        self.member = 0
        self.replayed = 0

    def stacked(self, members: int, batch: int, keep: float, like: torch.Tensor) -> torch.Tensor:
        factors = like.new_empty(members, batch).bernoulli_(keep) / keep
        self.drawn.append(factors)
        return factors

    def own(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        factors = self.drawn[self.replayed][self.member]
        self.replayed += 1
        return x * factors.view(-1, *[1] * (x.ndim - 1))

    def start_member(self, member: int) -> None:
        self.member, self.replayed = member, 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_stochastic_depth_is_each_members_own_per_sample(float64, monkeypatch, variant: str) -> None:
    """With the same keep factors, member m's stacked output in training mode is its own model's; the factors differ
    between members and samples, so a stack that shared one draw across members or across a batch would fail."""
    draws = SharedDraws()
    monkeypatch.setattr(swin_stacked, "keep_factors", draws.stacked)
    monkeypatch.setattr(timm.layers.drop, "drop_path", lambda x, p, training, scale: draws.own(x, p, training))
    torchvision_module = sys.modules["torchvision.ops.stochastic_depth"]
    monkeypatch.setattr(torchvision_module, "stochastic_depth", lambda x, p, mode, training: draws.own(x, p, training))
    models = members(3, variant, drop_path_rate=0.5)
    stack = StackedModel(models)
    x = torch.rand(3, 8, *SHAPE)
    torch.manual_seed(0)
    stacked = stack(x)
    blocks = 3 if variant == "timm" else 4
    assert len(draws.drawn) == 2 * (blocks - 1)  # two branches a block; the first block's rate is 0 in both libraries
    for factors in draws.drawn:
        assert (factors == 0).any() and (factors > 0).any()
        assert not (factors == factors[:1]).all() and not (factors == factors[:, :1]).all()
    for m, model in enumerate(models):
        draws.start_member(m)
        torch.testing.assert_close(stacked[m], model(x[m]), rtol=1e-10, atol=1e-10)
        assert draws.replayed == len(draws.drawn)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stochastic_depth_is_off_in_eval_mode_and_when_scoring(variant: str) -> None:
    """Eval mode, and training mode under no_grad (how the stacked engine scores its members): each member's own
    eval-mode output."""
    models = members(2, variant, drop_path_rate=0.5)
    stack = StackedModel(models)
    x = torch.rand(2, 4, *SHAPE)
    expected = torch.stack([m.eval()(x[i]) for i, m in enumerate(models)])
    with torch.no_grad():
        torch.testing.assert_close(stack(x), expected, rtol=1e-5, atol=1e-5)
    stack.eval()
    torch.testing.assert_close(stack(x), expected, rtol=1e-5, atol=1e-5)
    stack.train()
    assert not torch.allclose(stack(x), expected, atol=1e-3)  # training with gradients: paths dropped


def test_keep_factors_are_drawn_per_member_and_sample_scaled_by_keep() -> None:
    """timm's and torchvision's per-sample draw, bernoulli(keep) / keep, independently for every member and sample:
    two members (two samples) agree on about keep^2 + (1 - keep)^2 = 0.625 of the samples (members), not all."""
    torch.manual_seed(0)
    factors = swin_stacked.keep_factors(256, 300, 0.75, torch.zeros(1))
    assert factors.shape == (256, 300)
    assert set(factors.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}
    assert abs(factors.mean().item() - 1.0) < 0.02
    kept = factors > 0
    assert 0.5 < (kept[0] == kept[1]).float().mean() < 0.75
    assert 0.5 < (kept[:, 0] == kept[:, 1]).float().mean() < 0.75


@pytest.mark.slow  # two tiny runs, about 12 s
def test_a_run_of_stacked_swins_codes_as_one_member_per_fit(tmp_path) -> None:
    """End to end (debug=fast): all members in one fit through the stacked form give the paper MDL of one member per
    fit, up to float rounding."""
    results = {
        fits: run_in_process([*FAST, "model=swin", "width=16", f"mdl.members_per_fit={fits}"], tmp_path / fits)
        for fits in ("1", "all")
    }
    assert results["1"]["paper_mdl"] == pytest.approx(results["all"]["paper_mdl"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_swin_blocks_share_graphs_and_none_more_as_members_leave(variant: str) -> None:
    """trainer.compile on a stacked Swin compiles its repeated block (models.swin_stacked.compile_blocks), not the
    whole network: blocks of one structure share a graph, and members leaving the stack or a short batch compile
    nothing more (their axes are symbolic). The eager backend traces as inductor would, fast; numbers as eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    made = members(3, variant)
    eager, compiled = StackedModel(made), StackedModel(made)
    compiled.compile("eager")
    x = torch.rand(3, 3, *SHAPE)
    compiled.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    compiled.train()
    compiled(x).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    blocks = sum(1 for m in made[0].modules() if "Block" in type(m).__name__)
    # the blocks compiled, not the network (that would be one graph per mode): one per block structure and mode
    assert "compiled_block" in compiled.template.__dict__ and 2 < graphs <= 2 * blocks
    compiled.keep(torch.tensor([0, 2]))
    compiled(x[:2]).sum().backward()
    compiled(x[:2, :2]).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
