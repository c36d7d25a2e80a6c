"""The conv nets' stacked forms (members folded into channels, grouped convolutions: ConvNeXt's
models/convnext_stacked.py, LeNet's ``forward_stacked``): each member's outputs and gradients are its own
model's, and a step of many members launches about the kernels of one model's step."""

from __future__ import annotations

import copy

import pytest
import schedulefree
import torch
from mup import MuReadout

from conftest import RecordOps
from datamodules.stacked_batches import StackedBatch
from models import create_model
from models.convnext import StackableConvNeXt
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

SHAPE = (3, 16, 16)


def members(count: int, width: int = 8, **options) -> list[torch.nn.Module]:
    """ConvNeXts of different initial weights, with random readouts (muP starts them at zero) and GRN weights
    (timm starts GRN as the identity), so every layer shapes the outputs and gradients."""
    models = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = create_model("convnext", width, 1, 10, SHAPE, base_width=8, **options)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), MuReadout) or ".grn." in name:
                    p.normal_()
        models.append(model)
    return models


def assert_each_member_is_its_own_model(models: list[torch.nn.Module], shape: tuple[int, ...], rtol: float) -> None:
    """The stack's outputs (own batches and one shared batch) and every parameter's gradient, member by member,
    against each model's own forward and backward."""
    stack = StackedModel(models)
    x = torch.rand(len(models), 4, *shape)
    stacked = stack(x)
    singles = torch.stack([m(x[i]) for i, m in enumerate(models)])
    torch.testing.assert_close(stacked, singles, rtol=rtol, atol=rtol)
    shared = stack.run(stack.param_dict(), stack.buffer_dict(), x[0], shared_input=True)
    torch.testing.assert_close(shared, torch.stack([m(x[0]) for m in models]), rtol=rtol, atol=rtol)
    target = torch.randn_like(stacked)
    ((stacked - target) ** 2).sum().backward()
    ((singles - target) ** 2).sum().backward()
    for name, p in stack.param_dict().items():
        each = torch.stack([m.get_parameter(name).grad for m in models])
        torch.testing.assert_close(p.grad, each, rtol=10 * rtol, atol=rtol, msg=name)


def test_each_member_gets_its_own_models_outputs_and_gradients(float64) -> None:
    models = members(3)
    assert all(isinstance(m, StackableConvNeXt) for m in models)
    assert_each_member_is_its_own_model(models, SHAPE, rtol=1e-10)


def test_the_conv_mlp_variant_is_stacked_by_vmap_with_the_same_results() -> None:
    models = members(2, conv_mlp=True)
    assert not hasattr(models[0], "forward_stacked")
    x = torch.rand(2, 3, *SHAPE)
    torch.testing.assert_close(
        StackedModel(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), rtol=1e-4, atol=1e-5
    )


def _step_kernels(models: list[torch.nn.Module], shape: tuple[int, ...] = SHAPE) -> tuple[int, int]:
    """Kernels of one optimizer step (forward, backward, update) of one model (a stack of one runs it plain), and of a
    stack of ``models``."""
    optimizer = lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=2)  # noqa: E731
    count = len(models)
    single = StackedClassifier(StackedModel([copy.deepcopy(models[0])]), optimizer, 1e-2)
    stack = StackedClassifier(StackedModel(models), optimizer, 1e-2)
    x, y = torch.rand(count, 8, *shape), torch.randint(0, 10, (count, 8))
    counts = []
    for module, group in (
        (single, StackedBatch(x[None, :1], y[None, :1], torch.ones(1, 1, 8), [0])),
        (stack, StackedBatch(x[None], y[None], torch.ones(1, count, 8), list(range(count)))),
    ):
        opt = module.configure_optimizers()
        opt.train()
        module.train_group(group, opt)  # the first step creates the optimizer's state
        with RecordOps() as record:
            module.train_group(group, opt)
        counts.append(len(record.kernels))
    return counts[0], counts[1]


@pytest.mark.slow  # ConvNeXt's ops recorded one by one, 14 s (LeNet's: the fast test below)
def test_a_step_of_ten_members_launches_at_most_one_and_a_half_times_one_models_kernels() -> None:
    """Issue 25's criterion (counted exactly, as benchmarks/bench_engines.py does): vmap's form launched
    more per step (its adaptive-pool fallback loops over members); the grouped form does not grow with M."""
    one, ten = _step_kernels(members(10))
    assert ten <= 1.5 * one, (one, ten)
    assert _step_kernels(members(2))[1] == ten  # nothing per member


def lenets(count: int, shape: tuple[int, ...], **options) -> list[torch.nn.Module]:
    """LeNets of different initial weights with random readouts (muP starts them at zero)."""
    models = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = create_model("lenet", 16, 2, 10, shape, base_width=8, **options)
        with torch.no_grad():
            model.head.weight.normal_()
        models.append(model)
    return models


LENETS = [
    ((1, 8, 8), {}),
    ((3, 16, 16), {"padding": 0}),
    ((1, 8, 8), {"variant": "dense_stack", "activation": "gelu"}),
    ((3, 12, 10), {"variant": "dense_stack", "channels": [3, 5]}),
]


@pytest.mark.parametrize(("shape", "options"), LENETS)
def test_each_lenet_member_gets_its_own_models_outputs_and_gradients(float64, shape, options) -> None:
    assert_each_member_is_its_own_model(lenets(3, shape, **options), shape, rtol=1e-12)


def test_a_lenet_step_of_ten_members_launches_at_most_one_and_a_half_times_one_models_kernels() -> None:
    """vmap's form launched 1.68x one LeNet's kernels per step (89 against 53 in bench_engines.py); the grouped form
    does not grow with M."""
    one, ten = _step_kernels(lenets(10, (1, 8, 8)), (1, 8, 8))
    assert ten <= 1.5 * one, (one, ten)
    assert _step_kernels(lenets(2, (1, 8, 8)), (1, 8, 8))[1] == ten


def stack_of(model: str, seeds) -> StackedModel:
    made = []
    for s in seeds:
        torch.manual_seed(s)
        made.append(create_model(model, 8, 1, 10, SHAPE, base_width=8))
    return StackedModel(made)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["convnext", "lenet"])
def test_rows_run_in_chunks_compute_as_stacks_of_their_own_to_the_bit(model: str) -> None:
    """A pack's runs (StackedModel.run's ``chunks``): the outputs and gradients of each chunk of rows are those of a
    stack of just its members, bit for bit (one stack of all rows: only to rounding, grouped convolutions). A stack
    of one runs its plain model, so packs train one member per run in fits of their own (mdl.engine.driver)."""
    chunks = [2, 3, 2]
    whole, parts = (
        stack_of(model, range(7)),
        [stack_of(model, range(0, 2)), stack_of(model, range(2, 5)), stack_of(model, range(5, 7))],
    )
    x = torch.rand(7, 4, *SHAPE)
    out = whole(x, chunks)
    alone = [part(xi) for part, xi in zip(parts, x.split(chunks))]
    assert torch.equal(out, torch.cat(alone))
    target = torch.randn_like(out)
    ((out - target) ** 2).sum().backward()
    ((torch.cat(alone) - target) ** 2).sum().backward()
    for name, p in whole.param_dict().items():
        assert torch.equal(p.grad, torch.cat([part.param_dict()[name].grad for part in parts])), name
    shared = whole.run(whole.param_dict(), whole.buffer_dict(), x[0], shared_input=True, chunks=chunks)
    assert torch.equal(
        shared, torch.cat([part.run(part.param_dict(), part.buffer_dict(), x[0], shared_input=True) for part in parts])
    )


def test_chunks_are_ignored_only_on_a_gpu_and_only_where_members_do_not_depend_on_the_stack_size(monkeypatch) -> None:
    """The MLP's batched matmuls give a member its bits whatever the stack's size: on a GPU a pack keeps one stack
    (fewer launches); a CPU runs every model's chunks (faster there); conv nets run theirs everywhere."""
    from models.stacking import runs_as_one_stack

    mlp, lenet = stack_of("mlp", [0]).template, stack_of("lenet", [0]).template
    assert runs_as_one_stack(mlp, torch.device("cuda")) and not runs_as_one_stack(mlp, torch.device("cpu"))
    assert not runs_as_one_stack(lenet, torch.device("cuda")) and not runs_as_one_stack(lenet, torch.device("cpu"))
    made = []
    original = StackedModel._run_one
    monkeypatch.setattr(StackedModel, "_run_one", lambda self, *a: made.append(1) or original(self, *a))
    stack_of("mlp", range(6))(torch.rand(6, 4, *SHAPE), [2, 3, 1])
    assert len(made) == 3


@pytest.mark.slow
def test_inductor_compiles_convnexts_stacked_form_on_one_channel_images(tmp_path, monkeypatch) -> None:
    """trainer.compile=true's inductor on ConvNeXt's grouped form with one-channel images failed before (the fold was a
    view whose strides depend on the member count, tests/test_pack.py says more): a training step and an evaluation
    on one shared batch compile and match the eager stack."""
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    shape = (1, 8, 8)
    made = []
    for seed in range(3):
        torch.manual_seed(seed)
        made.append(create_model("convnext", 8, 1, 10, shape, base_width=8))
    eager, compiled = StackedModel(made), StackedModel(made)
    compiled.compile("inductor")
    x = torch.rand(3, 16, *shape)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    compiled(x).sum().backward()
    with torch.no_grad():
        shared = compiled.run(compiled.param_dict(), compiled.buffer_dict(), x[0], shared_input=True)
    torch.testing.assert_close(
        shared, eager.run(eager.param_dict(), eager.buffer_dict(), x[0], shared_input=True), rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_compiled_convnext_blocks_make_one_graph_per_stage_however_many_members_leave() -> None:
    """trainer.compile on a stacked ConvNeXt compiles the repeated block (models.convnext_stacked.compile_blocks),
    not the whole network: one graph per stage for training and one for evaluation, and none more when members leave
    the stack or a batch is short (their axes are symbolic). The eager backend traces as inductor would, fast."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    stack = StackedModel([create_model("convnext", 8, 1, 10, (3, 16, 16), base_width=8) for _ in range(3)])
    stack.compile("eager")
    x = torch.rand(3, 4, 3, 16, 16)
    stack(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 4  # ConvNeXt's four stages
    stack.keep(torch.tensor([0, 2]))
    stack(x[:2]).sum().backward()
    stack(x[:2, :3]).sum().backward()
    assert counters["stats"]["unique_graphs"] == 4
    with torch.no_grad():
        stack(x[:2])
    assert counters["stats"]["unique_graphs"] == 8
    torch._dynamo.reset()
