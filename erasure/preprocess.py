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


def check_shrinkage(shrinkage: float) -> None:
    if not 0.0 <= float(shrinkage) <= 1.0:
        raise ValueError(f"shrinkage must lie in [0, 1] (0 = off, exact erasure), got {shrinkage}")


def shrink_covariances(covariances: Tensor, shrinkage: float) -> Tensor:
    """(1 - a) S + a (tr S / d) I for each matrix of a (..., d, d) batch."""
    check_shrinkage(shrinkage)
    if shrinkage == 0:
        return covariances
    d = covariances.shape[-1]
    trace = torch.diagonal(covariances, dim1=-2, dim2=-1).sum(-1)
    eye = torch.eye(d, dtype=covariances.dtype, device=covariances.device)
    return (1 - shrinkage) * covariances + (shrinkage * trace / d)[..., None, None] * eye


def shrink_moments(moments: ClassMoments, shrinkage: float) -> ClassMoments:
    """The same moments with every class scatter shrunk (scatter = count * covariance)."""
    if shrinkage == 0 or moments.scatters is None:
        check_shrinkage(shrinkage)
        return moments
    return ClassMoments(
        counts=moments.counts, means=moments.means, scatters=shrink_covariances(moments.scatters, shrinkage)
    )
