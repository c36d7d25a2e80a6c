"""LEACE (Belrose et al. 2023): the least-squares edit that zeroes Cov(x, one_hot(y)).

x' = x - P (x - mu) with the oblique projection P = W^+ U U^T W, W = Sigma^{-1/2} (pseudo-inverse
on the kept spectrum) and U an orthonormal basis of the column space of W Sigma_xz (rank <= k-1).
Directions of zero variance (constant pixels) carry no class information and are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.linalg import psd_eigh, rank_tolerance, require_variance, smallest_kept, warn_once
from erasure.moments import ClassMoments, class_moments
from erasure.preprocess import OPTIMAL, Shrinkage, check_shrinkage, optimal_linear_shrinkage, shrink_moments


@dataclass(frozen=True)
class LeaceMap:
    """The affine map x -> x - (x - mean) @ proj.T, with proj the (d, d) oblique projection."""

    mean: Tensor
    proj: Tensor
    rank: int


def leace_map(moments: ClassMoments, shrink_total: bool = False) -> LeaceMap:
    """``shrink_total``: shrink the total covariance with ``optimal_linear_shrinkage`` (what
    concept-erasure's LeaceFitter does by default) before whitening."""
    sigma = moments.pooled_covariance()
    if shrink_total:
        sigma = optimal_linear_shrinkage(sigma, moments.counts.sum())
    eigvals, eigvecs, keep = psd_eigh(sigma)
    d = sigma.shape[0]
    require_variance(keep, "LEACE")
    if not bool(keep.all()):
        warn_once(
            "leace-singular",
            f"LEACE: covariance has rank {int(keep.sum())} of {d} (e.g. constant pixels); "
            f"smallest kept eigenvalue {smallest_kept(eigvals, keep):.3g}; null directions are left unchanged",
        )
    inv_sqrt = torch.where(keep, eigvals.clamp_min(1e-300).rsqrt(), 0.0)
    sqrt = eigvals.sqrt()
    whiten = (eigvecs * inv_sqrt) @ eigvecs.T
    unwhiten = (eigvecs * sqrt) @ eigvecs.T
    u, s, _ = torch.linalg.svd(whiten @ moments.cross_covariance(), full_matrices=False)
    # Whitened cross-covariances are O(1) (at most 1/2), so values near d * eps are rounding noise,
    # not directions: a purely relative cut would keep noise when the class means are already equal.
    floor = torch.tensor(d * torch.finfo(s.dtype).eps, dtype=s.dtype, device=s.device)
    u = u[:, s > torch.maximum(rank_tolerance(s), floor)]
    proj = unwhiten @ u @ u.T @ whiten
    return LeaceMap(mean=moments.mean, proj=proj, rank=u.shape[1])


@register_eraser("leace")
@dataclass(frozen=True)
class LeaceEraser(Eraser):
    mean: Tensor
    proj: Tensor
    dim: int
    num_classes: int
    rank: int
    class_counts: list[int]
    shrinkage: Shrinkage = 0.0

    @classmethod
    def fit(
        cls, x: Tensor, y: Tensor, num_classes: int, batch_size: int = 8192, shrinkage: Shrinkage = 0.0
    ) -> "LeaceEraser":
        """``shrinkage``: 0 (exact: class means equal after erasure), a in (0, 1] (each class covariance
        shrunk toward tr/d I), or "optimal" (the total covariance shrunk by the data-chosen
        coefficients, as concept-erasure's LeaceFitter(shrinkage=True); the map still zeroes the
        cross-covariance, so class means stay equal)."""
        check_shrinkage(shrinkage)
        moments = class_moments(x, y, num_classes, batch_size=batch_size)
        if shrinkage != OPTIMAL:
            moments = shrink_moments(moments, shrinkage)
        m = leace_map(moments, shrink_total=shrinkage == OPTIMAL)
        return cls(
            mean=m.mean,
            proj=m.proj,
            dim=x.shape[1],
            num_classes=num_classes,
            rank=m.rank,
            class_counts=[int(c) for c in moments.counts],
            shrinkage=shrinkage,
        )

    def targeted_gaps(self) -> tuple[str, ...]:
        return ("max_mean_gap",)

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        mean, proj = self.mean.to(x.device), self.proj.to(x.device)
        xd = x.to(torch.float64)
        return xd - (xd - mean) @ proj.T
