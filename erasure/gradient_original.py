"""The gradient eraser's recipe ``original``: experiments/iterative_erasure.py@2a41748 as the paper's Table 16
gradient column was made (erasure.gradient's module docstring says what it does; this module holds its steps):
data in [0, 1], each class alone toward clamped global targets by L-BFGS, stored as uint8."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from erasure.gradient_objective import OriginalClassLoss
from erasure.moments import mean_and_scatter
from erasure.preprocess import optimal_linear_shrinkage

log = logging.getLogger(__name__)

UINT8_LEVELS = 255  # original: experiments/iterative_erasure.py@2a41748:168 saves mul(255).clip(0, 255).byte()


def check_original_range(x: Tensor, value_range: Any) -> None:
    """The recipe ``original`` works on data in [0, 1], pixels / 255, as the original
    (experiments/iterative_erasure.py@2a41748:122, :168): anything else is refused, naming the fix."""
    if value_range is not None and [float(v) for v in value_range] != [0.0, 1.0]:
        raise ValueError(
            f"gradient eraser: recipe=original works on data in [0, 1] (pixels / 255, as the original code) and "
            f"stores it as uint8; value_range must be [0, 1] or null, got {list(value_range)}"
        )
    lo, hi = float(x.min()), float(x.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"gradient eraser: recipe=original needs data in [0, 1] (pixels / 255, as the original code), got "
            f"[{lo:.4g}, {hi:.4g}]; z-score after erasure instead of before (data.zscore=after_eraser), or use "
            f"eraser.options.recipe=leace_first with value_range: null"
        )


def quantize_uint8(x: Tensor) -> Tensor:
    """x in [0, 1] as the original stored and read it: floor(255 x) as uint8 (``mul(255).clip(0, 255).byte()``,
    experiments/iterative_erasure.py@2a41748:168, truncation), read back as k / 255 in x's dtype
    (experiments/cli.py@0cc7065:183, ``to_dtype(to_image(img), torch.float32, scale=True)``)."""
    return (x * UINT8_LEVELS).clamp(0, UINT8_LEVELS).to(torch.uint8).to(x.dtype) / UINT8_LEVELS


def original_targets(x: Tensor) -> tuple[Tensor, Tensor, float]:
    """The global targets of the recipe ``original``: the mean of all rows and the optimal linear shrinkage of
    their unbiased covariance (experiments/iterative_erasure.py@2a41748:126-128), element-wise clamped to
    [eps, 1 - eps] and passed through logit and sigmoid as the original (:84-88); eps is the float eps of the
    data's dtype (:80). Statistics in float64 (ours), returned in x's dtype with eps."""
    eps = float(torch.finfo(x.dtype).eps)
    n = x.shape[0]
    mean64, scatter = mean_and_scatter(x)
    cov64 = optimal_linear_shrinkage(scatter / (n - 1), n)  # concept-erasure's, given x.mT.cov() as at :128

    def clamped(t: Tensor) -> Tensor:
        return t.to(x.dtype).clamp(eps, 1 - eps).logit().sigmoid()

    return clamped(mean64), clamped(cov64), eps


def fit_original(
    original: Tensor, rows: list[Tensor], weights: dict[str, float], lbfgs: dict[str, int]
) -> tuple[Tensor, list[float]]:
    """The recipe ``original`` (module docstring): each class alone, one L-BFGS call of ``steps`` iterations,
    then uint8. Returns the stored data and the class-weighted loss before and after (two entries)."""
    n = original.shape[0]
    if n < 2:
        raise ValueError(f"gradient eraser: recipe=original needs at least two rows (a covariance), got {n}")
    target_mean, target_cov, eps = original_targets(original)
    edited = original.clone()
    before = after = 0.0
    for c, idx in enumerate(rows):
        if not idx.numel():
            continue
        if idx.numel() < 2:  # the original asserts it (experiments/iterative_erasure.py@2a41748:78)
            raise ValueError(
                f"gradient eraser: recipe=original needs at least two rows of every class present "
                f"(a covariance per class); class {c} has 1"
            )
        clamped = original[idx].clamp(eps, 1 - eps)
        objective = OriginalClassLoss(
            start=clamped.logit().sigmoid(), target_mean=target_mean, target_cov=target_cov, **weights
        )
        z = clamped.logit().requires_grad_(True)
        optimizer = torch.optim.LBFGS(
            [z], max_iter=lbfgs["steps"], history_size=lbfgs["history_size"], line_search_fn="strong_wolfe"
        )

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = objective.loss(z)
            loss.backward()
            return loss

        start = float(objective.loss(z.detach()))
        optimizer.step(closure)
        with torch.no_grad():
            end = float(objective.loss(z))
            edited[idx] = torch.sigmoid(z)
        if not math.isfinite(end):
            raise FloatingPointError(f"gradient erasure (original, class {c}) diverged (loss {end})")
        iterations = int(optimizer.state[optimizer._params[0]].get("n_iter", 0))
        if lbfgs["log_every"]:
            log.info(
                "gradient erasure (original, class %d): loss %.6g -> %.6g in %d L-BFGS iterations",
                c,
                start,
                end,
                iterations,
            )
        before += start * idx.numel() / n
        after += end * idx.numel() / n
    return quantize_uint8(edited), [before, after]
