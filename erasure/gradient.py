"""Gradient-based moment erasure (paper section 2.4): optimise the dataset itself with L-BFGS.

The edited data is x' = lo + (hi - lo) * sigmoid(z) (values stay in [lo, hi], default [0, 1]),
z initialised at the logit of the starting data (clipped to [margin, 1 - margin], so pixels at
exactly 0 or 1 start ``margin`` away). Two recipes (``recipe``):

``leace_first`` (default; the original code's recipe): LEACE first (class means equal), then each
class alone toward fixed global targets, the mean mu and covariance S of all the LEACE'd data:

    mean_weight * ||mu_z - mu||^2 + cov_weight * ||C_z - S||_F^2 + distance_weight * MSE(x'_z, s_z)

in units where the value range spans 0..255 (as the original's pixels), s the LEACE'd start.
Weights 0.01 / 0.01 / 1 as the original on CIFAR-10 and SVHN. Two steps are ours: LEACE output
that leaves the range is squeezed back by one affine map per feature (``squeeze_into``), and the
class means, which drift in sigmoid coordinates, are finally made equal again by translating each
class (``equalize_means``; ``exact_means: false`` skips it). On digits this leaves a linear probe
and QDA at chance with an RMS change of 0.26 (LEACE alone: 0.20).

``joint`` (the paper's text taken literally): one objective over all classes from the original
data, with w_z the class frequencies:

    mean_weight     * sum_z w_z ||mu_z - mu||^2               (class means vs the overall mean)
  + cov_weight      * sum_z w_z ||C_z - C||_F^2               (class vs unconditional covariance)
  + distance_weight * (1/n) sum_i ||x'_i - x_i||^2             (stay close to the original)

in data units, weights 1 / 1 / 0.01 (our choice). On digits 100 steps leave a linear probe at 44%
and QDA at 32% (chance 15%) with an RMS change of 0.32: it does not meet the paper's criterion.

``original`` (the recipe of the code that made the paper's gradient column, EleutherAI/mdl
experiments/iterative_erasure.py@2a417484a01825783067321e8fc2af2066927ffd, cited by line below): no
LEACE step; the data must lie in [0, 1] (pixels / 255, :122); each class alone, in sigmoid coordinates
from its clamped rows, toward the global mean mu and the shrunk global covariance S of all the data:

    mean_weight * ||mu_z - mu||_2 + cov_weight * ||C_z - S||_F + distance_weight * MSE(x'_z, x_z)

unsquared norms (:98-99, :102), C_z the unbiased covariance (``x.T.cov()``, :99), weights 0.01 / 0.01 / 1
(:20-23), S = optimal linear shrinkage of the unbiased global covariance (:128), and data, mean and S
clamped element-wise to [eps, 1 - eps] (float eps of the data, :80-88: S's negative entries become eps).
One L-BFGS call per class, ``torch.optim.LBFGS(max_iter=steps)`` with strong Wolfe line search and torch's
other defaults (history 100, :92, :108; ``steps`` 100, :36). The result is stored as uint8 images,
``floor(255 x')`` (:168: ``mul(255).clip(0, 255).byte()``), and read back as k / 255
(experiments/cli.py@0cc7065:183, ``to_dtype(..., scale=True)``): ``edited`` holds those values. Ours: the
global statistics in float64 (then cast to the data's dtype); the optimisation in the data's dtype, as the
original's float32.
On digits it barely erases (held-out linear probe 0.91, QDA 0.94): not an early stop (L-BFGS stops on torch's
tolerance_grad at its objective's optimum) but that optimum, where a class mean moves mean_weight * d / 2 = 0.32 on
64 pixels while pixels at exactly 0 or 1 stay at the clamp (docs/differences-from-original.md D3, issue 45).

Memory: loss and gradient are analytic (no autograd graph). ``joint`` holds about
(11 + 2 * history_size) copies of the (n, d) array (CIFAR-10 train, 50000 x 3072 float32 = 0.57
GiB per copy: ~12 GiB with history_size 5); ``leace_first`` about 5 copies (data, LEACE output,
z, start, result) plus L-BFGS buffers for one class only.

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
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.diagnostics import moment_gaps
from erasure.leace import LeaceEraser
from erasure.moments import mean_and_scatter
from erasure.qleace import compute_device
from erasure.gradient_objective import MomentLoss, TargetLoss
from erasure.gradient_original import check_original_range, fit_original

log = logging.getLogger(__name__)

# (mean_weight, cov_weight, distance_weight) of each recipe when left null
RECIPE_WEIGHTS: dict[str, tuple[float, float, float]] = {
    "joint": (1.0, 1.0, 0.01),  # this project's choice (paper section 2.4 names the terms, not their weights)
    "leace_first": (0.01, 0.01, 1.0),  # the original code on CIFAR-10 and SVHN (MSE 1, covariance 0.01, mean 0.01)
    # original: EleutherAI/mdl experiments/iterative_erasure.py@2a41748:20-23 hyperparameters["cifar10"]
    "original": (0.01, 0.01, 1.0),
}
# L-BFGS memory of each recipe when history_size is None: ours for joint and leace_first; the original's is
# torch.optim.LBFGS's default, 100 (original: experiments/iterative_erasure.py@2a41748:92 sets no history_size)
RECIPE_HISTORY: dict[str, int] = {"joint": 5, "leace_first": 5, "original": 100}
CRITERION_POINTS = 0.02  # "almost no quadratically available information" (paper 2.4): probes within 2 points of chance


def fingerprint(x: Tensor) -> str:
    """SHA-256 of the exact bytes, dtype and shape of x."""
    flat = x.detach().contiguous().cpu().reshape(-1)
    digest = hashlib.sha256(f"{x.dtype}{tuple(x.shape)}".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()


@register_eraser("gradient")
@dataclass(frozen=True)
class GradientEraser(Eraser):
    """The edited training data itself; see the module docstring."""

    can_transform_new_data = False
    erases_quadratic = True

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

    recipe: str = "joint"  # a saved fit that names no recipe is a joint fit
    exact_means: bool = False
    rms_change: float = float("nan")  # sqrt(mean((x' - x)^2)) over all pixels of the fitting data
    # rms_change / sqrt(mean((x - mean)^2)): the change relative to the data's own spread (0 = untouched, 1 = as
    # far as a typical image from the mean image); the "close to the original images" half of Sec. 2.4
    relative_rms_change: float = float("nan")

    # The paper's criterion, checked by the data module against its held-out probes (diagnostics):
    # each of these probe accuracies at most CRITERION_POINTS above chance.
    criterion_probes: ClassVar[tuple[str, ...]] = ("linear_probe_acc", "qda_acc")
    criterion_points: ClassVar[float] = CRITERION_POINTS

    @classmethod
    def fit(
        cls,
        x: Tensor,
        y: Tensor,
        num_classes: int,
        recipe: str = "leace_first",
        mean_weight: float | None = None,
        cov_weight: float | None = None,
        distance_weight: float | None = None,
        steps: int = 100,
        history_size: int | None = None,
        value_range: list[float] | None = (0.0, 1.0),
        margin: float = 1e-4,
        chunk_size: int = 4096,
        device: str = "auto",
        log_every: int = 1,
        exact_means: bool = True,
    ) -> "GradientEraser":
        """Weights left None take the recipe's values (``RECIPE_WEIGHTS``); ``steps`` counts L-BFGS
        iterations of the whole data (joint) or of each class (leace_first)."""
        if recipe not in RECIPE_WEIGHTS:
            raise ValueError(f"gradient eraser: recipe must be one of {sorted(RECIPE_WEIGHTS)}, got {recipe!r}")
        given = (mean_weight, cov_weight, distance_weight)
        mean_weight, cov_weight, distance_weight = (
            float(d if w is None else w) for w, d in zip(given, RECIPE_WEIGHTS[recipe])
        )
        history_size = RECIPE_HISTORY[recipe] if history_size is None else history_size
        if min(mean_weight, cov_weight, distance_weight) < 0 or steps < 1 or history_size < 1:
            raise ValueError("weights must be >= 0, steps and history_size >= 1")
        if not 0 < margin < 0.5:
            raise ValueError(f"margin must lie in (0, 0.5), got {margin}")
        if recipe == "original":
            check_original_range(x, value_range)
            value_range = (0.0, 1.0)
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
        weights = {"mean_weight": mean_weight, "cov_weight": cov_weight, "distance_weight": distance_weight}
        lbfgs = {"steps": steps, "history_size": history_size, "log_every": log_every}
        initial = moment_gaps(x, y, num_classes)
        if recipe == "joint":
            edited, losses = _fit_joint(original, rows, lo, hi, margin, chunk_size, weights, lbfgs)
        elif recipe == "original":
            edited, losses = fit_original(original, rows, weights, lbfgs)
        else:
            edited, losses = _fit_leace_first(
                original, y.to(dev), rows, num_classes, lo, hi, margin, weights, lbfgs, exact_means
            )
        edited = edited.to(x.dtype)
        final = moment_gaps(edited, y, num_classes)
        rms = math.sqrt(float(((edited - original).double() ** 2).mean()))
        spread = math.sqrt(float(((original.double() - original.double().mean(0)) ** 2).mean()))
        log.info(
            "gradient erasure (%s) done: loss %.6g -> %.6g, max mean gap %.4g -> %.4g, max cov gap %.4g -> %.4g, "
            "RMS change %.4g",
            recipe,
            losses[0],
            losses[-1],
            initial["max_mean_gap"],
            final["max_mean_gap"],
            initial["max_cov_gap"],
            final["max_cov_gap"],
            rms,
        )
        return cls(
            edited=edited.cpu(),
            fingerprint=fingerprint(x),
            dim=x.shape[1],
            num_classes=num_classes,
            class_counts=[int(r.numel()) for r in rows],
            mean_weight=mean_weight,
            cov_weight=cov_weight,
            distance_weight=distance_weight,
            steps=steps,
            history_size=history_size,
            value_range=[lo, hi],
            margin=margin,
            loss_history=losses,
            initial_gaps=initial,
            final_gaps=final,
            recipe=recipe,
            exact_means=bool(exact_means and recipe == "leace_first"),
            rms_change=rms,
            relative_rms_change=rms / spread if spread > 0 else float("nan"),
        )

    def targeted_gaps(self) -> tuple[str, ...]:
        keys = (("max_mean_gap", self.mean_weight), ("max_cov_gap", self.cov_weight))
        return tuple(key for key, weight in keys if weight > 0)

    def fit_gaps(self) -> tuple[dict[str, float], dict[str, float]]:
        return dict(self.initial_gaps), dict(self.final_gaps)

    def tuning_hint(self) -> str:
        units = {"leace_first": "0..255 units", "original": "[0, 1] units, unsquared norms"}.get(
            self.recipe, "squared data units, so data of small scale need larger weights"
        )
        hint = (
            f"raise eraser.options.steps (now {self.steps}), or eraser.options.mean_weight / cov_weight "
            f"(now {self.mean_weight:g} / {self.cov_weight:g}; the loss is in {units}), "
            f"or lower eraser.options.distance_weight (now {self.distance_weight:g})"
        )
        return hint + ("; or use eraser.options.recipe=leace_first" if self.recipe == "joint" else "")

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


def _start(x: Tensor, lo: float, hi: float, margin: float) -> Tensor:
    """Sigmoid parameters of x, clipped to [margin, 1 - margin] of the range (0 and 1 have no logit)."""
    return torch.logit(((x - lo) / (hi - lo)).clamp(margin, 1 - margin))


def _run_lbfgs(
    z: Tensor,
    objective: Callable[..., tuple[float, Tensor | None, dict[str, float]]],
    steps: int,
    history_size: int,
    log_every: int,
    what: str,
) -> list[float]:
    """``steps`` L-BFGS iterations (strong Wolfe) on z in place; the loss before each and after the last."""
    z.requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [z],
        lr=1.0,
        max_iter=1,
        history_size=history_size,
        line_search_fn="strong_wolfe",
        tolerance_grad=0.0,
        tolerance_change=0.0,
    )
    closure = _closure(z, objective)
    losses: list[float] = []
    for step in range(steps):
        loss = float(optimizer.step(closure))
        losses.append(loss)
        if log_every and (step % log_every == 0):
            log.info("gradient erasure%s: step %d/%d, loss %.6g", what, step + 1, steps, loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"gradient erasure{what} diverged at step {step + 1} (loss {loss})")
        if step and loss == losses[-2]:  # stalled: the line search finds no lower point; more steps change nothing
            log.info("gradient erasure%s: converged after %d of %d steps, loss %.6g", what, step + 1, steps, loss)
            break
    z.requires_grad_(False)
    with torch.no_grad():
        final = objective(z, need_grad=False)[0]
    return losses + [final] * (steps + 1 - len(losses))  # one entry per step and the end, as if it had run on


def _fit_joint(
    original: Tensor,
    rows: list[Tensor],
    lo: float,
    hi: float,
    margin: float,
    chunk_size: int,
    weights: dict[str, float],
    lbfgs: dict[str, int],
) -> tuple[Tensor, list[float]]:
    """Paper section 2.4 as written: one objective over all classes, from the original data."""
    objective = MomentLoss(
        original=original,
        class_rows=[r for r in rows if r.numel()],
        lo=lo,
        span=hi - lo,
        chunk_size=chunk_size,
        **weights,
    )
    z = _start(original, lo, hi, margin)
    losses = _run_lbfgs(z, objective, what="", **lbfgs)
    return objective.data(z).clamp(lo, hi), losses


def squeeze_into(x: Tensor, lo: float, hi: float) -> Tensor:
    """Map each feature's values affinely into [lo, hi] where they leave it (one map for all rows).

    LEACE output leaves the value range (15% of the values on digits). Clipping would be
    class-dependent and put mean gaps back (0.13 on digits) at saturated sigmoids, whose
    gradient is ~0, so the optimisation cannot remove them; an affine map applied to every row
    keeps the class means equal and only shrinks the contrast of the features that overflow.
    """
    low, high = x.min(0).values, x.max(0).values
    new_low, new_high = low.clamp(lo, hi), high.clamp(lo, hi)
    scale = torch.where(high > low, (new_high - new_low) / (high - low), torch.ones_like(low))
    return (new_low + (x - low) * scale).clamp(lo, hi)  # the clamp only removes rounding overshoot


def _fit_leace_first(
    original: Tensor,
    y: Tensor,
    rows: list[Tensor],
    num_classes: int,
    lo: float,
    hi: float,
    margin: float,
    weights: dict[str, float],
    lbfgs: dict[str, int],
    exact_means: bool,
) -> tuple[Tensor, list[float]]:
    """The original code's recipe: LEACE (class means equal), then each class alone toward the
    mean and covariance of all the LEACE'd data. LEACE output can leave [lo, hi]; it is clipped
    into the sigmoid's range first, and the targets are those of the clipped data."""
    leace = LeaceEraser.fit(original, y, num_classes)
    z = _start(squeeze_into(leace(original), lo, hi), lo, hi, margin)
    span = hi - lo
    start = lo + span * torch.sigmoid(z)
    n = start.shape[0]
    mean, cov = mean_and_scatter(start)
    cov /= n
    edited = start.clone()
    total = torch.zeros(lbfgs["steps"] + 1, dtype=torch.float64)
    for c, idx in enumerate(rows):
        if not idx.numel():
            continue
        objective = TargetLoss(start=start[idx], target_mean=mean, target_cov=cov, lo=lo, span=span, **weights)
        zc = z[idx].clone()
        losses = _run_lbfgs(zc, objective, what=f" (class {c})", **lbfgs)
        total += torch.tensor(losses, dtype=torch.float64) * idx.numel() / n
        edited[idx] = objective.data(zc).clamp(lo, hi)
    if exact_means:
        edited = equalize_means(edited, [r for r in rows if r.numel()], lo, hi)
    return edited, total.tolist()


def equalize_means(x: Tensor, rows: list[Tensor], lo: float, hi: float, max_iter: int = 50) -> Tensor:
    """Translate each class onto the overall mean, clip to [lo, hi], repeat until the largest class
    mean gap is below 1e-9 of the range (float64; a few rounds: clipping bites only saturated pixels).

    Why: in sigmoid coordinates L-BFGS moves class means although every term but the mean one is
    translation-free (0.14 max gap on digits with the original weights); a translation per class
    leaves its covariance as it is, so this restores LEACE's equal means at no cost to the rest."""
    out = x.to(torch.float64, copy=True)
    for _ in range(max_iter):
        mean = out.mean(0)
        gaps = [mean - out[idx].mean(0) for idx in rows]
        if max(float(g.norm()) for g in gaps) <= 1e-9 * (hi - lo):
            break
        for idx, gap in zip(rows, gaps):
            out[idx] = (out[idx] + gap).clamp(lo, hi)
    return out.to(x.dtype)
