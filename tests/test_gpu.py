"""Every CUDA path, run for real where a GPU exists (``python -m pytest -m gpu``).

Skipped with a reason on CPU-only machines (CI). The CPU tests that stand guard for the same
contracts without a GPU are in test_device.py (teardown simulation, device checks, no host reads
in a step, checksummed checkpoints) and test_loader.py (no host reads per batch).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import schedulefree
import torch

from conftest import FITS, FAST, compose_config, cuda_only, python_path, run_launch
from erasure import fit_eraser
from mdl.run.experiment import run_experiment
from models import create_model
from test_sources import write_cifar10

pytestmark = cuda_only()

GPU = ["device=cuda", *FAST]
MODEL_SETTINGS = {
    "mlp": [],
    "lenet": [],
    "convnext": ["width=16", "model.base_width=16"],
    "swin": ["width=16", "model.base_width=16", "model.options.head_dim=8"],
}
NUMBERS = ("paper_mdl", "online_codelength_bits", "final_val_loss", "blocks", "val_loss_curve")


def _finite_results(results: dict) -> None:
    assert math.isfinite(results["paper_mdl"]) and math.isfinite(results["online_codelength_bits"])
    assert all(math.isfinite(b["eval_bits"]) for b in results["blocks"])


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
@pytest.mark.parametrize("model", sorted(MODEL_SETTINGS))
def test_every_model_runs_end_to_end_on_cuda(model: str, engine: str, tmp_path: Path) -> None:
    cfg = compose_config([*GPU, f"model={model}", *MODEL_SETTINGS[model], FITS[engine]], tmp_path)
    results = run_experiment(cfg, tmp_path / "run")
    _finite_results(results)
    assert results["config"]["device"] == "cuda" and results["fits"] == engine


def test_stacked_run_killed_and_resumed_on_cuda_is_bit_identical(tmp_path: Path, monkeypatch) -> None:
    from test_resume import assert_resumes_exactly

    settings = [
        *GPU,
        "mdl.members_per_fit=all",
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
        "trainer.kwargs.max_epochs=8",
    ]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    assert_resumes_exactly(settings, reference, (1, 3), tmp_path, monkeypatch)


def test_stacked_batches_and_step_make_no_host_synchronisation() -> None:
    from datamodules.augment import Augmentation
    from datamodules.stacked_batches import Pacing, StackedBatches, TrainSource
    from models.stacked_module import StackedClassifier
    from models.stacking import StackedModel

    torch.manual_seed(0)
    models = [create_model("lenet", 16, 1, 10, (3, 16, 16), base_width=16).cuda() for _ in range(3)]
    module = StackedClassifier(
        StackedModel(models), lambda g: schedulefree.AdamWScheduleFree(g, warmup_steps=0), lr=1e-2
    )
    module.train_sums = module.train_sums.cuda()
    optimizer = module.configure_optimizers()
    optimizer.train()
    x, y = torch.rand(200, 3, 16, 16, device="cuda"), torch.randint(0, 10, (200,), device="cuda")
    loader = StackedBatches([TrainSource(x, y)], [50, 120, 200], 32, augment=Augmentation(), pacing=Pacing(4))
    module.train_group(loader.next(2), optimizer)  # warm-up: first kernels, optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # two passes in groups, across member epoch ends (2 steps/epoch for the first member)
            for group in loader:
                module.train_group(group, optimizer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert module.train_sums.device.type == "cuda" and float(module.train_sums.sum()) > 0


def test_launch_py_on_cuda_as_a_user_types_it(tmp_path: Path) -> None:
    proc = run_launch([*GPU, f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cuda" in proc.stdout + proc.stderr
    assert "paper MDL" in proc.stdout


def test_cifar10_format_convnext_qleace_bf16_compiled(tmp_path: Path) -> None:
    """The issue's command: a CIFAR-10-format folder, ConvNeXt, QLEACE fitted on the GPU, trainer=gpu."""
    write_cifar10(tmp_path / "data", per_batch=120)
    args = [
        *GPU,
        "data=cifar10",
        f"paths.data_root={tmp_path / 'data'}",
        "data.options.verify_checksums=false",
        "data.val_size=100",
        "data.first_block=100",
        "model=convnext",
        "width=16",
        "model.base_width=16",
        "eraser=qleace",
        "eraser.options.shrinkage=0.1",
        "trainer=gpu",
        f"paths.output_root={tmp_path / 'out'}",
        "trainer.kwargs.max_epochs=3",
        "trainer.patience=2",
    ]
    proc = run_launch(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "out" / "runs").rglob("results.json")
    _finite_results(json.loads(path.read_text()))


def test_bf16_run_is_finite_and_close_to_fp32(tmp_path: Path) -> None:
    exact = run_experiment(compose_config(GPU, tmp_path / "a"), tmp_path / "a")
    fast = run_experiment(compose_config([*GPU, "trainer.precision=bf16"], tmp_path / "b"), tmp_path / "b")
    _finite_results(fast)
    assert abs(fast["paper_mdl"] - exact["paper_mdl"]) < 0.05 * exact["paper_mdl"]
    assert fast["paper_mdl"] != exact["paper_mdl"]  # bf16 really ran


def test_compiled_runs_compile_once_for_all_blocks(tmp_path: Path) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    results = run_experiment(compose_config([*GPU, "trainer=gpu"], tmp_path), tmp_path / "run")
    _finite_results(results)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # one graph per (train/eval mode, batch-shape family): a handful, not one set per block
    assert 0 < graphs <= 8, graphs


def test_killed_run_resumes_bit_identical_on_cuda(tmp_path: Path) -> None:
    from test_resume import kill_mid_block_and_resume

    kill_mid_block_and_resume(tmp_path, extra=["device=cuda"])


@pytest.mark.parametrize("name", ["leace", "qleace", "alf_qleace"])
def test_eraser_fitted_on_cuda_equals_cpu_fit(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k, d, n = 3, 12, 600
    y = torch.arange(n) % k
    mix = torch.randn(k, d, d, generator=gen, dtype=torch.float64) * 0.3 + torch.eye(d, dtype=torch.float64)
    x = torch.einsum("nd,nde->ne", torch.randn(n, d, generator=gen, dtype=torch.float64), mix[y]) + y[:, None] * 0.2
    on_cpu = fit_eraser(name, x, y, num_classes=k)
    on_gpu = fit_eraser(name, x.cuda(), y.cuda(), num_classes=k)
    for key, value in on_cpu.tensors().items():
        other = on_gpu.tensors()[key].cpu()
        assert value.dtype == other.dtype
        if value.is_floating_point():
            scale = value.abs().max().clamp_min(1e-300)
            assert ((value - other).abs().max() / scale) < 1e-8, key
        else:
            assert torch.equal(value, other), key
    labels = y if on_cpu.requires_labels else None
    out_cpu = on_cpu(x, labels)
    out_gpu = on_gpu(x.cuda(), labels.cuda() if labels is not None else None)
    assert torch.allclose(out_cpu, out_gpu.cpu(), rtol=1e-8, atol=1e-10)


def test_training_step_makes_no_host_synchronisation() -> None:
    """A group of steps of a stack of one (every fit of one member) and of a stack of three."""
    from datamodules.stacked_batches import StackedBatch
    from mdl.engine.stacked_fit import build_members
    from models.stacked_module import StackedClassifier

    make = lambda: create_model("mlp", 64, 2, 10, (1, 8, 8), base_width=64)  # noqa: E731
    for members in (1, 3):
        module = StackedClassifier(
            build_members(make, list(range(members)), torch.device("cuda")),
            lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=0),
            1e-2,
        ).cuda()
        optimizer = module.configure_optimizers()
        optimizer.train()
        x = torch.rand(4, members, 64, 1, 8, 8, device="cuda")
        y = torch.randint(0, 10, (4, members, 64), device="cuda")
        group = StackedBatch(x, y, torch.ones(4, members, 64, device="cuda"), list(range(members)))
        module.train_group(group, optimizer)  # first calls may allocate state and initialise kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            module.train_group(group, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert float(module.train_sums.sum()) > 0


@pytest.mark.parametrize("rows", [128, 1000, 8192])  # CUDA's stable sort takes a different path in each range
@pytest.mark.parametrize("eraser", ["leace", "qleace"])
def test_batches_erased_on_the_fly_synchronise_at_most_for_qleaces_class_counts(eraser: str, rows: int) -> None:
    """augment_then_erase (the paper presets) erases every training batch (the stacked engine a
    whole group of them) on the GPU: LEACE with no host synchronisation, QLEACE with one (its
    batch's class counts); numbers as on the CPU."""

    x, y = torch.rand(600, 3, 8, 8, dtype=torch.float64), torch.arange(600) % 10
    fitted = fit_eraser(eraser, x, y, num_classes=10, shrinkage=0.1) if eraser == "qleace" else fit_eraser(eraser, x, y)
    on_gpu = fitted.to(torch.device("cuda"))
    pick = torch.randint(0, 600, (rows,), generator=torch.Generator().manual_seed(0))
    xb, yb = x[pick].float().cuda(), y[pick].cuda()
    labels = yb if fitted.requires_labels else None
    expected = fitted(xb.cpu(), labels.cpu() if labels is not None else None)
    on_gpu.erase_checked(xb, labels)  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = on_gpu.erase_checked(xb, labels)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == (1 if eraser == "qleace" else 0), syncs
    assert torch.allclose(out.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_eraser_fitted_on_gpu_is_drawn_on_a_cpu_only_machine(tmp_path: Path) -> None:
    """Figure 1 reads saved erasers; one fitted on a GPU must load and apply with no GPU."""
    x = torch.rand(300, 1, 8, 8, device="cuda")
    y = torch.arange(300, device="cuda") % 3
    fit_eraser("qleace", x, y, num_classes=3, shrinkage=0.1).save(tmp_path / "e.safetensors")
    script = (
        "import torch; from erasure import load_eraser; assert not torch.cuda.is_available(); "
        f"e = load_eraser({str(tmp_path / 'e.safetensors')!r}); x = torch.rand(4, 1, 8, 8); "
        "out = e(x, torch.tensor([0, 1, 2, 0])); assert out.device.type == 'cpu' and torch.isfinite(out).all(); print('ok')"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_batch_transfer_hooks_move_a_host_batch_onto_the_gpu() -> None:
    from datamodules.stacked_batches import StackedBatch
    from models.stacked_module import StackedClassifier
    from models.stacking import StackedModel

    cuda = torch.device("cuda")
    x, y = torch.rand(4, 1, 8, 8), torch.randint(0, 10, (4,))
    stack = StackedClassifier(StackedModel([create_model("mlp", 16, 1, 10, (1, 8, 8))]), torch.optim.SGD, lr=0.1)
    group = stack.transfer_batch_to_device(
        StackedBatch(x[None, None], y[None, None], torch.ones(1, 1, 4), [0]), cuda, 0
    )
    assert all(t.is_cuda for t in (group.x, group.y, group.weight)) and torch.equal(group.x.cpu(), x[None, None])


def test_members_per_fit_auto_measures_the_gpu_and_runs(tmp_path: Path) -> None:
    """auto on CUDA: a stack of two members' step takes more memory than one's (measured), and the run finishes
    with the count it chose (all members of the digits MLP fit on any GPU)."""
    from mdl.engine.memory import measured_step_peak, stacked_trial_step
    from mdl.run.components import make_datamodule, make_model_recipe

    cfg = compose_config([*FAST, "device=cuda", "mdl.members_per_fit=auto"], tmp_path)
    dm = make_datamodule(cfg, torch.device("cuda"))
    recipe = make_model_recipe(cfg, dm.num_classes, dm.input_shape)
    peak = measured_step_peak(torch.device("cuda"), lambda m: stacked_trial_step(dm, recipe, [0, 1, 2], m))
    one, two = peak(1), peak(2)
    assert 0 < one < two
    results = run_experiment(cfg, tmp_path / "run")
    assert results["fits"] == "fits by memory" and math.isfinite(results["paper_mdl"])


def test_convnext_stacked_form_runs_on_cuda_in_bf16_and_compiled() -> None:
    """The grouped-convolution form on CUDA (cuDNN's grouped and channels-last kernels): each member's logits
    are its own model's in fp32, and a bf16 step compiled by inductor trains every member."""
    from datamodules.stacked_batches import StackedBatch
    from models.stacked_module import StackedClassifier
    from models.stacking import StackedModel
    from test_conv_stacked import SHAPE, members

    from models.precision import set_float32_precision

    models = [m.cuda() for m in members(4, width=16)]
    x = torch.rand(4, 8, *SHAPE, device="cuda")
    stack = StackedModel(models)
    set_float32_precision(
        "highest"
    )  # true fp32: with cuDNN's default TF32 the two differed by 3.9e-3 (H200, 2026-11-26)
    with torch.no_grad():
        torch.testing.assert_close(stack(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), rtol=1e-3, atol=1e-3)
    module = StackedClassifier(
        stack, lambda g: schedulefree.AdamWScheduleFree(g, warmup_steps=0), 1e-3, precision="bf16"
    ).cuda()  # its loss sums too (a Lightning fit moves them in on_train_start; this step is called directly)
    stack.compile("inductor")
    before = [p.detach().clone() for p in stack.param_dict().values()]
    opt = module.configure_optimizers()
    opt.train()
    batch = StackedBatch(
        x[None], torch.randint(0, 10, (1, 4, 8), device="cuda"), torch.ones(1, 4, 8, device="cuda"), [0, 1, 2, 3]
    )
    module.train_group(batch, opt)
    moved = [(p.detach() - b).flatten(1).abs().amax(1) for p, b in zip(stack.param_dict().values(), before)]
    assert torch.stack(moved).amax(0).gt(0).all()  # every member's weights moved


@pytest.mark.parametrize("fits", ["all", "auto"])
def test_a_pack_of_erasers_and_seeds_trains_on_cuda_with_each_runs_numbers(tmp_path: Path, fits: str) -> None:
    """hydra/launcher=packed's fit on CUDA: runs with their own erased data (none, leace) and seeds in one pack
    (``auto``: fits of what the GPU holds, measured), each with the numbers it has alone on CUDA."""
    from mdl.run.experiment import Job
    from mdl.run.pack import run_pack

    variants = [["eraser=none"], ["eraser=leace"], ["eraser=leace", "seed=1"]]
    settings = [*GPU, f"mdl.members_per_fit={fits}"]
    alone = [
        run_experiment(compose_config([*settings, *v], tmp_path / "a"), tmp_path / "a" / f"run{i}")
        for i, v in enumerate(variants)
    ]
    packed = run_pack(
        [
            Job.checked(compose_config([*settings, *v], tmp_path / "b"), tmp_path / "b" / f"run{i}")
            for i, v in enumerate(variants)
        ]
    )
    for one, other in zip(alone, packed):  # cuBLAS, like CPU BLAS, may pick its batched kernel by the stack's size
        assert other["config"]["device"] == "cuda" and len(other["blocks"]) == len(one["blocks"])
        for key in ("paper_mdl", "online_codelength_bits", "final_val_loss"):
            assert other[key] == pytest.approx(one[key], rel=1e-4), key


@pytest.mark.parametrize("model, calls", [("mlp", 1), ("lenet", 3), ("convnext", 3)])
def test_a_packs_runs_compute_as_stacks_of_their_own_on_cuda(model: str, calls: int, monkeypatch) -> None:
    """StackedModel.run's chunks on CUDA: the conv nets run each run's rows as a stack of their own (outputs those of
    the separate stacks), the MLP one stack for all (fewer launches; its members do not depend on the stack's size)."""
    from models.stacking import StackedModel
    from test_conv_stacked import SHAPE, stack_of

    chunks = [2, 3, 1]
    whole = stack_of(model, range(6)).cuda()
    parts = [stack_of(model, range(0, 2)).cuda(), stack_of(model, range(2, 5)).cuda(), stack_of(model, [5]).cuda()]
    x = torch.rand(6, 4, *SHAPE, device="cuda")
    made = []
    original = StackedModel._run_one
    monkeypatch.setattr(StackedModel, "_run_one", lambda self, *a: made.append(1) or original(self, *a))
    with torch.no_grad():
        out = whole(x, chunks)
        assert len(made) == calls
        alone = torch.cat([part(xi) for part, xi in zip(parts, x.split(chunks))])
    if model == "mlp":  # one stack on CUDA is right only if cuBLAS gives a member its bits whatever the stack's size
        assert torch.equal(out, alone), "drop MLP.stack_size_independent: cuBLAS's bits depend on the stack's size"
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def test_a_stack_of_one_moved_to_cuda_trains_as_its_plain_model() -> None:
    """A stack of one made on the CPU and moved to the GPU (as Lightning moves it) trains through new leaves on the
    GPU's tensors (models.stacking ``_member_leaves``): every step's gradients and parameters equal the plain model's
    on the GPU."""
    from models.stacking import StackedModel

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    stack = StackedModel([make()])
    stack(torch.rand(1, 7, 6)).sum().backward()  # leaves made on the CPU first
    plain, stack = make().cuda(), stack.cuda()
    stack.zero_grad(set_to_none=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, stack)]
    for _ in range(3):
        x = torch.rand(7, 6, device="cuda")
        for opt, forward in zip(optimizers, (lambda: plain(x), lambda: stack(x[None])[0])):
            opt.zero_grad(set_to_none=True)
            forward().square().sum().backward()
        assert all(torch.equal(p.grad, s.grad[0]) for p, s in zip(plain.parameters(), stack.stacked))
        for opt in optimizers:
            opt.step()
    assert all(torch.equal(p, s[0]) for p, s in zip(plain.parameters(), stack.stacked))
