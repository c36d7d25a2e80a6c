"""Spectral decoupling (gradient-starvation thesis, ch. 6) as a training-loss option.

Known answers: the penalty's gradient in closed form, lambda = 0 trains bit for bit as plain
cross-entropy in both engines, the thesis' two-moons experiment (Sec. 6.2 and 6.4.1, Fig. 6.1)
gives SD the larger margin, and a run's MDL numbers are plain cross-entropy of its scored models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import schedulefree
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hydra import compose, initialize_config_dir

from conftest import (
    CONF,
    FAST,
    FITS,
    RecordOps,
    assert_members_equal_singles,
    compose_config,
    host_reads,
    run_in_process,
    run_launch,
)
from mdl.run.components import make_loss, make_model_factory
from mdl.run.experiment import run_experiment
from models import create_model
from models.losses import SpectralDecoupling, loss_from_options, spectral_penalty
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# --- the penalty ------------------------------------------------------------------------------


def test_penalty_gradient_is_the_closed_form(float64) -> None:
    """d/dz mean_i lambda_y/2 ||z_i - gamma_y e_y||^2 = lambda_y (z - gamma_y e_y) / B (lambda z / B plain)."""
    gen = torch.Generator().manual_seed(0)
    b, k = 64, 5
    y = torch.randint(0, k, (b,), generator=gen)
    for sd in (
        SpectralDecoupling(0.3),
        SpectralDecoupling(0.0, (0.1, 0.2, 0.0, 1.5, 0.7), (0.44, 2.5, -1.0, 0.0, 3.0)),
    ):
        z = torch.randn(b, k, generator=gen, requires_grad=True)
        (grad,) = torch.autograd.grad(spectral_penalty(z, y, sd).mean(), z)
        if sd.class_lambda is None:
            closed = sd.lam * z.detach() / b
        else:
            lam = torch.tensor(sd.class_lambda)[y, None]
            closed = lam * (z.detach() - torch.tensor(sd.class_gamma)[y, None] * F.one_hot(y, k)) / b
        error = ((grad - closed).norm() / closed.norm()).item()
        print(f"relative gradient error, {'per-class' if sd.class_lambda else 'plain'}: {error:.2e}")
        assert error < 1e-14
        assert torch.autograd.gradcheck(lambda t: spectral_penalty(t, y, sd).mean(), (z,))


def test_per_class_form_with_equal_lambdas_and_zero_targets_is_eq_6_3_17(float64) -> None:
    z, y = torch.randn(32, 4), torch.randint(0, 4, (32,))
    plain = spectral_penalty(z, y, SpectralDecoupling(0.25))
    assert torch.allclose(plain, 0.125 * z.square().sum(1), rtol=1e-15, atol=0)
    per_class = spectral_penalty(z, y, SpectralDecoupling(9.0, (0.25,) * 4, (0.0,) * 4))  # class_lambda replaces lambda
    assert torch.allclose(per_class, plain, rtol=1e-15, atol=0)


def test_training_step_adds_exactly_the_penalty_gradient_to_the_logits() -> None:
    """Through a stack of one's training step: grad on the logits = cross-entropy's + lambda * z / B."""

    class Logits(nn.Module):  # a "model" whose output is a leaf, to read the gradient on the logits
        def __init__(self, z: Tensor) -> None:
            super().__init__()
            self.z = nn.Parameter(z.clone())

        def forward(self, x: Tensor) -> Tensor:
            return self.z

    gen = torch.Generator().manual_seed(1)
    z, y = 3 * torch.randn(16, 10, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    module = StackedClassifier(StackedModel([Logits(z)]), torch.optim.SGD, 1.0, loss=SpectralDecoupling(0.2))
    module.step_loss(torch.zeros(1, 16, 1), y[None], torch.ones(1, 16)).backward()
    zz = z.clone().requires_grad_()
    (ce_grad,) = torch.autograd.grad(F.cross_entropy(zz, y), zz)
    expected = ce_grad + 0.2 * z / 16
    assert torch.allclose(module.stack.param_dict()["z"].grad[0], expected, rtol=1e-6, atol=1e-7)
    assert module.train_sums[0].item() == pytest.approx(16 * F.cross_entropy(z, y).item(), rel=1e-6)  # plain CE


def test_loss_options_are_checked() -> None:
    assert loss_from_options(None) is None and loss_from_options({"name": "ce"}) is None
    sd = loss_from_options(
        {"name": "spectral_decoupling", "lambda": 0.1, "class_lambda": [1, 2], "class_gamma": None}, 2
    )
    assert sd == SpectralDecoupling(0.1, (1, 2), None)
    for options, match in [
        ({"name": "focal"}, "unknown loss"),
        ({"name": "ce", "lambda": 0.1}, "takes no options"),
        ({"name": "spectral_decoupling", "lambda": -1.0}, ">= 0"),
        ({"name": "spectral_decoupling", "lambda": float("nan")}, "finite"),
        ({"name": "spectral_decoupling", "class_lambda": [0.1, 0.2, 0.3]}, "has 3 values but the data has 2 classes"),
        ({"name": "spectral_decoupling", "class_gamma": 0.5}, "lists, one value per class"),
        ({"name": "spectral_decoupling", "lamda": 0.1}, "unknown spectral decoupling options"),
    ]:
        with pytest.raises(ValueError, match=match):
            loss_from_options(options, 2)


def test_config_group_selects_and_records_the_loss() -> None:
    assert make_loss(compose_config([]), 10) is None  # default: loss=ce
    cfg = compose_config(
        [
            "loss=spectral_decoupling",
            "loss.lambda=0.5",
            "loss.class_lambda=[0.088,0.012]",
            "loss.class_gamma=[0.44,2.5]",
        ]
    )  # the thesis' CelebA values (App. 4.5)
    assert make_loss(cfg, 2) == SpectralDecoupling(0.5, (0.088, 0.012), (0.44, 2.5))
    with pytest.raises(ValueError, match="has 2 values but the data has 10 classes"):
        make_loss(cfg, 10)


# --- lambda = 0 is plain cross-entropy, bit for bit, in both engines -----------------------------


ZERO_LOSSES = [SpectralDecoupling(0.0), SpectralDecoupling(0.0, (0.0,) * 10, (0.5,) * 10)]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return create_model("mlp", 32, 2, 10, (1, 8, 8), base_width=8)


def _batches(steps: int, m: int | None = None) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(2)
    lead = () if m is None else (m,)
    return [
        (torch.rand(*lead, 16, 1, 8, 8, generator=gen), torch.randint(0, 10, (*lead, 16), generator=gen))
        for _ in range(steps)
    ]


def _stacked(loss: SpectralDecoupling | None, lr: float = 3e-2) -> StackedClassifier:
    opt = lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=2)  # noqa: E731
    return StackedClassifier(StackedModel([_mlp(s) for s in range(3)]), opt, lr, loss=loss)


def _weights(m: int = 3) -> Tensor:
    w = torch.ones(m, 16)
    w[1, 10:] = 0  # member 1's batch is short: its padding must not count
    return w


@pytest.mark.parametrize("zero", ZERO_LOSSES, ids=["plain", "per-class"])
def test_lambda_zero_trains_bit_identically_stacked(float64, zero: SpectralDecoupling) -> None:
    params = []
    for loss in (None, zero):
        module = _stacked(loss)
        opt = module.configure_optimizers()
        opt.train()
        for i, (x, y) in enumerate(_batches(6, 3)):
            module.step_loss(x, y, _weights()).backward()
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in module.stack.stacked])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_stacked_penalty_is_each_members_own_mean_over_its_real_examples(float64) -> None:
    """With lambda > 0 the stack trains each member as a stack of one on its real examples alone."""
    sd = SpectralDecoupling(0.5, (0.5, 1.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8), (1.0,) * 10)
    opt = lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=2)  # noqa: E731
    stack = _stacked(sd)
    singles = [StackedClassifier(StackedModel([_mlp(s)]), opt, 3e-2, loss=sd) for s in range(3)]
    opts = [stack.configure_optimizers(), *(s.configure_optimizers() for s in singles)]
    for o in opts:
        o.train()
    w = _weights()
    for i, (x, y) in enumerate(_batches(5, 3)):
        stack.step_loss(x, y, w).backward()
        for m, single in enumerate(singles):
            keep = w[m] > 0
            single.step_loss(x[m][keep][None], y[m][keep][None], w[m][keep][None]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    assert_members_equal_singles(stack, singles)


def test_training_steps_with_the_penalty_read_nothing_back_to_the_host() -> None:
    sd = SpectralDecoupling(0.1, (0.1,) * 10, (1.0,) * 10)
    stack = _stacked(sd)
    ((x, y),) = _batches(1, 3)
    with RecordOps() as record:
        for i in range(3):
            stack.step_loss(x, y, _weights())
    assert not host_reads(record), host_reads(record)


# --- the thesis' experiment: two moons made linearly separable along one axis -------------------


def thesis_two_moons(n: int, seed: int, margin: float = 0.1, noise: float = 0.1) -> tuple[Tensor, Tensor]:
    """Fig. 6.1 (b) (App. 4.2; the thesis' released code): two moons (sklearn's make_moons layout)
    whose horizontal coordinate is a shortcut separating the classes by `margin` on either side of
    0, while the vertical coordinate carries the curved moon structure (the slower feature)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, math.pi, n // 2)
    x = torch.cat([torch.stack([t.cos(), t.sin()], 1), torch.stack([1 - t.cos(), 0.5 - t.sin()], 1)])
    y = torch.arange(n) >= n // 2
    x = x + noise * torch.randn(n, 2, generator=gen)
    sign = 2.0 * y - 1
    x = x - torch.stack([torch.full((n,), 0.5), 0.3 * sign], 1)
    x[:, 1] -= x[:, 1].mean()
    x[:, 1] *= torch.sign(-x[:, 1] * sign)  # each class on its own side of 0 ...
    x[:, 1] -= sign * margin  # ... by at least `margin`
    return x.flip(1).contiguous(), y.long()


def input_margin(model: nn.Module, x: Tensor, res: int = 400, span: float = 2.5) -> float:
    """The classifier's margin in input space: the smallest distance from a training point to the
    decision boundary (thesis Sec. 6.4.1), the boundary located on a res x res grid (spacing 5/400)."""
    g = torch.linspace(-span, span, res)
    grid = torch.cartesian_prod(g, g)
    with torch.no_grad():
        pred = model(grid).argmax(1).view(res, res)
        own = model(x).argmax(1)
    edge = torch.zeros(res, res, dtype=torch.bool)
    edge[:-1] |= pred[:-1] != pred[1:]
    edge[:, :-1] |= pred[:, :-1] != pred[:, 1:]
    boundary = grid[edge.flatten()]
    if len(boundary) == 0 or (own != own[0]).sum() == 0:
        return 0.0
    return torch.cdist(x, boundary).min().item()


@pytest.mark.slow
def test_sd_reaches_a_larger_margin_than_erm_on_two_moons() -> None:
    """Thesis Fig. 6.1 (b) vs (c): cross-entropy separates along the shortcut with a margin about as
    small as the shortcut's gap; SD also learns the moons and curves the boundary away from the data.

    Setup of App. 4.2: a two-layer ReLU net, full-batch gradient descent, lr 1e-2, momentum 0.9, 300
    points; ours: 100 hidden units (thesis 500) and 2000 steps (thesis 10k) to run in seconds, and
    lambda = 0.012, the thesis' coefficient 0.003 * mean(y_hat^2) on one logit written for two
    softmax logits (z = (-y_hat/2, y_hat/2) gives lambda/2 ||z||^2 = lambda/4 y_hat^2).
    """
    torch.set_num_threads(1)
    sgd = lambda groups: torch.optim.SGD(groups, momentum=0.9)  # noqa: E731
    for seed in (0, 1):
        x, y = thesis_two_moons(300, seed)
        margins = {}
        for name, loss in (("erm", None), ("sd", SpectralDecoupling(0.012))):
            torch.manual_seed(seed)
            net = nn.Sequential(nn.Linear(2, 100), nn.ReLU(), nn.Linear(100, 2))
            module = StackedClassifier(StackedModel([net]), sgd, 1e-2, loss=loss)  # a stack of one: net's weights
            opt = module.configure_optimizers()
            weight = torch.ones(1, len(y))
            for step in range(2000):
                module.step_loss(x[None], y[None], weight).backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                assert (net(x).argmax(1) == y).all(), name  # both separate the training set
            margins[name] = input_margin(net, x)
        print(f"seed {seed}: input-space margin ERM {margins['erm']:.3f}, SD {margins['sd']:.3f} (shortcut gap +-0.1)")
        assert margins["sd"] > 1.5 * margins["erm"]


# --- whole runs: launch.py with both engines, MDL numbers from plain cross-entropy -------------

SD_RUN = ["loss=spectral_decoupling", "loss.lambda=0.3"]
SD_CONFIG = {
    "name": "spectral_decoupling",
    "lambda": 0.3,
    "class_lambda": None,
    "class_gamma": None,
}  # SD_RUN as stored


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_a_run_with_spectral_decoupling_records_it_and_finite_numbers(tmp_path: Path, engine: str) -> None:
    """A whole run with the loss in each grouping (in process, as launch.py runs it; a sweep through launch.py: the
    slow test below), and a sweep's job folders name its settings (loss.* is no bookkeeping key)."""
    results = run_in_process([FITS[engine], *FAST, *SD_RUN], tmp_path)
    assert results["fits"] == engine
    assert results["config"]["loss"] == SD_CONFIG
    assert all(math.isfinite(results[k]) for k in ("paper_mdl", "online_bits_per_example", "final_val_loss"))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra_cfg = compose("config", overrides=[*FAST, *SD_RUN], return_hydra_config=True)
    excluded = hydra_cfg.hydra.job.config.override_dirname.exclude_keys
    assert not [key for key in excluded if key.startswith("loss")]


@pytest.mark.slow  # a sweep through launch.py
def test_launch_sweeps_spectral_decoupling_on_digits_with_both_engines(tmp_path: Path) -> None:
    proc = run_launch(
        ["-m", "mdl.members_per_fit=1,all", *FAST, *SD_RUN, f"paths.output_root={tmp_path}"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = sorted(tmp_path.glob("multirun/*/*/*/results.json"))
    assert len(paths) == 2
    engines = set()
    for path in paths:
        results = json.loads(path.read_text())
        engines.add(results["fits"])
        assert "loss.lambda=0.3" in path.parent.name  # the sweep's job directories name the setting
        assert results["config"]["loss"] == SD_CONFIG
        assert all(math.isfinite(results[k]) for k in ("paper_mdl", "online_bits_per_example", "final_val_loss"))
    assert engines == {"sequential", "stacked"}


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_scored_numbers_are_plain_cross_entropy_of_the_scored_models(tmp_path: Path, monkeypatch, engine: str) -> None:
    """Capture each block's scored (best) weights; its recorded validation loss and code length
    are the plain cross-entropy of those weights, not the regularised objective (which differs)."""
    from mdl.engine.stacked_fit import StackedProtocol

    scored: dict[int, dict[str, Tensor]] = {}  # member (block index; the final fit last) -> scored weights
    original_finish = StackedProtocol._finish

    def remember(self, module, stopping):
        for m in stopping:
            scored[m] = {k: v.clone() for k, v in self.best[m].items()}
        original_finish(self, module, stopping)

    monkeypatch.setattr(StackedProtocol, "_finish", remember)
    settings = [
        *FAST,
        *SD_RUN,
        "loss.lambda=1.0",
        FITS[engine],
        "eraser=none",
        "trainer.kwargs.max_epochs=6",
        "trainer.patience=6",
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
    ]
    cfg = compose_config(settings, tmp_path)
    results = run_experiment(cfg, tmp_path / "run")
    from mdl.run.components import make_datamodule

    dm = make_datamodule(cfg)  # the run's own data module, set up
    model, sd = make_model_factory(cfg, dm.num_classes, dm.input_shape)(), make_loss(cfg, dm.num_classes)
    assert len(scored) == len(results["blocks"]) + 1
    for i, block in enumerate(results["blocks"]):
        model.load_state_dict(scored[i])
        with torch.no_grad():
            logits = [(model(x).double(), y) for x, y in dm.val_dataloader()]
            n_val = sum(len(y) for _, y in logits)
            ce = sum(F.cross_entropy(z, y, reduction="sum") for z, y in logits).item() / n_val
            objective = ce + sum(spectral_penalty(z, y, sd).sum() for z, y in logits).item() / n_val
            bits = sum(
                F.cross_entropy(model(x).double(), y, reduction="sum")
                for x, y in dm.eval_loader(block["n_train"], block["n_train"] + block["n_eval"])
            ).item() / math.log(2)
        print(f"{engine} block {i}: val CE {ce:.5f} nats, regularised {objective:.5f}, eval {bits:.2f} bits")
        assert block["val_bits_per_example"] * math.log(2) == pytest.approx(ce, rel=1e-5)
        assert objective - ce > 1e-4 * ce  # ten times the tolerance above: the regularised number would show
        assert block["eval_bits"] == pytest.approx(bits, rel=1e-6)
