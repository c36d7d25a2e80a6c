"""Class-conditional moments accumulated in float64, one pass, in batches.

Kept apart from the erasers so every eraser (and the diagnostics) reads the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ClassMoments:
    """Per-class counts, means and (optionally) covariances of flattened data, float64."""

    counts: Tensor  # (k,)
    means: Tensor  # (k, d)
    scatters: Tensor | None  # (k, d, d) centred sums of outer products, or None

    @property
    def num_classes(self) -> int:
        return self.counts.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    @property
    def weights(self) -> Tensor:
        """Class frequencies, the weights of the global mean and of the barycenter."""
        return self.counts / self.counts.sum()

    @property
    def mean(self) -> Tensor:
        return self.weights @ self.means

    def covariances(self) -> Tensor:
        """Per-class covariances (k, d, d), normalised by the class count (maximum likelihood)."""
        if self.scatters is None:
            raise ValueError("second moments were not accumulated; pass second_order=True")
        return self.scatters / self.counts.clamp_min(1)[:, None, None]

    def pooled_covariance(self) -> Tensor:
        """Total covariance of the data: within-class scatter plus between-class scatter."""
        if self.scatters is None:
            raise ValueError("second moments were not accumulated; pass second_order=True")
        n = self.counts.sum()
        centred = self.means - self.mean
        between = (centred.T * self.counts) @ centred
        return (self.scatters.sum(0) + between) / n

    def cross_covariance(self) -> Tensor:
        """Cov(x, one_hot(y)), shape (d, k): what LEACE must zero."""
        return (self.means - self.mean).T * self.weights


def class_moments(
    x: Tensor, y: Tensor, num_classes: int, second_order: bool = True, batch_size: int = 8192
) -> ClassMoments:
    """Accumulate counts, sums and centred scatter matrices per class in float64.

    Scatter matrices are accumulated around a per-class shift (the first batch's class mean), so
    large offsets (e.g. pixel values near 1) do not cost precision.
    """
    x = x.reshape(x.shape[0], -1)
    n, d = x.shape
    device = x.device
    counts = torch.zeros(num_classes, dtype=torch.float64, device=device)
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=device)
    shift = torch.zeros(num_classes, d, dtype=torch.float64, device=device)
    shifted_sums = torch.zeros(num_classes, d, dtype=torch.float64, device=device)
    scatters = torch.zeros(num_classes, d, d, dtype=torch.float64, device=device) if second_order else None
    have_shift = torch.zeros(num_classes, dtype=torch.bool, device=device)
    for start in range(0, n, batch_size):
        xb = x[start : start + batch_size].to(torch.float64)
        yb = y[start : start + batch_size].to(device)
        for c in torch.unique(yb).tolist():
            xc = xb[yb == c]
            if not have_shift[c]:
                shift[c] = xc.mean(0)
                have_shift[c] = True
            counts[c] += xc.shape[0]
            sums[c] += xc.sum(0)
            if scatters is not None:
                xs = xc - shift[c]
                shifted_sums[c] += xs.sum(0)
                scatters[c] += xs.T @ xs
    means = sums / counts.clamp_min(1)[:, None]
    if scatters is not None:
        # sum (x - s)(x - s)^T = scatter_about_mean + n (mu - s)(mu - s)^T
        delta = shifted_sums / counts.clamp_min(1)[:, None]
        scatters -= counts[:, None, None] * delta[:, :, None] * delta[:, None, :]
        scatters = (scatters + scatters.transpose(1, 2)) / 2
    return ClassMoments(counts=counts, means=means, scatters=scatters)


def mean_and_scatter(x: Tensor, chunk_size: int = 8192) -> tuple[Tensor, Tensor]:
    """The mean of x's rows and their centred scatter matrix, sum_i (x_i - mean)(x_i - mean)^T, in float64,
    a chunk of rows at a time so that no float64 copy of all of x is made."""
    n = x.shape[0]
    mean = x.sum(0, dtype=torch.float64) / n
    scatter = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    for chunk in x.split(chunk_size):
        centred = chunk.double() - mean
        scatter += centred.T @ centred
    return mean, scatter
