"""Covariance-power preconditioning (the preconditioning abstract): x -> mu + c Sigma_eps^{p/2} (x - mu).

Sigma is the covariance of the fitting (training) data, accumulated in float64; Sigma_eps = Sigma for
p >= 0 and Sigma + eps * (tr Sigma / d) I for p < 0 (eps is relative to the mean eigenvalue, so it
means the same on pixels in [0, 1] and on any other scale). p = -1 whitens, p = 0 is the identity
(returned bit for bit), p > 0 sharpens the spectrum. The scalar c is chosen so that the total
variance is kept: tr Cov(x') = tr Sigma ("trace-normalised"). The transformed covariance is
c^2 Sigma_eps^{p/2} Sigma Sigma_eps^{p/2}, i.e. c^2 Sigma^{1+p} when eps = 0.

The mean is added back after the map (the abstract's x -> Sigma^{p/2}(x - mu) up to that shift), so
the data stay where they were, p = 0 is exactly the identity, and an eraser fitted afterwards sees the
same mean; a constant shift changes nothing a model with biases can learn.

Singular covariances (constant pixels) with eps = 0 and p < 0: the power is a pseudo-inverse power
on the kept spectrum (eigenvalues above lambda_max * d * eps_machine), so null directions, which carry
no variance, are mapped to the mean; a warning gives the rank. Pure torch, like the erasers: fit on
(n, ...) tensors, call on tensors of the same shape, save / load without pickle.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from erasure.base import TensorRecord, check_features, load_safetensors, save_safetensors
from erasure.linalg import psd_eigh, require_variance, smallest_kept, warn_once
from erasure.moments import class_moments

FORMAT_VERSION = 1
NAME = "covariance_power"


def participation_ratio(eigvals: Tensor) -> float:
    """(sum lambda)^2 / sum lambda^2: the effective number of directions a spectrum spreads over."""
    total = float(eigvals.sum())
    squares = float((eigvals**2).sum())
    return total * total / squares if squares > 0 else 0.0


@dataclass(frozen=True)
class CovariancePower(TensorRecord):
    """The fitted affine map x -> mean + (x - mean) @ matrix (matrix symmetric, float64)."""

    mean: Tensor  # (d,)
    matrix: Tensor  # (d, d) = scale * Sigma_eps^{p/2}
    p: float
    eps: float
    dim: int
    scale: float  # c, the trace normalisation
    rank: int  # of Sigma, on the kept spectrum
    eigval_max: float
    eigval_min_kept: float
    condition_before: float  # lambda_max / lambda_min over the kept spectrum of Sigma
    condition_after: float  # the same for the transformed covariance
    effective_rank_before: float  # participation ratio of Sigma's spectrum
    effective_rank_after: float

    @property
    def is_identity(self) -> bool:
        return self.p == 0

    @classmethod
    def fit(cls, x: Tensor, p: float, eps: float, batch_size: int = 8192) -> "CovariancePower":
        """Fit on x (n, ...) (flattened inside): float64 mean and covariance, eigendecomposition."""
        check_transform_options(p, eps)
        check_features(x)
        flat = x.reshape(x.shape[0], -1)
        zeros = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        moments = class_moments(flat, zeros, 1, batch_size=batch_size)
        sigma = moments.pooled_covariance()
        eigvals, eigvecs, keep = psd_eigh(sigma)
        require_variance(keep, "covariance_power")
        d = sigma.shape[0]
        rank = int(keep.sum())
        kept = eigvals[keep]
        if p < 0 and eps > 0:
            powered = (eigvals + eps * float(eigvals.sum()) / d) ** (p / 2)
        else:
            if p < 0 and rank < d:
                warn_once(
                    "covariance-power-singular",
                    f"covariance_power: covariance has rank {rank} of {d} (e.g. constant pixels), smallest kept "
                    f"eigenvalue {smallest_kept(eigvals, keep):.3g}, and eps = 0: p = {p:g} uses the pseudo-inverse "
                    f"power; null directions (no variance) map to the mean. Set eps > 0 to regularise instead",
                )
            powered = torch.where(keep, eigvals.clamp_min(torch.finfo(eigvals.dtype).tiny) ** (p / 2), 0.0)
        after = powered**2 * eigvals  # the transformed spectrum before the trace normalisation
        scale = (float(eigvals.sum()) / float(after.sum())) ** 0.5 if p != 0 else 1.0
        matrix = (eigvecs * (scale * powered)) @ eigvecs.T
        matrix = (matrix + matrix.T) / 2
        if not (math.isfinite(scale) and scale > 0 and bool(torch.isfinite(matrix).all())):
            raise ValueError(
                f"covariance_power: p={p:g}, eps={eps:g} overflows float64 on this covariance (eigenvalues from "
                f"{float(kept.min()):.3g} to {float(kept.max()):.3g}, powered to p/2); choose p closer to 0 "
                f"(p = -1 whitens) or a larger eps"
            )
        after_kept = (scale**2 * after)[keep]
        return cls(
            mean=moments.mean,
            matrix=matrix,
            p=float(p),
            eps=float(eps),
            dim=d,
            scale=scale,
            rank=rank,
            eigval_max=float(kept.max()),
            eigval_min_kept=float(kept.min()),
            condition_before=float(kept.max() / kept.min()),
            condition_after=float(after_kept.max() / after_kept.min()),
            effective_rank_before=participation_ratio(kept),
            effective_rank_after=participation_ratio(after_kept),
        )

    def __call__(self, x: Tensor) -> Tensor:
        """The transformed x (same shape and dtype); p = 0 returns x itself."""
        if self.is_identity:
            return x
        check_features(x)
        flat = x.reshape(x.shape[0], -1)
        if flat.shape[1] != self.dim:
            raise ValueError(
                f"the covariance_power transform was fitted on {self.dim} features, got {flat.shape[1]} "
                f"(input shape {tuple(x.shape)})"
            )
        mean, matrix = self.mean.to(flat.device), self.matrix.to(flat.device)
        xd = flat.to(torch.float64)
        out = mean + (xd - mean) @ matrix  # matrix is symmetric
        return out.to(x.dtype).reshape(x.shape)

    summary = (
        TensorRecord.metadata
    )  # the plain numbers (no tensors): setting and spectrum before / after, for results.json

    # --- persistence (the erasers' format: one safetensors file, JSON header, no pickle) -----

    def save(self, path: str | os.PathLike) -> Path:
        header = {"transform": NAME, "format_version": FORMAT_VERSION, "metadata": self.summary()}
        tensors = {"mean": self.mean.detach().cpu().contiguous(), "matrix": self.matrix.detach().cpu().contiguous()}
        return save_safetensors(path, tensors, {"header": json.dumps(header)})


def load_covariance_power(path: str | os.PathLike) -> CovariancePower:
    """Inverse of ``CovariancePower.save`` (bit-identical outputs)."""
    header, tensors = load_safetensors(path, "covariance_power transform")
    if header.get("transform") != NAME:
        raise ValueError(f"{path} is not a saved covariance_power transform")
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {header.get('format_version')}, this code reads {FORMAT_VERSION}; refit it"
        )
    return CovariancePower(**tensors, **header["metadata"])


def check_transform_options(p: Any, eps: Any) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not torch.isfinite(torch.tensor(float(p))):
        raise ValueError(f"covariance_power: p={p!r} must be a finite number (p = -1 whitens, 0 is the identity)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(
            f"covariance_power: eps={eps!r} must be a number >= 0 (ridge for p < 0, times the mean eigenvalue)"
        )


def fit_covariance_power(x: Tensor, p: float, eps: float, batch_size: int = 8192) -> CovariancePower:
    """Fit x -> mean + c Sigma_eps^{p/2} (x - mean) on x (n, ...); see the module docstring."""
    return CovariancePower.fit(x, p, eps, batch_size=batch_size)
