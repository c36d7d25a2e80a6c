"""muP coordinate check (Yang et al. 2021, Fig. 5) as a test that can fail.

Train each width for a few schedule-free AdamW steps on one fixed batch, then record the mean
absolute value of every layer's output. Under muP (``mup_param_groups``, muP init) those values
stay within a factor 2 across a width range of 8x; under the standard parametrisation (the
builder's own init, one learning rate for all parameters) the same check fails because Adam's
updates of the hidden and output layers add up over fan-in coordinates and grow with width.

The issue's range is widths 64..512. That is cheap for the MLP; ConvNeXt's last stage is 8x the
width (4096 channels at width 512, ~200M parameters), so its 64..512 check is marked slow and the
fast suite checks ConvNeXt over the same 8x range at widths 16..128.
"""

from __future__ import annotations

import pytest
import schedulefree
import torch
import torch.nn.functional as F
from torch import nn

from models import create_model, mup_param_groups

SHAPE = (1, 8, 8)
NUM_CLASSES = 10
FACTOR = 2.0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixed_batch(batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.rand(batch, *SHAPE, generator=g), torch.randint(0, NUM_CLASSES, (batch,), generator=g)


def layer_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Mean |output| of every module that owns parameters (linears, convs, norms, readout)."""
    values: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):

            def record(mod, inputs, out, name=name):
                values[name] = out.detach().abs().mean().item()

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return values


def coordinates(
    name: str, widths: list[int], mup: bool, lr: float, steps: int, depth: int = 2, batch: int = 16, seed: int = 0
) -> dict[str, list[float]]:
    """{layer: [mean |output| at each width]} after ``steps`` optimizer steps at base lr ``lr``."""
    x, y = fixed_batch(batch)
    table: dict[str, list[float]] = {}
    for width in widths:
        torch.manual_seed(seed)
        model = create_model(name, width, depth, NUM_CLASSES, SHAPE, base_width=widths[0] if mup else None)
        params = list(model.parameters())
        groups = mup_param_groups(model, lr) if mup else [{"params": params, "lr": lr}]
        opt = schedulefree.AdamWScheduleFree(groups, lr=lr, warmup_steps=0)
        opt.train()
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for layer, value in layer_outputs(model, x).items():
            table.setdefault(layer, []).append(value)
        del model, opt, groups, params
    return table


def spread(values: list[float]) -> float:
    return max(values) / max(min(values), 1e-12)


def check(name: str, widths: list[int], lr: float, steps: int, depth: int = 2, batch: int = 16) -> None:
    """lr and steps are chosen so the updates, not the init, set the activations, but below the
    learning rate where training itself turns chaotic (where no parametrisation is stable)."""
    mup = coordinates(name, widths, True, lr, steps, depth=depth, batch=batch)
    bad = {layer: v for layer, v in mup.items() if spread(v) > FACTOR}
    assert not bad, (
        f"muP {name}: layers whose mean |activation| varies by more than {FACTOR}x over widths {widths}: {bad}"
    )
    standard = coordinates(name, widths, False, lr, steps, depth=depth, batch=batch)
    # the same check fails in standard parametrisation: the logits (no 1 / width_mult, lr not
    # divided by width) grow several-fold from the narrowest to the widest model
    logits = standard["head" if name == "mlp" else "head.fc"]
    assert logits[-1] / logits[0] > FACTOR, (
        f"standard parametrisation {name}: logits should grow with width, got {logits}"
    )


def test_mlp_coordinates_stay_put_under_mup_only():
    check("mlp", [64, 128, 256, 512], lr=3e-2, steps=2, batch=64)


@pytest.mark.slow
def test_convnext_coordinates_stay_put_under_mup_only_small_widths():
    check("convnext", [16, 32, 64, 128], lr=1e-2, steps=4, depth=1, batch=4)


@pytest.mark.slow
def test_convnext_coordinates_stay_put_under_mup_only():
    # base width 64 instead of 16: the hidden fan-ins of the base model are 4x larger, so the same
    # per-coordinate update moves activations 4x more; lr / 4 keeps the regime of the fast test
    check("convnext", [64, 128, 256, 512], lr=2.5e-3, steps=4, depth=1, batch=4)


def test_original_init_keeps_the_builders_init_under_mup() -> None:
    """model.init=original (the paper presets): nn.Linear's PyTorch default init, biases included, under muP's base
    shapes, the readout zero (mdl/mlp_probe.py@5e66bb9); model.init=mup: muP's variances and zero biases."""
    import math

    from mup import MuReadout
    from torch import nn

    from models import create_model

    torch.manual_seed(0)
    original = create_model("mlp", 256, 2, 10, (1, 8, 8), base_width=128, init="original")
    torch.manual_seed(0)
    ours = create_model("mlp", 256, 2, 10, (1, 8, 8), base_width=128)
    hidden = [m for m in original.modules() if type(m) is nn.Linear]
    assert len(hidden) == 2
    for layer in hidden:
        bound = 1 / math.sqrt(layer.in_features)
        assert float(layer.weight.abs().max()) <= bound and float(layer.bias.abs().max()) > 0
        assert float(layer.weight.std()) == pytest.approx(bound / math.sqrt(3), rel=0.1)  # U(-b, b)
    assert all(float(m.bias.abs().max()) == 0 for m in ours.modules() if type(m) is nn.Linear)
    for model in (original, ours):
        (readout,) = [m for m in model.modules() if isinstance(m, MuReadout)]
        assert float(readout.weight.abs().max()) == 0 and readout.width_mult() == 2
    with pytest.raises(ValueError, match="model.init"):
        create_model("mlp", 256, 2, 10, (1, 8, 8), base_width=128, init="xavier")
