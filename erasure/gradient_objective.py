"""The gradient eraser's objectives (erasure.gradient): the three-term moment loss (``MomentLoss``) and
the fixed-target loss of the original code's leace_first recipe (``TargetLoss``), each with its analytic
gradient over row chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ORIGINAL_UNITS = 255.0  # leace_first's loss units: the value range spans 0..255 (paper section 2.4: "[0, 255]")


@dataclass(frozen=True)
class MomentLoss:
    """Loss and analytic gradient of the three-term objective over row chunks of (n, d) data."""

    original: Tensor  # (n, d)
    class_rows: list[Tensor]  # row indices of each class present
    lo: float
    span: float
    mean_weight: float
    cov_weight: float
    distance_weight: float
    chunk_size: int

    def _chunks(self, rows: Tensor):
        for start in range(0, rows.shape[0], self.chunk_size):
            yield rows[start : start + self.chunk_size]

    def data(self, z: Tensor) -> Tensor:
        return self.lo + self.span * torch.sigmoid(z)

    def __call__(self, z: Tensor, need_grad: bool = True) -> tuple[float, Tensor | None, dict[str, float]]:
        n, d = z.shape
        counts = torch.tensor([float(r.shape[0]) for r in self.class_rows], dtype=torch.float64, device=z.device)
        weights = counts / n
        sums, distance = [], 0.0
        for rows in self.class_rows:
            total = torch.zeros(d, dtype=torch.float64, device=z.device)
            for idx in self._chunks(rows):
                xp = self.data(z[idx])
                total += xp.sum(0, dtype=torch.float64)
                distance += float(((xp - self.original[idx]).double() ** 2).sum())
            sums.append(total)
        means = torch.stack(sums) / counts[:, None]
        mean = weights @ means
        covs = torch.zeros(len(self.class_rows), d, d, dtype=torch.float64, device=z.device)
        for c, rows in enumerate(self.class_rows):
            shift = means[c].to(z.dtype)
            for idx in self._chunks(rows):
                xc = self.data(z[idx]) - shift
                covs[c] += (xc.T @ xc).double()
        covs /= counts[:, None, None]
        gaps = means - mean
        total_cov = (weights[:, None, None] * covs).sum(0) + (gaps.T * weights) @ gaps
        cov_diffs = covs - total_cov
        mean_term = float(weights @ (gaps**2).sum(1))
        cov_term = float(weights @ (cov_diffs**2).sum((1, 2)))
        loss = self.mean_weight * mean_term + self.cov_weight * cov_term + self.distance_weight * distance / n
        terms = {"mean_term": mean_term, "cov_term": cov_term, "distance_term": distance / n}
        if not need_grad:
            return loss, None, terms
        # dL/dC_z = 2 b w_z (C_z - C); dL/dC = -sum_z dL/dC_z. For x'_i in class z:
        # g_i = x'_i H_z + offset_z + (2 lambda / n)(x'_i - x_i), H_z = (2/n_z) G_z + (2/n) G.
        grad_class = 2 * self.cov_weight * weights[:, None, None] * cov_diffs
        grad_total = -grad_class.sum(0)
        grad = torch.empty_like(z)
        for c, rows in enumerate(self.class_rows):
            h = 2 / counts[c] * grad_class[c] + 2 / n * grad_total
            offset = 2 / n * self.mean_weight * gaps[c] - 2 / counts[c] * (grad_class[c] @ means[c])
            offset = offset - 2 / n * (grad_total @ mean)
            h, offset = h.to(z.dtype), offset.to(z.dtype)
            for idx in self._chunks(rows):
                sig = torch.sigmoid(z[idx])
                xp = self.lo + self.span * sig
                g = xp @ h + offset + (2 * self.distance_weight / n) * (xp - self.original[idx])
                grad[idx] = g * (self.span * sig * (1 - sig))
        return loss, grad, terms


@dataclass(frozen=True)
class TargetLoss:
    """One class's loss toward fixed global targets (recipe ``leace_first``), with analytic gradient:

        mean_weight * ||m - mu||^2 + cov_weight * ||C - S||_F^2 + distance_weight * mean_ij (x'_ij - s_ij)^2

    m, C the mean and covariance of the class's r edited rows x', (mu, S) the targets, s the
    starting rows; the distance is a per-pixel MSE. All in units where the value range spans
    ``ORIGINAL_UNITS`` (the original worked on 0..255 pixels, paper section 2.4), so the original's
    weights keep their meaning on data scaled to [0, 1]. With fixed targets the classes do not
    interact, so each is optimised alone.
    """

    start: Tensor  # (r, d) starting rows of the class
    target_mean: Tensor  # (d,) float64
    target_cov: Tensor  # (d, d) float64
    lo: float
    span: float
    mean_weight: float
    cov_weight: float
    distance_weight: float

    def data(self, z: Tensor) -> Tensor:
        return self.lo + self.span * torch.sigmoid(z)

    def __call__(self, z: Tensor, need_grad: bool = True) -> tuple[float, Tensor | None, dict[str, float]]:
        r, d = z.shape
        u = ORIGINAL_UNITS / self.span  # data units -> original units
        xp = self.data(z)
        mean = xp.mean(0, dtype=torch.float64)
        centred = xp - mean.to(z.dtype)
        cov_diff = (centred.T @ centred).double() / r - self.target_cov
        mean_diff = mean - self.target_mean
        step = xp - self.start
        terms = {
            "mean_term": u**2 * float(mean_diff @ mean_diff),
            "cov_term": u**4 * float((cov_diff**2).sum()),
            "distance_term": u**2 * float((step.double() ** 2).sum()) / (r * d),
        }
        loss = sum(getattr(self, key.replace("_term", "_weight")) * value for key, value in terms.items())
        if not need_grad:
            return loss, None, terms
        # d/dx'_i in data units: u^4 (4b/r) D (x'_i - m) + u^2 (2a/r) (m - mu) + u^2 (2c/rd) (x'_i - s_i)
        grad = (4 * u**4 * self.cov_weight / r) * (centred @ cov_diff.to(z.dtype))
        grad += ((2 * u**2 * self.mean_weight / r) * mean_diff).to(z.dtype)
        grad += (2 * u**2 * self.distance_weight / (r * d)) * step
        sig = torch.sigmoid(z)
        return loss, grad * (self.span * sig * (1 - sig)), terms


@dataclass(frozen=True)
class OriginalClassLoss:
    """One class's loss in the recipe ``original`` (the original code's, EleutherAI/mdl
    experiments/iterative_erasure.py@2a41748), with its gradient by autograd:

        mean_weight * ||m - mu||_2 + cov_weight * ||C - S||_F + distance_weight * mean_ij (x'_ij - t_ij)^2

    with unsquared norms (original: iterative_erasure.py@2a41748:98-102), x' = sigmoid(z) in [0, 1]
    (:97), m the mean and C the unbiased (n - 1) covariance of the class's rows (:98-99, ``x.T.cov()``),
    t the starting rows (:90, :100). Units: the data's own, [0, 1] (pixels / 255, :122).
    """

    start: Tensor  # (r, d) the class's starting rows t, in [0, 1]
    target_mean: Tensor  # (d,) mu
    target_cov: Tensor  # (d, d) S
    mean_weight: float
    cov_weight: float
    distance_weight: float

    def terms(self, z: Tensor) -> dict[str, Tensor]:
        x = torch.sigmoid(z)
        return {
            "mean_term": torch.linalg.vector_norm(x.mean(0) - self.target_mean),
            "cov_term": torch.linalg.matrix_norm(torch.cov(x.T) - self.target_cov),
            "distance_term": ((x - self.start) ** 2).mean(),
        }

    def loss(self, z: Tensor) -> Tensor:
        t = self.terms(z)
        return (
            self.mean_weight * t["mean_term"]
            + self.cov_weight * t["cov_term"]
            + self.distance_weight * t["distance_term"]
        )
