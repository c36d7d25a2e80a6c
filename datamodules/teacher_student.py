"""Teacher-student sources with known answers: which input directions a learner can pick up, and when.

Two teachers, each usable from Python (float64, with the regression targets) and as a registered
binary-classification source for the prequential pipeline (float32 vectors shaped (n, 1, 1, d),
class = sign of the noisy teacher output):

``single_index`` (the preconditioning abstract, Yoshida & Nitanda 2025): x ~ N(0, Q diag(lambda) Q^T),
    y = g(<w*, x>), teacher weights in the eigenbasis w*_i ~ +-lambda_i^(alpha/2), ||w*|| = 1. The
    alignment alpha says how much the teacher lives in the high-variance directions, which is what a
    covariance-power preconditioner Sigma^p favours or suppresses.
``multiscale_linear`` (thesis ch. 4, Sec. 4.2.1): z ~ N(0, I/d), y = z^T w + noise, the student sees
    x = F^T z with F = U S V^T, S = (1 x p, 1/kappa x (d - p)): p fast and d - p slow features.
    ``MultiScaleLinear.gd_test_error`` is the exact full-batch gradient-descent trajectory
    (thesis Eqs. 4.2.17-4.2.19 and App. .2.2), so a run can be set against the closed form.

Each source draws its teacher and each split from its own stream of ``generator_seed``
(``data_seed`` only splits the training set, as for every source), so changing n_train keeps the
teacher and the test set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from datamodules.sources import ImageSet, ImageSource, register_source, stream_generator
from erasure.linalg import random_orthonormal

# g(<w*, x>): sign (binary classification, as +-1), tanh or linear (regression targets)
LINKS = {
    "sign": lambda out: torch.where(out > 0, 1.0, -1.0).to(out.dtype),
    "tanh": torch.tanh,
    "linear": lambda out: out,
}
F64 = torch.float64


def _check_int(source: str, **values: Any) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "n_test" else 1):
            raise ValueError(f"{source}: data.options.{key} must be a positive integer, got {value!r}")


def _check_real(source: str, low: float = -math.inf, **values: Any) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
            raise ValueError(f"{source}: data.options.{key} must be a finite number >= {low}, got {value!r}")


def _as_source(name: str, splits: Sequence[tuple[Tensor, Tensor]]) -> ImageSource:
    """Vectors (n, d) and 0/1 labels -> an ImageSource of (n, 1, 1, d) float32 "images"."""
    sets = [ImageSet(x.to(torch.float32).reshape(len(x), 1, 1, x.shape[-1]), y) for x, y in splits]  # n_test=0: no rows
    test = sets[1] if len(sets) > 1 and len(sets[1]) > 0 else None
    return ImageSource(name=name, train=sets[0], test=test, classes=["negative", "positive"])


def _labels(output: Tensor) -> Tensor:
    """Class ids of a binary teacher: 1 where the (noisy) teacher output is positive."""
    return (output > 0).to(torch.int64)


# --- single-index teacher (preconditioning abstract) ------------------------------------------


def power_law(d: int, decay: float) -> Tensor:
    """lambda_i = i^(-decay), i = 1..d (lambda_1 = 1): the usual power-law input spectrum."""
    return torch.arange(1, d + 1, dtype=F64).pow(-float(decay))


@dataclass(frozen=True)
class SingleIndexTeacher:
    eigenvalues: Tensor  # (d,) float64, descending as given: the input covariance spectrum
    basis: Tensor  # (d, d) float64 orthogonal, column i the eigenvector of eigenvalues[i]
    weights: Tensor  # (d,) float64 teacher w*, unit norm

    @property
    def covariance(self) -> Tensor:
        return (self.basis * self.eigenvalues) @ self.basis.T

    @property
    def alignment(self) -> Tensor:
        """|<w*, q_i>| per eigenvector: proportional to lambda_i^(alpha/2) by construction."""
        return (self.basis.T @ self.weights).abs()

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """n inputs x = Q diag(sqrt(lambda)) g, g ~ N(0, I), float64 (n, d)."""
        g = torch.randn(n, len(self.eigenvalues), dtype=F64, generator=generator)
        return (g * self.eigenvalues.sqrt()) @ self.basis.T

    def output(self, x: Tensor, noise: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        """<w*, x> plus Gaussian noise of ``noise`` times the teacher output's std (so noise is an inverse SNR)."""
        clean = x @ self.weights
        if noise == 0:
            return clean
        scale = noise * float(self.weights @ self.covariance @ self.weights) ** 0.5
        return clean + scale * torch.randn(len(x), dtype=F64, generator=generator)

    def draw(self, n: int, link_name: str, noise: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(x, g(<w*, x> + noise)): the regression variant with link tanh or linear, +-1 targets with sign."""
        x = self.sample(n, generator)
        return x, link(self.output(x, noise, generator), link_name)


def single_index_teacher(
    d: int,
    decay: float = 1.0,
    eigenvalues: Sequence[float] | None = None,
    alignment: float = 0.0,
    rotate: bool = True,
    seed: int = 0,
) -> SingleIndexTeacher:
    """The teacher: spectrum (``eigenvalues``, or the power law with ``decay``), a random eigenbasis
    (identity if not ``rotate``), w* with coordinates +-lambda_i^(alignment/2) in it, random signs."""
    lam = power_law(d, decay) if eigenvalues is None else torch.as_tensor(list(eigenvalues), dtype=F64)
    if lam.shape != (d,) or not bool((lam > 0).all()) or not bool(torch.isfinite(lam).all()):
        raise ValueError(
            f"single_index: data.options.eigenvalues must be {d} positive finite numbers (d = {d}), got {lam.tolist()}"
        )
    g = stream_generator("single_index", seed, "teacher")
    basis = random_orthonormal(d, d, g) if rotate else torch.eye(d, dtype=F64)
    signs = torch.randint(0, 2, (d,), generator=g).to(F64) * 2 - 1
    coefficients = signs * lam.pow(alignment / 2)
    weights = basis @ (coefficients / coefficients.norm())
    return SingleIndexTeacher(eigenvalues=lam, basis=basis, weights=weights)


def link(output: Tensor, name: str) -> Tensor:
    """g(<w*, x>), the link ``LINKS[name]``."""
    if name not in LINKS:
        raise ValueError(f"single_index: unknown link {name!r}; choose one of {tuple(LINKS)}")
    return LINKS[name](output)


@register_source("single_index", size=lambda d=64, n_train=4000, n_test=2000, **_: (n_train + n_test, (1, 1, d)))
def load_single_index(
    d: int = 64,
    n_train: int = 4000,
    n_test: int = 2000,
    decay: float = 1.0,
    eigenvalues: Sequence[float] | None = None,
    alignment: float = 0.0,
    rotate: bool = True,
    noise: float = 0.0,
    generator_seed: int = 0,
    **_: Any,
) -> ImageSource:
    """Binary single-index data: class = 1[<w*, x> + noise > 0] (the sign link); the test split is
    labelled by the noiseless teacher, as in the thesis' generalisation error (Eq. 4.2.5)."""
    _check_int("single_index", d=d, n_train=n_train, n_test=n_test)
    _check_real("single_index", decay=decay, alignment=alignment)
    _check_real("single_index", low=0.0, noise=noise)
    teacher = single_index_teacher(d, decay, eigenvalues, alignment, rotate, generator_seed)
    splits = []
    for part, n, sigma in (("train", n_train, noise), ("test", n_test, 0.0)):
        x, y = teacher.draw(n, "sign", sigma, stream_generator("single_index", generator_seed, part))
        splits.append((x, _labels(y)))
    return _as_source("single_index", splits)


# --- multi-scale linear teacher (thesis ch. 4) -------------------------------------------------


@dataclass(frozen=True)
class MultiScaleLinear:
    """One draw of the thesis' teacher-student problem (Sec. 4.2.1), float64.

    Gradient descent is on L(w) = 1/2 ||y - X w||^2 + ridge/2 ||w||^2 from w_0 = 0 (thesis App. .2.2,
    Eq. .2.11), and the test error is the population MSE against the noiseless teacher,
    E_z[(z^T w - x^T w_hat)^2] = ||w - F w_hat||^2 / d (the thesis plots half of it, L_G of Eq. 4.2.6).
    """

    x: Tensor  # (n, d) student inputs X = Z F
    y: Tensor  # (n,) noisy teacher outputs z^T w + noise
    x_test: Tensor  # (n_test, d)
    y_test: Tensor  # (n_test,) noiseless teacher outputs
    teacher: Tensor  # (d,) w, i.i.d. N(0, 1)
    modulation: Tensor  # (d, d) F

    def gradient(self, w: Tensor, ridge: float = 0.0) -> Tensor:
        return self.x.T @ (self.x @ w - self.y) + ridge * w

    def default_lr(self, ridge: float = 0.0) -> float:
        """1 / (lambda_max(X^T X) + ridge): the step size of the thesis' reference code (fig3.py)."""
        return 1.0 / (float(torch.linalg.eigvalsh(self.x.T @ self.x)[-1]) + ridge)

    def gd_weights(self, steps: int | Sequence[int] | Tensor, lr: float | None = None, ridge: float = 0.0) -> Tensor:
        """w_t for each t in ``steps`` (rows; an int T means 0..T), exactly: in the eigenbasis (lambda_i, v_i)
        of X^T X each coordinate reaches (1 - (1 - lr ridge - lr lambda_i)^t) of the ridge solution
        (thesis Eq. .2.17), so no step is iterated and t = 10^7 costs what t = 1 does."""
        steps = torch.arange(steps + 1) if isinstance(steps, int) else steps
        t = torch.as_tensor(steps, dtype=F64).reshape(-1, 1)
        if bool((t < 0).any()) or bool((t != t.round()).any()):
            raise ValueError("gd_weights: steps must be non-negative integers")
        lr = self.default_lr(ridge) if lr is None else lr
        lam, v = torch.linalg.eigh(self.x.T @ self.x)
        floor = lam[-1].clamp_min(0) * len(lam) * torch.finfo(F64).eps  # below: null space of X (no gradient there)
        target = torch.where(lam + ridge > floor, (v.T @ (self.x.T @ self.y)) / (lam + ridge).clamp_min(floor), 0.0)
        reached = 1 - (1 - lr * ridge - lr * lam).pow(t)
        return (reached * target) @ v.T

    def test_error(self, w_hat: Tensor) -> Tensor:
        """Population MSE ||w - F w_hat||^2 / d of one (d,) or many (k, d) students."""
        residual = self.teacher - w_hat @ self.modulation.T
        return residual.pow(2).sum(-1) / len(self.teacher)

    def gd_test_error(self, steps: int | Sequence[int] | Tensor, lr: float | None = None, ridge: float = 0.0) -> Tensor:
        """The closed-form gradient-descent test-error curve at ``steps`` (float64, one value per step)."""
        return self.test_error(self.gd_weights(steps, lr, ridge))


def modulation_matrix(d: int, p: int, kappa: float, generator: torch.Generator) -> Tensor:
    """F = U S V^T with p singular values 1 and d - p equal to 1/kappa (thesis Assumption 4.2.1)."""
    s = torch.ones(d, dtype=F64)
    s[p:] = 1.0 / kappa
    u, v = random_orthonormal(d, d, generator), random_orthonormal(d, d, generator)
    return (u * s) @ v.T


def _check_multiscale(n: int, d: int, p: int, kappa: float, noise: float, n_test: int) -> None:
    _check_int("multiscale_linear", n=n, d=d, n_test=n_test)
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= d:
        raise ValueError(f"multiscale_linear: data.options.p (fast features) must be an integer in 0..d={d}, got {p!r}")
    _check_real("multiscale_linear", low=1.0, kappa=kappa)
    _check_real("multiscale_linear", low=0.0, noise=noise)


def multiscale_linear(
    n: int = 150, d: int = 100, p: int = 50, kappa: float = 50.0, noise: float = 0.0, n_test: int = 1000, seed: int = 0
) -> MultiScaleLinear:
    """Draw the regression problem; defaults are the thesis' Fig. 3 setting (Sec. 4.3.1: d = 100,
    p = 50, n = 150; kappa = 50 is its double-descent curve; noiseless labels)."""
    _check_multiscale(n, d, p, kappa, noise, n_test)
    g = stream_generator("multiscale_linear", seed, "teacher")
    teacher = torch.randn(d, dtype=F64, generator=g)
    modulation = modulation_matrix(d, p, kappa, g)
    data = []
    for part, size, sigma in (("train", n, noise), ("test", n_test, 0.0)):
        gs = stream_generator("multiscale_linear", seed, part)
        z = torch.randn(size, d, dtype=F64, generator=gs) / math.sqrt(d)
        y = z @ teacher + sigma * torch.randn(size, dtype=F64, generator=gs)
        data.append((z @ modulation, y))
    (x, y), (x_test, y_test) = data
    return MultiScaleLinear(x=x, y=y, x_test=x_test, y_test=y_test, teacher=teacher, modulation=modulation)


@register_source("multiscale_linear", size=lambda d=100, n_train=4000, n_test=2000, **_: (n_train + n_test, (1, 1, d)))
def load_multiscale_linear(
    n_train: int = 4000,
    n_test: int = 2000,
    d: int = 100,
    p: int = 50,
    kappa: float = 50.0,
    noise: float = 0.0,
    generator_seed: int = 0,
    **_: Any,
) -> ImageSource:
    """The classification variant: class = 1[z^T w + noise > 0] (test split: the noiseless teacher,
    thesis Eq. 4.2.5), inputs sqrt(d) x so the fast features have unit variance (the thesis'
    z ~ N(0, I/d) would give inputs of std 0.1 at d = 100)."""
    problem = multiscale_linear(n_train, d, p, kappa, noise, n_test, generator_seed)
    scale = math.sqrt(d)
    splits = [(scale * problem.x, _labels(problem.y)), (scale * problem.x_test, _labels(problem.y_test))]
    return _as_source("multiscale_linear", splits)
