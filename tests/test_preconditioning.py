"""The optimizer form of the covariance-power transform: the first layer's gradient times c^2 Sigma^p."""

from __future__ import annotations

from pathlib import Path

import pytest
import schedulefree
import torch

from conftest import FITS, FAST, compose_config
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash
from models import create_model
from models.preconditioning import PreconditionFirstLayer, first_layer_weight
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

PRECONDITION = "optimizer.precondition={p:-1,eps:1.0e-6}"


def _spd(d: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(0))
    return a @ a.T / d + torch.eye(d)


def test_the_first_layer_gradient_is_right_multiplied_for_each_member() -> None:
    torch.manual_seed(0)
    models = [create_model("mlp", 16, 2, 10, (1, 4, 4), base_width=16) for _ in range(2)]
    for m in models:
        m.head.weight.data.normal_()  # the muP readout starts at zero, and so would every hidden gradient
    x, y = torch.rand(2, 8, 1, 4, 4), torch.randint(0, 10, (2, 8))
    p = _spd(16)
    assert first_layer_weight(models[0], 16) == "body.0.weight"
    opt = lambda g: schedulefree.AdamWScheduleFree(g)  # noqa: E731

    stacked = StackedClassifier(StackedModel(models), opt, lr=1e-3)
    logits = stacked.stack(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    weight = stacked.stack.param_dict()["body.0.weight"]
    before = weight.grad.clone()
    PreconditionFirstLayer(p, "body.0.weight").on_before_optimizer_step(None, stacked, None)
    for m in range(2):
        assert torch.allclose(weight.grad[m], before[m] @ p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_a_preconditioned_run_records_its_spectrum_and_trains_differently(engine: str, tmp_path: Path) -> None:
    plain = run_experiment(compose_config([*FAST, FITS[engine]], tmp_path / "a"), tmp_path / "a" / "run")
    cfg = compose_config([*FAST, FITS[engine], PRECONDITION], tmp_path / "b")
    results = run_experiment(cfg, tmp_path / "b" / "run")
    info = results["preconditioning"]
    assert info["parameter"] == "body.0.weight" and info["p"] == -1.0
    assert info["condition_after"] < 1.1 < info["condition_before"]  # whitening: a flat spectrum
    assert results["blocks"] != plain["blocks"]
    assert config_hash(cfg) != config_hash(compose_config([*FAST, FITS[engine]]))


def test_a_model_without_a_linear_first_layer_is_refused(tmp_path: Path) -> None:
    cfg = compose_config([*FAST, "model=lenet", PRECONDITION], tmp_path)
    with pytest.raises(ValueError, match="model=mlp"):
        run_experiment(cfg, tmp_path / "run")
