"""Maximum-entropy probe sets (Belrose et al. 2024, "Neural networks learn statistics of increasing
complexity"): for each class c, examples drawn from N(mu_c, Sigma_c), the Gaussian with that class's
mean and covariance in the (erased) training data, the maximum-entropy distribution with those
first two moments. A model that classifies them as well as the real validation data uses nothing
beyond class means and covariances; after QLEACE (equal class means and covariances) every class
Gaussian is the same, so no model can beat chance on them.

Statistics in float64 (``erasure.class_moments``), sampling x = mu_c + L_c z with L_c the Cholesky
factor of Sigma_c + r_c I. The ridge r_c is relative to the spectrum, d * eps * lambda_max(Sigma_c)
(the project's rank tolerance): it only makes singular covariances (constant pixels, classes with
fewer examples than features) factorisable and changes the sampled covariance by that much. If a
factorisation still fails the ridge grows tenfold, at most ``MAX_RIDGE_STEPS`` times, with a
warning carrying the numbers. z comes from a CPU generator seeded with the data seed, so a probe set
is the same on every device and every run sharing (data, eraser, data_seed).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from erasure import class_moments

log = logging.getLogger(__name__)

MAX_RIDGE_STEPS = 8  # ridge * 10**8 at most: d * eps * 1e8 ~ 1e-5 * lambda_max for d = 3072


@dataclass(frozen=True)
class ProbeSet:
    """Probe examples with the training images' shape, their classes, and how they were drawn."""

    x: Tensor  # float32 (n, *input_shape), on the data's device
    y: Tensor  # int64 (n,)
    info: dict[str, Any]  # recorded in results.json


def class_cholesky(cov: Tensor) -> tuple[Tensor, float]:
    """A float64 lower-triangular L with L L^T = cov + r I, and the ridge r used (module doc)."""
    d = cov.shape[-1]
    top = float(torch.linalg.eigvalsh(cov)[-1]) if d else 0.0
    base = d * torch.finfo(torch.float64).eps * (top if top > 0 else 1.0)
    eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
    for step in range(MAX_RIDGE_STEPS + 1):
        ridge = base * 10.0**step
        factor, info = torch.linalg.cholesky_ex(cov + ridge * eye)
        if int(info) == 0:
            if step:
                warnings.warn(
                    f"max-ent probes: a class covariance (d={d}, lambda_max={top:.3g}) needed ridge {ridge:.3g} "
                    f"({10**step}x the default {base:.3g}) to be factorised",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return factor, ridge
    raise ValueError(
        f"max-ent probes: a class covariance (d={d}, lambda_max={top:.3g}) is not positive "
        f"semi-definite even with ridge {ridge:.3g}"
    )


def sample_class_gaussians(
    x: Tensor, y: Tensor, num_classes: int, n_per_class: Sequence[int], seed: int
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """n_per_class[c] draws from N(mean_c, cov_c) of the rows of x (any shape, flattened inside) per class.

    Returns float32 samples shaped like x's rows, their int64 labels (class by class) and the
    ridges used. Deterministic in ``seed``.
    """
    if len(n_per_class) != num_classes:
        raise ValueError(f"n_per_class has {len(n_per_class)} entries for {num_classes} classes")
    moments = class_moments(x, y, num_classes)
    covs = moments.covariances()
    empty = [c for c in range(num_classes) if n_per_class[c] > 0 and moments.counts[c] == 0]
    if empty:
        raise ValueError(f"max-ent probes: classes {empty} have no training examples, so no moments to match")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    d = moments.dim
    xs, ys, ridges = [], [], []
    for c in range(num_classes):
        n = int(n_per_class[c])
        if n == 0:
            ridges.append(0.0)
            continue
        factor, ridge = class_cholesky(covs[c])
        z = torch.randn(n, d, generator=generator, dtype=torch.float64).to(factor.device)
        xs.append(moments.means[c] + z @ factor.T)
        ys.append(torch.full((n,), c, dtype=torch.int64, device=factor.device))
        ridges.append(ridge)
    samples = torch.cat(xs).to(torch.float32).reshape(-1, *x.shape[1:])
    return samples, torch.cat(ys), {"ridges": ridges}


def maxent_probe_set(dm: Any, n_per_class: int | None = None, seed: int | None = None) -> ProbeSet:
    """The probe set of a set-up ``ErasedDataModule``: class Gaussians of its erased training split.

    ``n_per_class`` None draws as many examples of each class as the validation split has; an
    integer draws that many of every class. ``seed`` defaults to the data module's data_seed.
    """
    from datamodules.erasure_checks import erase  # the same call the data module erases with

    if dm.train_set is None:
        raise RuntimeError("max-ent probes: call dm.setup() first")
    if n_per_class is not None and (
        isinstance(n_per_class, bool) or not isinstance(n_per_class, int) or n_per_class < 1
    ):
        raise ValueError(
            f"probes.n_per_class={n_per_class!r}: must be an integer >= 1 or null "
            f"(null: the validation split's class counts); e.g. probes.n_per_class=200"
        )
    k = dm.num_classes
    x, y = dm.train_set.x, dm.train_set.y
    if dm.options.augment_order == "augment_then_erase" and dm.eraser is not None:
        x = erase(dm.eraser, x, y if dm.eraser.requires_labels else None)  # stored raw; its loaders erase batches
    if n_per_class is None:
        counts = torch.bincount(dm.val_set.y.cpu(), minlength=k).tolist()
    else:
        counts = [n_per_class] * k
    seed = dm.options.data_seed if seed is None else seed
    px, py, info = sample_class_gaussians(x, y, k, counts, seed)
    info = {"n_per_class": counts, "seed": seed, "max_ridge": max(info["ridges"]), "n": len(py)}
    log.info(
        "max-ent probes: %d examples (per class %s) from class Gaussians of the erased training split", len(py), counts
    )
    return ProbeSet(px.to(dm.device), py.to(dm.device), info)
