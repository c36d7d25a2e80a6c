"""Symmetric matrix functions in float64 with a spectrum-relative rank tolerance."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor


def rank_tolerance(eigvals: Tensor) -> Tensor:
    """Eigenvalues at or below lambda_max * d * eps are treated as exactly zero."""
    d = eigvals.shape[-1]
    top = eigvals.abs().amax(-1, keepdim=True)
    return top * d * torch.finfo(eigvals.dtype).eps


def psd_eigh(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eigendecomposition of a symmetric PSD matrix; returns (eigvals clipped at 0, eigvecs, mask of kept)."""
    matrix = (matrix + matrix.transpose(-1, -2)) / 2
    if matrix.ndim == 3 and matrix.device.type == "cpu":
        # Batched eigh on the CPU is ~2x slower than a loop over the batch (measured, torch 2.14).
        pairs = [torch.linalg.eigh(m) for m in matrix]
        eigvals, eigvecs = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    else:
        eigvals, eigvecs = torch.linalg.eigh(matrix)
    keep = eigvals > rank_tolerance(eigvals)
    return eigvals.clamp_min(0) * keep, eigvecs, keep


def per_class(product: Callable[..., Tensor], *stacks: Tensor) -> Tensor:
    """``product`` of each class's matrices (the leading axis of ``stacks``), stacked: the bits of the batched
    product (tests/test_erasers.py), but one class at a time, so a run can stop between classes (at CIFAR-10's
    3072 dimensions one batched product of 10 classes is minutes of one uninterruptible call on a busy CPU, and
    Slurm waits 30 s between SIGTERM and SIGKILL)."""
    return torch.stack([product(*parts) for parts in zip(*stacks)])


class NoVarianceError(ValueError):
    """The data have zero variance in every direction: nothing to erase, nothing to learn."""


def require_variance(keep: Tensor, who: str) -> None:
    """Refuse data whose covariance is numerically zero: every example is the same point, so
    any eraser would be the identity and any classifier would see one input."""
    if not bool(keep.any()):
        raise NoVarianceError(
            f"{who}: the data have zero variance in every direction (every example is the same up to "
            f"float rounding), so there is no class information to erase and nothing to learn; check "
            f"the data and their scale (e.g. a tiny synthetic std, or images that are all one value)"
        )


def smallest_kept(eigvals: Tensor, keep: Tensor) -> float:
    """The smallest eigenvalue above the rank tolerance (nan when none is), for messages."""
    return float(eigvals[keep].min()) if bool(keep.any()) else float("nan")


_warned: set[tuple[str, str]] = set()


def warn_once(key: str, message: str) -> None:
    """Warn about a numerical condition once per process and message (singular covariances are
    common): repeats of the same numbers are silent, a different data set still gets its warning."""
    if (key, message) not in _warned:
        _warned.add((key, message))
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def random_orthonormal(dim: int, rank: int, generator: torch.Generator) -> Tensor:
    """A (dim, rank) orthonormal basis of a uniformly random (Haar) subspace drawn from ``generator``, float64: the QR
    of a Gaussian matrix with the signs of R's diagonal fixed."""
    gaussian = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(1, dtype=torch.float64))
