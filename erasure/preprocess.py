"""Options shared by every eraser: z-score normalisation and covariance shrinkage.

z-score (``fit_eraser(name, x, y, zscore=True)``, handled once in ``erasure.base``): features are
standardised with the training mean and standard deviation before the eraser is fitted, the
statistics are stored in the eraser (``input_shift``, ``input_scale``) and applied to every input.
The erased data stays in z-score units: the network sees normalised, erased data (the paper's
z-score experiment). Constant features get scale 1, so they stay constant (at 0) and never divide
by zero.

Shrinkage (``shrinkage=alpha`` for the erasers that estimate covariances: leace, qleace,
alf_qleace): every class covariance S is replaced by (1 - alpha) S + alpha (tr S / d) I before the
eraser is built (the Ledoit-Wolf scaled-identity target). Off by default: exact erasure of the
sample moments is the point; shrinkage trades exactness for full-rank, better-conditioned maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from erasure.moments import ClassMoments


@dataclass(frozen=True)
class Standardizer:
    """Per-feature affine map x -> (x - shift) / scale, float64."""

    shift: Tensor
    scale: Tensor

    @classmethod
    def fit(cls, x: Tensor, batch_size: int = 8192) -> "Standardizer":
        """Mean and (maximum-likelihood) standard deviation per feature, accumulated in float64."""
        flat = x.reshape(x.shape[0], -1)
        n = flat.shape[0]
        shift = flat[: min(n, batch_size)].to(torch.float64).mean(0)
        total = torch.zeros_like(shift)
        total_sq = torch.zeros_like(shift)
        for start in range(0, n, batch_size):
            xb = flat[start : start + batch_size].to(torch.float64) - shift
            total += xb.sum(0)
            total_sq += (xb * xb).sum(0)
        mean_offset = total / n
        var = (total_sq / n - mean_offset**2).clamp_min(0)
        std = var.sqrt()
        tol = std.amax() * flat.shape[1] * torch.finfo(torch.float64).eps
        scale = torch.where(std > tol, std, torch.ones_like(std))
        return cls(shift=(shift + mean_offset).cpu(), scale=scale.cpu())

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(x.shape[0], -1).to(torch.float64)
        out = (flat - self.shift.to(x.device)) / self.scale.to(x.device)
        return out.to(x.dtype).reshape(x.shape)


OPTIMAL = "optimal"  # shrinkage="optimal": concept-erasure's estimator (its default in LeaceFitter and QuadraticFitter)
Shrinkage = float | str


def check_shrinkage(shrinkage: Shrinkage) -> None:
    if shrinkage == OPTIMAL:
        return
    if isinstance(shrinkage, bool) or not isinstance(shrinkage, (int, float)) or not 0.0 <= float(shrinkage) <= 1.0:
        raise ValueError(
            f"shrinkage must lie in [0, 1] (0 = off, exact erasure of the sample moments) or be 'optimal' "
            f"(the data-chosen shrinkage concept-erasure applies by default), got {shrinkage!r}"
        )


def optimal_linear_shrinkage(covariance: Tensor, n: Tensor | int) -> Tensor:
    """alpha S + beta (tr S / d) I with the coefficients that are asymptotically optimal in Frobenius
    norm as d and n grow together (Bodnar, Gupta and Parolya 2014, "On the strong convergence of the optimal linear
    shrinkage estimator for large dimensional covariance matrix", arXiv:1308.2608). ``covariance`` is the
    biased sample covariance (scatter / n) of n samples, or a (..., d, d) batch with n per matrix. The
    same estimator as concept-erasure's ``optimal_linear_shrinkage`` (tested against it); float64 here."""
    d = covariance.shape[-1]
    n = torch.as_tensor(n, dtype=covariance.dtype, device=covariance.device).reshape(*covariance.shape[:-2], 1, 1)
    trace = torch.diagonal(covariance, dim1=-2, dim2=-1).sum(-1)[..., None, None]
    target = torch.eye(d, dtype=covariance.dtype, device=covariance.device) * trace / d  # tr S / d I
    target_sq = (trace / d) ** 2 * d  # ||target||_F^2
    cov_sq = covariance.square().sum((-2, -1), keepdim=True)
    cross = trace * trace / d  # tr(S target)
    eps = torch.finfo(covariance.dtype).eps  # the zero matrix: alpha 0, beta 1, a no-op
    alpha = 1 - (trace * trace * target_sq / n + eps) / (cov_sq * target_sq - cross * cross + eps)
    beta = (1 - alpha) * (cross + eps) / (target_sq + eps)
    return alpha * covariance + beta * target


def shrink_covariances(covariances: Tensor, shrinkage: float) -> Tensor:
    """(1 - a) S + a (tr S / d) I for each matrix of a (..., d, d) batch (shrinkage="optimal": ``shrink_moments``)."""
    check_shrinkage(shrinkage)
    if shrinkage == 0:
        return covariances
    d = covariances.shape[-1]
    trace = torch.diagonal(covariances, dim1=-2, dim2=-1).sum(-1)
    eye = torch.eye(d, dtype=covariances.dtype, device=covariances.device)
    return (1 - shrinkage) * covariances + (shrinkage * trace / d)[..., None, None] * eye


def shrink_moments(moments: ClassMoments, shrinkage: Shrinkage) -> ClassMoments:
    """The same moments with every class covariance shrunk (scatter = count * covariance)."""
    check_shrinkage(shrinkage)
    if shrinkage == 0:
        return moments
    if shrinkage == OPTIMAL:  # on each class covariance scatter / n, as concept-erasure's QuadraticFitter
        counts = moments.counts.to(moments.scatters.dtype)[:, None, None]
        shrunk = optimal_linear_shrinkage(moments.scatters / counts, moments.counts) * counts
        return ClassMoments(counts=moments.counts, means=moments.means, scatters=shrunk)
    return ClassMoments(
        counts=moments.counts, means=moments.means, scatters=shrink_covariances(moments.scatters, shrinkage)
    )
