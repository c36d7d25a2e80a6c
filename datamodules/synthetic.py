"""Gaussian classes with a known answer: how much class information sits in means vs covariances.

Class z is N(mu_z, Sigma_z) with
    mu_z    = center + mean_shift * std * u_z                     (u_z a random unit vector)
    Sigma_z = std^2 * Q_z diag(exp(cov_shift * g_z)) Q_z^T       (Q_z random orthogonal, g_z ~ N(0, I))
so ``mean_shift=0`` gives classes that differ only in covariance (LEACE keeps all of their
information, QLEACE removes all of it) and ``cov_shift=0`` classes that differ only in mean.
Values are not clipped to [0, 1]: clipping would make the classes non-Gaussian and spoil the
known answer (with the default std almost all values lie in [0, 1] anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from datamodules.sources import ImageSet, ImageSource, register_source, stream_generator

MIN_STD_STEPS = 1000  # std must span this many float32 steps, or the moments are rounding noise


SAMPLE_CHUNK = 1024  # rows drawn at once; a multiple of 16, see ``sample``


@dataclass(frozen=True)
class GaussianClasses:
    means: Tensor  # (k, d) float64
    factors: Tensor  # (k, d, d): Sigma_z = factors_z @ factors_z.T

    @property
    def covariances(self) -> Tensor:
        """(k, d, d) float64, computed on demand: at image size (d = 3072) each copy is k x 75 MB."""
        return self.factors @ self.factors.transpose(1, 2)


def gaussian_classes(
    num_classes: int,
    dim: int,
    mean_shift: float,
    cov_shift: float,
    std: float,
    center: float,
    generator: torch.Generator,
) -> GaussianClasses:
    """Draw the class parameters (float64) from ``generator``.

    The Gaussian matrices are drawn in one call and orthogonalised one class at a time, in place,
    so the peak is one (k, d, d) array plus one class's QR (a batched QR would hold three).
    """
    kw = {"dtype": torch.float64, "generator": generator}
    directions = torch.randn(num_classes, dim, **kw)
    directions /= directions.norm(dim=1, keepdim=True)
    means = center + mean_shift * std * directions
    factors = torch.randn(num_classes, dim, dim, **kw)
    log_scales = torch.randn(num_classes, dim, **kw)
    for z in range(num_classes):
        rotation, _ = torch.linalg.qr(factors[z])
        factors[z] = std * rotation * torch.exp(0.5 * cov_shift * log_scales[z])
    return GaussianClasses(means=means, factors=factors)


def sample(
    classes: GaussianClasses, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """n samples with balanced, shuffled labels (class sizes differ by at most one).

    Drawn in chunks of ``SAMPLE_CHUNK`` rows, one matmul per class, so memory is the (n, d)
    output in ``dtype`` plus one chunk (no (n, d, d) array of per-example factors). The noise
    is the same stream as one (n, d) draw: torch's CPU normal sampler transforms uniforms in
    blocks of 16 and redraws the last block of a tensor whose size is not a multiple of 16, so
    chunks of a multiple of 16 rows, the last absorbing the remainder, give identical values.
    """
    k, d = classes.means.shape
    y = torch.arange(n) % k
    y = y[torch.randperm(n, generator=generator)]
    x = torch.empty(n, d, dtype=dtype)
    starts = list(range(0, n, SAMPLE_CHUNK))
    if len(starts) > 1 and n - starts[-1] < SAMPLE_CHUNK:
        starts.pop()  # the last chunk takes the remainder (a short last chunk would draw differently)
    for start, stop in zip(starts, starts[1:] + [n]):
        noise = torch.randn(stop - start, d, dtype=torch.float64, generator=generator)
        labels = y[start:stop]
        chunk = classes.means[labels]
        for z in range(k):
            rows = torch.nonzero(labels == z).squeeze(1)
            chunk[rows] += noise[rows] @ classes.factors[z].T
        x[start:stop] = chunk
    return x, y


def _check(
    num_classes: int, shape: Sequence[int], n_train: int, n_test: int, std: float, **reals: float
) -> tuple[int, int, int]:
    """Refuse options that would give no data, NaN data or data that float32 turns into one point."""
    for key, value in (("num_classes", num_classes), ("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"synthetic: data.options.{key} must be an integer, got {value!r}")
    if num_classes < 2:
        raise ValueError(f"synthetic: data.options.num_classes must be >= 2, got {num_classes}")
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"synthetic: data.options.shape must be [channels, height, width], got {list(shape)}")
    if n_train < num_classes or n_test < 0:
        raise ValueError(
            f"synthetic: need data.options.n_train >= num_classes and data.options.n_test >= 0, got {n_train}, {n_test}"
        )
    for key, value in {"std": std, **reals}.items():
        if not math.isfinite(float(value)):
            raise ValueError(f"synthetic: data.options.{key} must be a finite number, got {value}")
    if std <= 0:
        raise ValueError(f"synthetic: data.options.std must be positive, got {std}")
    center = abs(float(reals.get("center", 0.0)))
    resolution = torch.finfo(torch.float32).eps * center  # float32 step size around the center
    if std < MIN_STD_STEPS * resolution:
        raise ValueError(
            f"synthetic: data.options.std={std:g} is below what float32 resolves around center {center:g} "
            f"(steps of {resolution:.2g}): the samples would be (nearly) identical and their moments rounding noise; "
            f"use data.options.std >= {MIN_STD_STEPS * resolution:.2g}"
        )
    return tuple(int(s) for s in shape)  # type: ignore[return-value]


@register_source(
    "synthetic", size=lambda shape=(1, 4, 4), n_train=4000, n_test=2000, **_: (n_train + n_test, tuple(shape))
)
def load_synthetic(
    num_classes: int = 3,
    shape: Sequence[int] = (1, 4, 4),
    n_train: int = 4000,
    n_test: int = 2000,
    mean_shift: float = 0.0,
    cov_shift: float = 1.0,
    std: float = 0.1,
    center: float = 0.5,
    generator_seed: int = 0,
    **_: Any,
) -> ImageSource:
    """Gaussian class data shaped like images (float32 (n, c, h, w)); the same seed gives the same data."""
    c, h, w = _check(
        num_classes, shape, n_train, n_test, std, mean_shift=mean_shift, cov_shift=cov_shift, center=center
    )
    classes = gaussian_classes(
        num_classes,
        c * h * w,
        mean_shift,
        cov_shift,
        std,
        center,
        stream_generator("synthetic", generator_seed, "classes"),
    )
    sets = []
    for part, n in (("train", n_train), ("test", n_test)):
        x, y = sample(classes, n, stream_generator("synthetic", generator_seed, part), dtype=torch.float32)
        sets.append(ImageSet(x.reshape(n, c, h, w), y))
    return ImageSource(
        name="synthetic",
        train=sets[0],
        test=sets[1] if n_test > 0 else None,
        classes=[f"class{z}" for z in range(num_classes)],
    )
