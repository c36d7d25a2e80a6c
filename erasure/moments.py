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
    scatters: Tensor  # (k, d, d) centred sums of outer products

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
        return self.scatters / self.counts.clamp_min(1)[:, None, None]

    def pooled_covariance(self) -> Tensor:
        """Total covariance of the data: within-class scatter plus between-class scatter."""
        n = self.counts.sum()
        centred = self.means - self.mean
        between = (centred.T * self.counts) @ centred
        return (self.scatters.sum(0) + between) / n

    def cross_covariance(self) -> Tensor:
        """Cov(x, one_hot(y)), shape (d, k): what LEACE must zero."""
        return (self.means - self.mean).T * self.weights


FIT_DTYPES = {"float64": torch.float64, "float32": torch.float32}  # an eraser's ``fit_dtype`` option


def dtype_named(name: str) -> torch.dtype:
    """The dtype an eraser's ``fit_dtype`` option names: float64 (ours), or float32 (the original's QLEACE and
    ALF-QLEACE fits)."""
    if name not in FIT_DTYPES:
        raise ValueError(f"fit_dtype={name!r}: use one of {', '.join(FIT_DTYPES)}")
    return FIT_DTYPES[name]


class MomentAccumulator:
    """Per-class counts, sums and scatter matrices in float64, one batch per ``add``: ``class_moments`` in steps that a
    fit can stop between and resume from. ``state_dict`` holds the running sums and the rows taken; an accumulator
    that ``load_state_dict``\ s them and takes the remaining batches gives the bits of one uninterrupted pass.

    Scatter matrices are accumulated around a per-class shift (the first batch's class mean), so large offsets (e.g.
    pixel values near 1) do not cost precision.
    """

    FIELDS = ("counts", "sums", "shift", "shifted_sums", "scatters", "have_shift", "rows")

    def __init__(
        self, num_classes: int, dim: int, device: torch.device | None = None, dtype: torch.dtype = torch.float64
    ):
        """``dtype``: what the sums are accumulated in (float64; float32 as the original's float32 fitters)."""
        kind = {"dtype": dtype, "device": device}
        self.counts = torch.zeros(num_classes, **kind)
        self.sums = torch.zeros(num_classes, dim, **kind)
        self.shift = torch.zeros(num_classes, dim, **kind)
        self.shifted_sums = torch.zeros(num_classes, dim, **kind)
        self.scatters = torch.zeros(num_classes, dim, dim, **kind)
        self.have_shift = torch.zeros(num_classes, dtype=torch.bool, device=device)
        self.rows = 0  # rows taken so far: where the next batch starts

    def add(self, xb: Tensor, yb: Tensor) -> None:
        """Take the next batch of flattened rows ``xb`` (b, d) and their labels ``yb`` (b,)."""
        xb = xb.to(self.counts.dtype)
        yb = yb.to(self.counts.device)
        for c in torch.unique(yb).tolist():
            xc = xb[yb == c]
            if not self.have_shift[c]:
                self.shift[c] = xc.mean(0)
                self.have_shift[c] = True
            self.counts[c] += xc.shape[0]
            self.sums[c] += xc.sum(0)
            xs = xc - self.shift[c]
            self.shifted_sums[c] += xs.sum(0)
            self.scatters[c] += xs.T @ xs
        self.rows += xb.shape[0]

    def finish(self) -> ClassMoments:
        """The moments of every row taken. Works on the running sums in place (no second copy of the scatter
        matrices): the accumulator takes no more batches afterwards."""
        counts, scatters = self.counts, self.scatters
        means = self.sums / counts.clamp_min(1)[:, None]
        # sum (x - s)(x - s)^T = scatter_about_mean + n (mu - s)(mu - s)^T
        delta = self.shifted_sums / counts.clamp_min(1)[:, None]
        scatters -= counts[:, None, None] * delta[:, :, None] * delta[:, None, :]
        scatters = (scatters + scatters.transpose(1, 2)) / 2
        self.scatters = None  # spent: the next add fails instead of counting from a finished sum
        return ClassMoments(counts=counts, means=means, scatters=scatters)

    def state_dict(self) -> dict[str, Tensor]:
        """The running sums and the rows taken (the tensors themselves: save them before the next ``add``)."""
        state = {name: getattr(self, name) for name in self.FIELDS if name != "rows"}
        return {**state, "rows": torch.tensor(self.rows, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue from ``state_dict()``\ 's sums (of an accumulator of the same classes, dimension and order)."""
        for name in self.FIELDS[:-1]:
            mine = getattr(self, name)
            theirs = state.get(name)
            if theirs is None or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                found = None if theirs is None else (tuple(theirs.shape), theirs.dtype)
                raise ValueError(
                    f"saved moments do not fit this accumulator: {name} is {found}, expected "
                    f"{(tuple(mine.shape), mine.dtype)}"
                )
            mine.copy_(theirs)
        self.rows = int(state["rows"])


def class_moments(
    x: Tensor, y: Tensor, num_classes: int, batch_size: int = 8192, dtype: torch.dtype = torch.float64
) -> ClassMoments:
    """Accumulate counts, sums and centred scatter matrices per class in ``dtype`` (float64 unless asked),
    ``batch_size`` rows at a time (``MomentAccumulator``)."""
    x = x.reshape(x.shape[0], -1)
    accumulator = MomentAccumulator(num_classes, x.shape[1], x.device, dtype)
    for start in range(0, x.shape[0], batch_size):
        accumulator.add(x[start : start + batch_size], y[start : start + batch_size])
    return accumulator.finish()


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
