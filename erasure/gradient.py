"""Gradient-based moment erasure (paper section 2.4): optimise the dataset itself with L-BFGS.

The edited data is x' = lo + (hi - lo) * sigmoid(z) (values stay in [lo, hi], default [0, 1]),
z initialised at the logit of the original data (clipped to [margin, 1 - margin], so pixels at
exactly 0 or 1 start ``margin`` away). Loss, with w_z the class frequencies:

    mean_weight     * sum_z w_z ||mu_z - mu||^2               (class means vs the overall mean)
  + cov_weight      * sum_z w_z ||C_z - C||_F^2               (class vs unconditional covariance)
  + distance_weight * (1/n) sum_i ||x'_i - x_i||^2             (stay close to the original)

Memory: loss and gradient are computed analytically in row chunks (no autograd graph), so the
resident cost is the data, z, L-BFGS's buffers and a one-entry evaluation cache: about
(11 + 2 * history_size) copies of the (n, d) array in the data's dtype (CIFAR-10 train, 50000 x 3072
float32 = 0.57 GiB per copy, with the default history_size 5: ~12 GiB, inside 24 GiB).

This eraser edits the data it was fitted on and cannot transform new data
(``can_transform_new_data = False``): the edited data is stored in the eraser (``edited``, rows
in the input order) and ``eraser(x)`` returns it only when ``x`` is bit-identical to the fitting
data (checked by a SHA-256 fingerprint); anything else raises a ValueError saying so.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.diagnostics import moment_gaps
from erasure.qleace import compute_device

log = logging.getLogger(__name__)


def fingerprint(x: Tensor) -> str:
    """SHA-256 of the exact bytes, dtype and shape of x."""
    flat = x.detach().contiguous().cpu().reshape(-1)
    digest = hashlib.sha256(f"{x.dtype}{tuple(x.shape)}".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()


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


@register_eraser("gradient")
@dataclass(frozen=True)
class GradientEraser(Eraser):
    """The edited training data itself; see the module docstring."""

    can_transform_new_data = False

    edited: Tensor  # (n, d), input dtype, input row order
    fingerprint: str
    dim: int
    num_classes: int
    class_counts: list[int]
    mean_weight: float
    cov_weight: float
    distance_weight: float
    steps: int
    history_size: int
    value_range: list[float]
    margin: float
    loss_history: list[float]
    initial_gaps: dict[str, float]
    final_gaps: dict[str, float]

    @classmethod
    def fit(
        cls,
        x: Tensor,
        y: Tensor,
        num_classes: int,
        mean_weight: float = 1.0,
        cov_weight: float = 1.0,
        distance_weight: float = 0.01,
        steps: int = 100,
        history_size: int = 5,
        value_range: list[float] | None = (0.0, 1.0),
        margin: float = 1e-4,
        chunk_size: int = 4096,
        device: str = "auto",
        log_every: int = 1,
    ) -> "GradientEraser":
        if min(mean_weight, cov_weight, distance_weight) < 0 or steps < 1 or history_size < 1:
            raise ValueError("weights must be >= 0, steps and history_size >= 1")
        if not 0 < margin < 0.5:
            raise ValueError(f"margin must lie in (0, 0.5), got {margin}")
        lo, hi = (float(x.min()), float(x.max())) if value_range is None else map(float, value_range)
        if not hi > lo:
            raise ValueError(f"value_range must have low < high, got [{lo}, {hi}]")
        if float(x.min()) < lo or float(x.max()) > hi:
            raise ValueError(
                f"data range [{float(x.min()):.4g}, {float(x.max()):.4g}] lies outside value_range "
                f"[{lo}, {hi}]; scale the data into it or set value_range (null = the data's min and max)"
            )
        dev = compute_device(device)
        original = x.to(dev)
        rows = [torch.nonzero(y == c).squeeze(1).to(dev) for c in range(num_classes)]
        objective = MomentLoss(
            original=original, class_rows=[r for r in rows if r.numel()], lo=lo, span=hi - lo,
            mean_weight=mean_weight, cov_weight=cov_weight, distance_weight=distance_weight, chunk_size=chunk_size,
        )
        unit = ((original - lo) / (hi - lo)).clamp(margin, 1 - margin)
        z = torch.logit(unit).requires_grad_(True)
        del unit
        initial = moment_gaps(x, y, num_classes)
        optimizer = torch.optim.LBFGS(
            [z], lr=1.0, max_iter=1, history_size=history_size, line_search_fn="strong_wolfe",
            tolerance_grad=0.0, tolerance_change=0.0,
        )
        closure = _closure(z, objective)
        losses: list[float] = []
        for step in range(steps):
            loss = float(optimizer.step(closure))
            losses.append(loss)
            if log_every and (step % log_every == 0):
                log.info("gradient erasure: step %d/%d, loss %.6g", step + 1, steps, loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"gradient erasure diverged at step {step + 1} (loss {loss})")
        with torch.no_grad():
            losses.append(objective(z, need_grad=False)[0])
            edited = objective.data(z.detach()).clamp(lo, hi).to(x.dtype)
        final = moment_gaps(edited, y, num_classes)
        log.info(
            "gradient erasure done: loss %.6g -> %.6g, max mean gap %.4g -> %.4g, max cov gap %.4g -> %.4g",
            losses[0], losses[-1], initial["max_mean_gap"], final["max_mean_gap"],
            initial["max_cov_gap"], final["max_cov_gap"],
        )
        return cls(
            edited=edited.cpu(), fingerprint=fingerprint(x), dim=x.shape[1], num_classes=num_classes,
            class_counts=[int(r.numel()) for r in rows], mean_weight=mean_weight, cov_weight=cov_weight,
            distance_weight=distance_weight, steps=steps, history_size=history_size, value_range=[lo, hi],
            margin=margin, loss_history=losses, initial_gaps=initial, final_gaps=final,
        )

    def targeted_gaps(self) -> tuple[str, ...]:
        keys = (("max_mean_gap", self.mean_weight), ("max_cov_gap", self.cov_weight))
        return tuple(key for key, weight in keys if weight > 0)

    def fit_gaps(self) -> tuple[dict[str, float], dict[str, float]]:
        return dict(self.initial_gaps), dict(self.final_gaps)

    def tuning_hint(self) -> str:
        return (
            f"raise eraser.options.steps (now {self.steps}), or eraser.options.mean_weight / cov_weight "
            f"(now {self.mean_weight:g} / {self.cov_weight:g}; the loss is in squared data units, so data of small "
            f"scale need larger weights), or lower eraser.options.distance_weight (now {self.distance_weight:g})"
        )

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        if tuple(x.shape) != tuple(self.edited.shape) or fingerprint(x) != self.fingerprint:
            raise ValueError(
                f"the 'gradient' eraser edits the dataset it was fitted on and cannot transform new data "
                f"(got {tuple(x.shape)}, fitted on {tuple(self.edited.shape)}, or the values differ); "
                f"fit it on the data you want to edit: fit_eraser('gradient', x, y)(x)"
            )
        return self.edited.to(x.device).clone()


def _closure(z: Tensor, objective: MomentLoss) -> Callable[[], Tensor]:
    """L-BFGS closure that sets z.grad; re-evaluating at the same z (each step() starts with the
    point its last line search accepted) is served from a one-entry cache."""
    cache: dict[str, Any] = {}

    def closure() -> Tensor:
        with torch.no_grad():
            if "z" in cache and torch.equal(cache["z"], z):
                loss, grad = cache["loss"], cache["grad"].clone()
            else:
                loss, grad, _ = objective(z.detach())
                cache.update(z=z.detach().clone(), loss=loss, grad=grad.clone())
        z.grad = grad
        return torch.tensor(loss, dtype=torch.float64)

    return closure
