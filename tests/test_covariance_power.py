"""Covariance-power transform: known spectra, the identity at p = 0, QLEACE's equal moments kept,
the optimizer form on a linear model, and end-to-end runs with the transform before / after an eraser."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FAST, run_in_process
from erasure import class_moments, fit_covariance_power, fit_eraser, load_covariance_power
from test_erasers_qleace import gaussian_classes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def psd_power(matrix: torch.Tensor, power: float) -> torch.Tensor:
    """matrix ** power for a symmetric positive definite matrix (the tests' reference)."""
    eigvals, eigvecs = torch.linalg.eigh(matrix)
    return (eigvecs * eigvals**power) @ eigvecs.T


def preconditioned_gd(
    x: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, preconditioner: torch.Tensor, lr: float, steps: int
) -> list[torch.Tensor]:
    """Gradient descent on the linear least-squares loss 1/(2n) ||x W^T - targets||^2 with the weight gradient
    right-multiplied by ``preconditioner`` (the optimizer form of the transform, models/preconditioning.py: P =
    Sigma^p); the weights after every step (steps + 1 tensors, the first is ``weight``)."""
    trajectory = [weight]
    for _ in range(steps):
        grad = (x @ weight.T - targets).T @ x / x.shape[0]
        weight = weight - lr * grad @ preconditioner
        trajectory.append(weight)
    return trajectory


def correlated(n: int = 2000, d: int = 8, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64) * torch.logspace(0, -1.5, d, dtype=torch.float64)
    return torch.randn(n, d, generator=gen, dtype=torch.float64) @ mix.T + 0.5


def covariance(x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(0)
    return centred.T @ centred / x.shape[0]


@pytest.mark.parametrize("p", [-1.0, -0.5, 0.5, 1.0, 2.0])
def test_transformed_covariance_is_sigma_to_the_one_plus_p_at_the_same_trace(p: float) -> None:
    x = correlated()
    sigma = covariance(x)
    t = fit_covariance_power(x, p=p, eps=0.0)
    expected = psd_power(sigma, 1 + p)
    expected = expected * torch.trace(sigma) / torch.trace(expected)  # trace normalisation
    out = t(x)
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert rel(covariance(out), expected) < 1e-8
    assert abs(float(torch.trace(covariance(out)) / torch.trace(sigma)) - 1) < 1e-10
    assert rel(out.mean(0), x.mean(0)) < 1e-12  # the mean is kept


def test_whitening_gives_an_isotropic_covariance_and_the_summary_says_so() -> None:
    x = correlated()
    t = fit_covariance_power(x, p=-1.0, eps=0.0)
    d = x.shape[1]
    iso = torch.eye(d, dtype=torch.float64) * torch.trace(covariance(x)) / d
    assert rel(covariance(t(x)), iso) < 1e-8
    assert t.condition_before > 10 and abs(t.condition_after - 1) < 1e-8
    assert abs(t.effective_rank_after - d) < 1e-8 and t.rank == d


def test_eps_ridges_the_covariance_for_negative_powers() -> None:
    x = correlated()
    sigma = covariance(x)
    d, eps, p = x.shape[1], 1e-2, -0.5
    ridged = sigma + eps * torch.trace(sigma) / d * torch.eye(d, dtype=torch.float64)
    a = psd_power(ridged, p / 2)
    expected = a @ sigma @ a
    expected = expected * torch.trace(sigma) / torch.trace(expected)
    assert rel(covariance(fit_covariance_power(x, p=p, eps=eps)(x)), expected) < 1e-8


def test_p_zero_is_the_identity_bit_for_bit() -> None:
    for x in (correlated(), correlated().float()):
        t = fit_covariance_power(x, p=0.0, eps=1e-6)
        assert torch.equal(t(x), x)
        assert t.scale == 1.0


def test_singular_covariance_without_eps_warns_and_never_gives_nan() -> None:
    x = correlated(d=6)
    x = torch.cat([x, torch.full((x.shape[0], 2), 0.25, dtype=torch.float64)], 1)  # two constant "pixels"
    with pytest.warns(RuntimeWarning, match="rank 6 of 8"):
        t = fit_covariance_power(x, p=-1.0, eps=0.0)
    out = t(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, 6:], x[:, 6:])  # null directions stay at the mean
    assert t.rank == 6


def test_saves_and_loads_bit_identically(tmp_path: Path) -> None:
    x = correlated().float()
    t = fit_covariance_power(x, p=-0.5, eps=1e-6)
    loaded = load_covariance_power(t.save(tmp_path / "t.safetensors"))
    assert torch.equal(loaded(x), t(x)) and loaded.summary() == t.summary()


def test_bad_settings_are_named() -> None:
    x = correlated()
    with pytest.raises(ValueError, match="p="):
        fit_covariance_power(x, p="half", eps=0.0)
    with pytest.raises(ValueError, match="eps="):
        fit_covariance_power(x, p=-1.0, eps=-1.0)


@pytest.mark.parametrize("p", [-1.0, -0.5, 1.0])
def test_equal_class_moments_after_qleace_stay_equal_after_the_transform(p: float) -> None:
    x, y = gaussian_classes()
    erased = fit_eraser("qleace", x, y)(x, y)
    moments = class_moments(erased, y, 3)
    scale = float(moments.covariances()[0].norm())
    assert float((moments.means - moments.means[0]).norm()) < 1e-8 * scale  # QLEACE's known answer
    out = fit_covariance_power(erased, p=p, eps=1e-6)(erased)
    after = class_moments(out, y, 3)
    covs = after.covariances()
    assert float((after.means - after.means[0]).norm()) < 1e-8 * float(covs[0].norm())
    for c in (1, 2):
        assert rel(covs[c], covs[0]) < 1e-8


@pytest.mark.parametrize("p", [-1.0, -0.5, 1.0])
def test_transform_and_optimizer_forms_give_the_same_trajectory_on_a_linear_model(p: float) -> None:
    """GD on z = x A (A = Sigma^{p/2}) with weights V is GD on x with the gradient times Sigma^p,
    through W = V A: 50 steps agree to float64 rounding."""
    gen = torch.Generator().manual_seed(1)
    x = correlated(n=500, d=6) - 0.5
    targets = torch.randn(500, 3, generator=gen, dtype=torch.float64)
    sigma = covariance(x)
    a = psd_power(sigma, p / 2)
    v0 = torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.1
    lr = 0.2 / float(torch.linalg.eigvalsh(a @ sigma @ a).max())  # stable for both forms
    on_transformed = preconditioned_gd(x @ a, targets, v0, torch.eye(6, dtype=torch.float64), lr, 50)
    preconditioned = preconditioned_gd(x, targets, v0 @ a, a @ a, lr, 50)
    assert len(on_transformed) == len(preconditioned) == 51
    for v, w in zip(on_transformed, preconditioned):
        assert rel(v @ a, w) < 1e-10
    assert rel(on_transformed[-1], on_transformed[0]) > 0.1  # it did move


@pytest.mark.parametrize("order,eraser", [("before_eraser", "qleace"), ("after_eraser", "leace")])
def test_a_run_applies_the_transform_on_digits(tmp_path: Path, order: str, eraser: str) -> None:
    """A whole run with data.transform given on the command line's syntax (in process, as launch.py runs it)."""
    transform = f"data.transform={{name:covariance_power,p:-0.5,eps:1.0e-6,order:{order}}}"
    results = run_in_process([f"eraser={eraser}", transform, *FAST], tmp_path)
    assert results["config"]["data"]["transform"]["order"] == order
    summary = results["data_diagnostics"]["transform"]
    assert summary["p"] == -0.5 and summary["order"] == order and summary["dim"] == 64
    assert summary["condition_after"] < summary["condition_before"]
    assert results["paper_mdl"] > 0


def test_a_transform_with_augment_then_erase_is_refused() -> None:
    from datamodules.options import DataOptions

    transform = {"name": "covariance_power", "p": -1.0, "eps": 1e-6, "order": "before_eraser"}
    with pytest.raises(ValueError, match="augment_order=erase_then_augment"):
        DataOptions.from_config(
            dict(source="digits", transform=transform, augment_order="augment_then_erase", device="cpu"),
            {"name": "none"},
        )
    with pytest.raises(ValueError, match="missing keys"):
        DataOptions.from_config(
            dict(source="digits", transform={"name": "covariance_power", "p": -1.0}, device="cpu"), {"name": "none"}
        )


def test_cache_keys_include_the_transform_and_its_order() -> None:
    from datamodules.options import DataOptions

    def keys(transform):
        options = DataOptions.from_config(
            dict(source="digits", transform=transform, device="cpu"), {"name": "leace", "options": {}}
        )
        return options.eraser_key(), options.data_key()

    plain = keys(None)
    before = keys({"name": "covariance_power", "p": -1.0, "eps": 1e-6, "order": "before_eraser"})
    after = keys({"name": "covariance_power", "p": -1.0, "eps": 1e-6, "order": "after_eraser"})
    other_p = keys({"name": "covariance_power", "p": -0.5, "eps": 1e-6, "order": "after_eraser"})
    assert before[0] != plain[0]  # the eraser is fitted on transformed data
    assert after[0] == plain[0]  # the eraser is fitted on the raw data: shared with plain runs
    assert len({plain[1], before[1], after[1], other_p[1]}) == 4
