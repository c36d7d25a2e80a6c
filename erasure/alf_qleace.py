"""ALF-QLEACE (paper section 2.3): LEACE, then rank-1 orthogonal projections, one map for all classes.

Recipe, with C_z the covariance of class z of the LEACE'd data (B S_z B^T, B = I - P_leace,
normalised by the class count) and C_bar their unweighted average (the paper's "average of all
class-conditional covariance matrices"), D_z = C_z - C_bar:

    repeat: pick the class z* with the largest spectral norm ||P D_z P||_2 and its dominant
            eigenvector v (largest |eigenvalue|; a singular vector of the symmetric D_z*),
            add v to the orthonormal directions U, P <- I - U U^T.

The data is then projected about its mean: x -> m + (I - U U^T)(leace(x) - m). Compressing by P
never increases a spectral norm, so the maximum class deviation is non-increasing in the rank;
class means stay equal (LEACE makes them all m, the projection is about m).

Stopping rule (defaults as in the original code, EleutherAI/concept-erasure): stop when the
maximum deviation max_z ||P D_z P|| (``deviation_norm``: "fro" (default, as the original code) or
"spectral", the paper's eq. 11) is at most ``target_fraction`` (0.1, i.e. 90% erased) times its
initial value, or when ``max_rank`` directions have been removed (None, the default: no cap, up to d), or when
no deviation is left.
Directions with zero variance (constant pixels) are never chosen (D_z is zero there). The
deviation after each rank is recorded in ``deviations``. Label-free at transform time.

The dominant eigenpair of each D_z is found by Lanczos with full reorthogonalisation (a few dozen
matrix-vector products instead of a d^3 eigendecomposition per class per rank), checked by its
residual, with a dense eigh fallback when it does not converge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.leace import leace_map
from erasure.linalg import per_class
from erasure.moments import class_moments, dtype_named
from erasure.preprocess import Shrinkage, check_shrinkage, shrink_moments
from erasure.qleace import compute_device


def dominant_eigpair(
    matrix: Tensor, tol: float = 1e-12, max_steps: int = 300, check_every: int = 8, seed: int = 0
) -> tuple[float, Tensor]:
    """(lambda, v) with |lambda| = ||matrix||_2 for a symmetric matrix; Lanczos + dense fallback."""
    d = matrix.shape[0]
    steps = min(d, max_steps)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(d, generator=gen, dtype=torch.float64).to(matrix)
    q = q / q.norm()
    basis = torch.zeros(d, steps, dtype=matrix.dtype, device=matrix.device)
    alphas: list[float] = []
    betas: list[float] = []
    scale = 0.0
    for j in range(steps):
        basis[:, j] = q
        w = matrix @ q
        alphas.append(float(q @ w))
        active = basis[:, : j + 1]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            w = w - active @ (active.T @ w)
        beta = float(w.norm())
        scale = max(scale, abs(alphas[-1]), beta)
        breakdown = beta <= d * torch.finfo(matrix.dtype).eps * max(scale, 1e-300)
        if breakdown or (j + 1) % check_every == 0 or j + 1 == steps:
            tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
            if j > 0:
                off = torch.tensor(betas, dtype=torch.float64)
                tri += torch.diag(off, 1) + torch.diag(off, -1)
            evals, evecs = torch.linalg.eigh(tri)
            i = int(evals.abs().argmax())
            theta = float(evals[i])
            residual = beta * abs(float(evecs[-1, i]))
            if breakdown or residual <= tol * max(abs(theta), 1e-300) or theta == 0.0:
                vec = active @ evecs[:, i].to(matrix)
                return theta, vec / vec.norm().clamp_min(1e-300)
        betas.append(beta)
        q = w / beta
    evals, evecs = torch.linalg.eigh((matrix + matrix.T) / 2)
    i = int(evals.abs().argmax())
    return float(evals[i]), evecs[:, i]


@dataclass(frozen=True)
class AlfDirections:
    directions: Tensor  # (d, r) orthonormal
    deviations: list[float]  # max_z ||P D_z P|| before each added direction and after the last


def _deviation(delta: Tensor, norm: str, spectral: float) -> float:
    return spectral if norm == "spectral" else float(torch.linalg.matrix_norm(delta))


def alf_directions(
    covariances: Tensor, target_fraction: float, max_rank: int, norm: str = "fro", tol: float = 1e-10
) -> AlfDirections:
    """Greedy rank-1 projections that shrink the largest class-covariance deviation (paper eq. 11)."""
    k, d, _ = covariances.shape
    deltas = covariances - covariances.mean(0)  # unweighted mean: class sizes do not matter
    scale = float(torch.diagonal(covariances.mean(0)).sum())  # >= the spectral norm
    eps = torch.finfo(covariances.dtype).eps
    negligible = d * eps * max(scale, 1e-300)
    tol = max(tol, 64 * eps)  # a float32 fit's Lanczos cannot reach 1e-10 (float64's default is unchanged)
    directions: list[Tensor] = []
    deviations: list[float] = []
    while True:
        pairs = [dominant_eigpair(deltas[z], tol=tol) for z in range(k)]
        spectral = [abs(p[0]) for p in pairs]
        worst = max(range(k), key=lambda z: spectral[z])
        deviations.append(max(_deviation(deltas[z], norm, spectral[z]) for z in range(k)))
        if (
            len(directions) >= max_rank
            or deviations[-1] <= target_fraction * deviations[0]
            or spectral[worst] <= negligible
        ):
            break
        v = pairs[worst][1]
        if directions:
            used = torch.stack(directions, 1)
            for _ in range(2):
                v = v - used @ (used.T @ v)
        v = v / v.norm()
        directions.append(v)
        for z in range(k):  # deltas[z] <- (I - v v^T) deltas[z] (I - v v^T), in O(d^2)
            w = deltas[z] @ v
            deltas[z] -= torch.outer(v, w) + torch.outer(w, v) - float(v @ w) * torch.outer(v, v)
    empty = torch.zeros(d, 0, dtype=covariances.dtype, device=covariances.device)
    return AlfDirections(torch.stack(directions, 1) if directions else empty, deviations)


@register_eraser("alf_qleace")
@dataclass(frozen=True)
class AlfQLeaceEraser(Eraser):
    """x -> m + (I - U U^T)(leace(x) - m): one affine map for every class."""

    erases_quadratic = True

    mean: Tensor  # (d,)
    leace_proj: Tensor  # (d, d) oblique LEACE projection
    directions: Tensor  # (d, r) orthonormal
    dim: int
    num_classes: int
    class_counts: list[int]
    leace_rank: int
    rank: int
    edit_rank: int
    deviations: list[float]
    deviation_norm: str
    target_fraction: float
    max_rank: int | None
    shrinkage: Shrinkage

    @classmethod
    def fit(
        cls,
        x: Tensor,
        y: Tensor,
        num_classes: int,
        target_fraction: float = 0.1,
        max_rank: int | None = None,
        deviation_norm: str = "fro",
        shrinkage: Shrinkage = 0.0,
        device: str = "auto",
        batch_size: int = 8192,
        fit_dtype: str = "float64",
    ) -> "AlfQLeaceEraser":
        """Fit LEACE, then the rank-1 directions on the LEACE'd class covariances, on x (n, d) and labels y (n,).
        Options are checked before any moment is computed, so a wrong one fails at once; ``device`` is only where
        the float64 work runs (the eraser's tensors come back on the CPU). ``fit_dtype`` float32: moments, LEACE
        and directions in float32, applied in float32, as the original's concept-erasure AlfQLeaceFitter built with
        dtype=torch.float32 (experiments/cli.py@0cc7065:321, :330, :346, :386)."""
        if not 0.0 <= target_fraction < 1.0:
            raise ValueError(f"target_fraction must lie in [0, 1), got {target_fraction}")
        if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 0):
            raise ValueError(
                f"max_rank must be an integer >= 0, or null for no cap (up to d directions), got {max_rank!r}"
            )
        rank_cap = x.shape[1] if max_rank is None else max_rank  # null: up to d rank-1 erasures (paper Sec. 2.3)
        if deviation_norm not in ("fro", "spectral"):
            raise ValueError(f"deviation_norm must be 'fro' or 'spectral', got {deviation_norm!r}")
        check_shrinkage(shrinkage)
        dtype = dtype_named(fit_dtype)
        dev = compute_device(device)
        moments = shrink_moments(class_moments(x.to(dev), y.to(dev), num_classes, batch_size, dtype), shrinkage)
        leace = leace_map(moments)
        keep = torch.eye(x.shape[1], dtype=dtype, device=dev) - leace.proj
        present = moments.counts > 0
        covs = per_class(lambda c: keep @ c @ keep.T, moments.covariances()[present])
        found = alf_directions(covs, target_fraction, min(rank_cap, x.shape[1]), deviation_norm)
        cpu = torch.device("cpu")
        rank = found.directions.shape[1]
        return cls(
            mean=leace.mean.to(cpu),
            leace_proj=leace.proj.to(cpu),
            directions=found.directions.to(cpu),
            dim=x.shape[1],
            num_classes=num_classes,
            class_counts=[int(c) for c in moments.counts],
            leace_rank=leace.rank,
            rank=rank,
            edit_rank=leace.rank + rank,
            deviations=found.deviations,
            deviation_norm=deviation_norm,
            target_fraction=target_fraction,
            max_rank=max_rank,
            shrinkage=shrinkage,
        )

    def targeted_gaps(self) -> tuple[str, ...]:
        # Only the exact LEACE part: its covariance edit stops at max_rank directions by design, and
        # its deviation (unweighted mean, ``deviation_norm``) is not the diagnostics' max_cov_gap.
        return ("max_mean_gap",)

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        mean, proj, dirs = (t.to(x.device) for t in (self.mean, self.leace_proj, self.directions))
        centred = x.to(mean.dtype) - mean  # in the fit's dtype (float64 unless fitted in float32)
        centred = centred - centred @ proj.T
        return mean + centred - (centred @ dirs) @ dirs.T
