"""The teacher-student sources' known answers (datamodules/teacher_student.py), in float64.

Multi-scale linear (thesis ch. 4): the closed-form gradient-descent trajectory equals iterated GD;
in the thesis' Fig. 3 setting (n = 150, d = 100, p = 50, noiseless) kappa = 1 gives a monotone
test-error curve and kappa = 50 an epoch-wise double descent (one interior maximum).
Single index (preconditioning abstract): the inputs have the requested spectrum, the teacher the
requested alignment, and the labels follow that teacher. Both: deterministic per seed; both run
through launch.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import FAST, run_in_process
from datamodules import available_sources, load_source
from datamodules.teacher_student import link, multiscale_linear, single_index_teacher

F64 = torch.float64
SEEDS = range(4)
LOG_STEPS = torch.unique(torch.logspace(0, 7, 300, dtype=F64).round())  # 1 .. 1e7 steps, log-spaced


def iterated_gd(problem, steps: int, lr: float, ridge: float = 0.0) -> torch.Tensor:
    """Plain full-batch GD from zero, (steps + 1, d): the reference the closed form must match."""
    w = torch.zeros(problem.x.shape[1], dtype=F64)
    out = [w]
    for _ in range(steps):
        w = w - lr * problem.gradient(w, ridge)
        out.append(w)
    return torch.stack(out)


def prominent_maxima(curve: torch.Tensor, fraction: float = 0.01) -> list[int]:
    """Interior local maxima that rise above the lower of their two flanking minima by more than
    ``fraction`` of the initial error (ignores rounding wiggles once the curve has converged)."""
    peaks = []
    for i in range(1, len(curve) - 1):
        if curve[i] >= curve[i - 1] and curve[i] > curve[i + 1]:
            prominence = curve[i] - torch.maximum(curve[:i].min(), curve[i + 1 :].min())
            if prominence > fraction * curve[0]:
                peaks.append(i)
    return peaks


# --- multi-scale linear: closed form --------------------------------------------------------


@pytest.mark.parametrize(
    "n, ridge, noise", [(150, 0.0, 0.5), (60, 0.0, 0.5), (150, 2.0, 0.5)], ids=["n>d", "n<d (null space)", "ridge"]
)
def test_closed_form_matches_iterated_gradient_descent(n: int, ridge: float, noise: float) -> None:
    problem = multiscale_linear(n=n, d=100, p=50, kappa=50.0, noise=noise, seed=1)
    lr = problem.default_lr(ridge)
    reference = iterated_gd(problem, 200, lr, ridge)
    closed = problem.gd_weights(range(201), lr, ridge)
    weight_error = ((closed - reference).norm(dim=1)[1:] / reference.norm(dim=1)[1:]).max()
    assert weight_error < 1e-8, float(weight_error)
    errors, reference_errors = problem.gd_test_error(200, lr, ridge), problem.test_error(reference)
    assert ((errors - reference_errors).abs() / reference_errors).max() < 1e-8
    assert torch.equal(closed[0], torch.zeros(100, dtype=F64))


def test_population_test_error_matches_a_large_test_set() -> None:
    """||w - F w_hat||^2 / d is the expected squared error on noiseless teacher data."""
    problem = multiscale_linear(n=150, d=100, p=50, kappa=50.0, noise=0.5, n_test=20000, seed=0)
    w_hat = problem.gd_weights([30])[0]
    empirical = (problem.x_test @ w_hat - problem.y_test).pow(2).mean()
    assert float(empirical) == pytest.approx(float(problem.test_error(w_hat)), rel=0.05)


def test_modulation_has_the_requested_singular_values() -> None:
    problem = multiscale_linear(n=20, d=30, p=10, kappa=7.0, seed=2)
    s = torch.linalg.svdvals(problem.modulation)
    expected = torch.cat([torch.ones(10, dtype=F64), torch.full((20,), 1 / 7.0, dtype=F64)])
    torch.testing.assert_close(s, expected, rtol=1e-12, atol=0)


# --- multi-scale linear: the thesis' curves (Sec. 4.3.1, Fig. 3) -----------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_kappa_one_gives_a_monotone_test_error(seed: int) -> None:
    curve = multiscale_linear(kappa=1.0, seed=seed).gd_test_error(LOG_STEPS)
    assert bool((curve.diff() <= 1e-12 * curve[0]).all()), curve.diff().max()
    assert curve[-1] < 1e-6 * curve[0]  # n > d, noiseless: GD reaches the teacher


@pytest.mark.parametrize("seed", SEEDS)
def test_large_kappa_gives_an_epochwise_double_descent(seed: int) -> None:
    """kappa = 50: fast features learned, overfitted (the bump), then the slow ones (second descent)."""
    curve = multiscale_linear(kappa=50.0, seed=seed).gd_test_error(LOG_STEPS)
    peaks = prominent_maxima(curve)
    assert len(peaks) == 1, [(float(LOG_STEPS[i]), float(curve[i])) for i in peaks]
    peak = peaks[0]
    first_min = int(curve[:peak].argmin())
    assert 0 < first_min < peak < len(curve) - 1
    assert curve[-1] < 0.01 * curve[peak]  # the second descent goes all the way down


def test_huge_kappa_overfits_without_a_second_descent() -> None:
    """kappa = 1e5 (thesis Fig. 3): slow features never learned in 1e7 steps, classical U-shape."""
    curve = multiscale_linear(kappa=1e5, seed=0).gd_test_error(LOG_STEPS)
    peak = int(curve.argmax())
    assert curve[-1] > curve[:peak].min()  # ends above its first minimum: no second descent
    assert len(prominent_maxima(curve[: peak + 1])) == 0


# --- single index: spectrum, alignment, labels ----------------------------------------------


@pytest.mark.parametrize("alignment", [-1.0, 0.0, 2.0])
def test_single_index_teacher_has_the_requested_alignment(alignment: float) -> None:
    teacher = single_index_teacher(d=12, decay=1.5, alignment=alignment, seed=3)
    assert float(teacher.weights.norm()) == pytest.approx(1.0, abs=1e-14)
    ratio = teacher.alignment / teacher.eigenvalues.pow(alignment / 2)
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio[0])), rtol=1e-12, atol=0)
    torch.testing.assert_close(teacher.basis.T @ teacher.basis, torch.eye(12, dtype=F64), rtol=0, atol=1e-13)


def test_single_index_covariance_matches_the_spectrum() -> None:
    """Population: eigh of the covariance gives the spectrum back; sample: a 200k-point covariance
    within sampling error (relative standard error of an eigenvalue about sqrt(2 / n) = 0.3%)."""
    teacher = single_index_teacher(d=8, decay=1.5, seed=0)
    torch.testing.assert_close(
        torch.linalg.eigvalsh(teacher.covariance).flip(0), torch.arange(1, 9, dtype=F64).pow(-1.5), rtol=1e-12, atol=0
    )
    x = teacher.sample(200_000, torch.Generator().manual_seed(0))
    empirical = torch.linalg.eigvalsh(torch.cov(x.T)).flip(0)
    assert ((empirical - teacher.eigenvalues).abs() / teacher.eigenvalues).max() < 0.02
    residual = torch.linalg.norm(torch.cov(x.T) - teacher.covariance) / torch.linalg.norm(teacher.covariance)
    assert residual < 0.02


def test_single_index_source_uses_the_requested_spectrum_and_teacher() -> None:
    """Through load_source (float32): explicit eigenvalues come back from the training inputs, and
    by Stein's lemma E[x * (+-1 label)] is parallel to Sigma w* for the sign link."""
    eigenvalues = [4.0, 2.0, 1.0, 0.5, 0.25, 0.125]
    options = dict(d=6, n_train=100_000, n_test=10, eigenvalues=eigenvalues, alignment=1.0, generator_seed=5)
    src = load_source("single_index", **options)
    x = src.train.x.reshape(len(src.train), -1).double()
    empirical = torch.linalg.eigvalsh(torch.cov(x.T)).flip(0)
    expected = torch.tensor(eigenvalues, dtype=F64)
    assert ((empirical - expected).abs() / expected).max() < 0.03
    teacher = single_index_teacher(d=6, eigenvalues=eigenvalues, alignment=1.0, seed=5)
    direction = (x * (2.0 * src.train.y.double() - 1).unsqueeze(1)).mean(0)
    target = teacher.covariance @ teacher.weights
    assert float(torch.nn.functional.cosine_similarity(direction, target, dim=0)) > 0.999


def test_links_and_regression_targets() -> None:
    out = torch.tensor([-2.0, 0.5], dtype=F64)
    assert link(out, "sign").tolist() == [-1.0, 1.0]
    torch.testing.assert_close(link(out, "tanh"), torch.tanh(out))
    assert torch.equal(link(out, "linear"), out)
    with pytest.raises(ValueError, match="unknown link"):
        link(out, "relu")
    teacher = single_index_teacher(d=5, seed=0)
    x, y = teacher.draw(50, "tanh", 0.0, torch.Generator().manual_seed(1))
    torch.testing.assert_close(y, torch.tanh(x @ teacher.weights), rtol=0, atol=0)
    x2, y2 = teacher.draw(50, "tanh", 0.0, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and torch.equal(y, y2)


# --- both sources: registration, determinism, bad options ------------------------------------

SMALL = {
    "single_index": dict(d=10, n_train=300, n_test=100, noise=0.3),
    "multiscale_linear": dict(d=20, p=5, n_train=300, n_test=100, noise=0.3),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_labels_are_deterministic_per_seed(name: str) -> None:
    assert name in available_sources()
    a, b = load_source(name, **SMALL[name], generator_seed=0), load_source(name, **SMALL[name], generator_seed=0)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.y, b.train.y) and torch.equal(a.test.y, b.test.y)
    other = load_source(name, **SMALL[name], generator_seed=1)
    assert not torch.equal(a.train.y, other.train.y)
    bigger = load_source(name, **{**SMALL[name], "n_train": 500}, generator_seed=0)
    assert torch.equal(a.test.x, bigger.test.x) and torch.equal(a.test.y, bigger.test.y)  # same teacher, same test set
    assert a.train.x.shape == (300, 1, 1, SMALL[name]["d"]) and a.train.x.dtype == torch.float32
    assert set(a.train.y.tolist()) == {0, 1}


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("multiscale_linear", dict(d=10, p=11), "data.options.p"),
        ("multiscale_linear", dict(kappa=0.5), "data.options.kappa"),
        ("multiscale_linear", dict(noise=math.nan), "data.options.noise"),
        ("single_index", dict(d=4, eigenvalues=[1.0, 0.5]), "data.options.eigenvalues"),
        ("single_index", dict(d=3, eigenvalues=[1.0, 0.0, 2.0]), "data.options.eigenvalues"),
        ("single_index", dict(n_train=0), "data.options.n_train"),
    ],
)
def test_bad_options_name_the_setting(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_source(name, **options)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_whole_run_on_the_source(name: str, tmp_path: Path) -> None:
    """A whole run on the synthetic source (in process, as launch.py runs it)."""
    tiny = ["data.options.n_train=500", "data.options.n_test=200", "data.val_size=100", "data.diagnostics=false"]
    results = run_in_process([f"data={name}", "device=cpu", *FAST, *tiny], tmp_path)
    assert results["config"]["data"]["source"] == name
    assert math.isfinite(results["paper_mdl"])
