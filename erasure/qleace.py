"""QLEACE: move every class Gaussian onto the 2-Wasserstein barycenter of all of them.

After the edit x -> T_z (x - mu_z) + mu every class has the same mean mu (class-frequency weighted)
and the same covariance S (the barycenter), so no quadratic function of x predicts the label.

Barycenter (Alvarez-Esteban et al. 2016): S = sum_i w_i (S^{1/2} S_i S^{1/2})^{1/2}, reached by the
fixed point S <- S^{-1/2} (sum_i w_i (S^{1/2} S_i S^{1/2})^{1/2})^2 S^{-1/2}. Cheapest formulation:
the iteration is invariant under congruence, so with any factor S = L L^T (Cholesky, d^3/3 flops)

    M = sum_i w_i (L^T S_i L)^{1/2},    S <- L^{-T} M^2 L^{-1},

i.e. one Cholesky plus k eigendecompositions (batched over classes) per iteration, and no eigh of
S at all (the textbook form needs k + 1, or k + 2 with separate S^{1/2} and S^{-1/2}). The transport
maps come free from the eigendecompositions of the last iteration:

    T_z = S_z^{-1/2} (S_z^{1/2} S S_z^{1/2})^{1/2} S_z^{-1/2} = L (L^T S_z L)^{-1/2} L^T,

so T_z S_z T_z = L L^T = S holds to rounding for the stored S, whatever the residual: erasure
is exact at any tolerance, and a residual r only makes the edit suboptimal by O(r^2) (relative),
hence the default tol = 1e-6 (about 5 iterations on image-like data; each iteration cuts the
residual ~10x).

Singular covariances (documented choices, deterministic, warned once with the numbers):
- Directions with zero variance in every class (constant pixels, exact linear dependencies) carry
  no quadratic information: the fit works in the range of the frequency-weighted mean covariance
  and every class is mapped to mu along the null directions (a constant pixel keeps its value).
- A class whose covariance is singular inside that range (fewer samples than features) has no
  Monge map onto a full-rank barycenter. Its map uses the pseudo-inverse square root on the
  class's own numerical range (eigenvalues above lambda_max * d * eps). Training points of that
  class lie in that range, so none is lost, but that class's erased covariance equals S only on
  L (range of L^T S_z L) and is singular elsewhere. Pass ``shrinkage > 0`` for full-rank maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from erasure.base import Eraser, register_eraser
from erasure.linalg import per_class, psd_eigh, require_variance, smallest_kept, warn_once
from erasure.moments import ClassMoments, dtype_named
from erasure.preprocess import Shrinkage, check_shrinkage, shrink_moments
from erasure.resumable import FitProgress, State, accumulate_class_moments, part, with_prefix


def compute_device(device: str) -> torch.device:
    """'auto' -> the GPU when one is present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but no GPU is available; use device='auto' or 'cpu'")
    return torch.device(device)


@dataclass(frozen=True)
class Barycenter:
    """Barycenter covariance, its factor and the eigendecompositions of L^T S_i L at that factor."""

    covariance: Tensor  # (d, d), = factor @ factor.T
    factor: Tensor  # (d, d)
    eigvals: Tensor  # (k, d) of L^T S_i L, clipped to the kept spectrum
    eigvecs: Tensor  # (k, d, d)
    keep: Tensor  # (k, d) bool
    iterations: int
    residual: float
    objective: float  # sum_i w_i W2^2(N(0, S_i), N(0, S)) at the stored S


def _factor(s: Tensor) -> tuple[Tensor, Tensor]:
    """(L, L^{-1}) with L L^T = s: Cholesky when s is numerically PD, else eigh with pseudo-inverse."""
    s = (s + s.T) / 2
    chol, info = torch.linalg.cholesky_ex(s)
    if int(info) == 0:
        eye = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
        return chol, torch.linalg.solve_triangular(chol, eye, upper=False)
    eigvals, eigvecs, keep = psd_eigh(s)
    root = torch.where(keep, eigvals.sqrt(), 0.0)
    inv_root = torch.where(keep, eigvals.clamp_min(torch.finfo(s.dtype).tiny).rsqrt(), 0.0)
    return eigvecs * root, (eigvecs * inv_root).T


def _sqrt_from_eigh(eigvals: Tensor, eigvecs: Tensor) -> Tensor:
    """Batched V diag(sqrt(lambda)) V^T as one product of V lambda^{1/4} with itself."""
    return per_class(_symmetric_square, eigvecs * eigvals.sqrt().sqrt().unsqueeze(-2))


@dataclass(frozen=True)
class Iterate:
    """Where the fixed point stands after ``iteration`` iterations: the next iteration's S and the objective of the
    last one. All that the iterations after it read, so a fit resumed from it gives the bits of an uninterrupted one."""

    covariance: Tensor  # (d, d)
    previous_objective: float
    iteration: int

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "covariance": self.covariance,
            "previous_objective": torch.tensor(self.previous_objective, dtype=torch.float64),
            "iteration": torch.tensor(self.iteration, dtype=torch.int64),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], device: torch.device) -> "Iterate":
        return cls(state["covariance"].to(device), float(state["previous_objective"]), int(state["iteration"]))


def wasserstein_barycenter(
    covariances: Tensor,
    weights: Tensor,
    tol: float = 1e-10,
    max_iter: int = 100,
    init: Tensor | None = None,
    resume: Iterate | None = None,
    on_iterate: Callable[[Iterate], None] | None = None,
) -> Barycenter:
    """Gaussian W2 barycenter of (k, d, d) PSD covariances by the Alvarez-Esteban fixed point.

    Starts from the weighted arithmetic mean (an upper bound of the barycenter in Loewner order);
    stops when ||S_new - S||_F <= tol * ||S||_F, when the W2 objective
    F(S) = tr S + sum_i w_i tr S_i - 2 sum_i w_i tr (L^T S_i L)^{1/2} increases (beyond rounding:
    level; happens when singular classes make the barycenter singular and convergence sublinear),
    or after max_iter iterations. A fit that can stop: ``on_iterate`` receives the ``Iterate`` after each iteration
    that does not end it, and ``resume`` continues from one.
    """
    weights = weights.to(covariances)
    s = (weights[:, None, None] * covariances).sum(0) if init is None else init
    mean_trace = float(weights @ torch.diagonal(covariances, dim1=-2, dim2=-1).sum(-1))
    residual, previous, done = float("inf"), float("inf"), 0
    if resume is not None:
        s, previous, done = resume.covariance, resume.previous_objective, resume.iteration
    eps = torch.finfo(covariances.dtype).eps
    for iteration in range(done + 1, max_iter + 1):
        factor, factor_inv = _factor(s)
        congruent = per_class(lambda c: factor.T @ c @ factor, covariances)
        eigvals, eigvecs, keep = psd_eigh(congruent)
        objective = float(torch.trace(s)) + mean_trace - 2 * float(weights @ eigvals.sqrt().sum(-1))
        middle = (weights[:, None, None] * _sqrt_from_eigh(eigvals, eigvecs)).sum(0)
        s_new = factor_inv.T @ (middle @ middle) @ factor_inv
        s_new = (s_new + s_new.T) / 2
        residual = float(torch.linalg.matrix_norm(s_new - s) / torch.linalg.matrix_norm(s).clamp_min(1e-300))
        noise = 4 * s.shape[-1] * eps * (float(torch.trace(s)) + mean_trace)  # rounding of the traces
        stalled = iteration > 1 and objective - previous > noise
        if residual <= tol or iteration == max_iter or stalled:
            break
        s, previous = s_new, objective
        if on_iterate is not None:
            on_iterate(Iterate(s, previous, iteration))
    if residual > tol:
        warn_once(
            "qleace-not-converged",
            f"QLEACE: barycenter fixed point stopped after {iteration} iterations at relative residual "
            f"{residual:.3g} > tol {tol:.3g} (objective no longer decreasing or max_iter reached; "
            f"singular class covariances slow it down: consider shrinkage>0)",
        )
    return Barycenter(
        covariance=factor @ factor.T,
        factor=factor,
        eigvals=eigvals,
        eigvecs=eigvecs,
        keep=keep,
        iterations=iteration,
        residual=residual,
        objective=objective,
    )


def transport_maps(bary: Barycenter) -> Tensor:
    """T_z = L (L^T S_z L)^{+1/2} L^T for every class, symmetric PSD, from the stored eigh."""
    tiny = torch.finfo(bary.eigvals.dtype).tiny
    inv_root = torch.where(bary.keep, bary.eigvals.clamp_min(tiny).rsqrt().sqrt(), 0.0)
    return per_class(
        lambda vecs, root: _symmetric_square(bary.factor @ (vecs * root.unsqueeze(-2))), bary.eigvecs, inv_root
    )


def _symmetric_square(half: Tensor) -> Tensor:
    return half @ half.transpose(-1, -2)


def _mean_covariance_eigh(covariances: Tensor, weights: Tensor) -> dict[str, Tensor]:
    """The eigendecomposition of the frequency-weighted mean covariance (``_span_basis`` reads it): a step of its own
    in a resumable fit, which keeps it (one eigh of d x d, minutes at CIFAR-10's size on a busy CPU)."""
    eigvals, eigvecs, keep = psd_eigh((weights[:, None, None] * covariances).sum(0))
    return {"eigvals": eigvals, "eigvecs": eigvecs, "keep": keep}


def _span_basis(covariances: Tensor, weights: Tensor, eigh: dict[str, Tensor] | None = None) -> Tensor | None:
    """Orthonormal basis of the range of the mean covariance, or None when it is full rank (``eigh``: the mean
    covariance's ``_mean_covariance_eigh`` when it is already known)."""
    eigh = _mean_covariance_eigh(covariances, weights) if eigh is None else eigh
    eigvals, eigvecs, keep = eigh["eigvals"], eigh["eigvecs"], eigh["keep"]
    d, rank = eigvals.shape[0], int(keep.sum())
    require_variance(keep, "QLEACE")
    if rank == d:
        return None
    warn_once(
        "qleace-common-null",
        f"QLEACE: the class covariances span {rank} of {d} dimensions (constant pixels or exact "
        f"dependencies); smallest kept eigenvalue {smallest_kept(eigvals, keep):.3g}; the other "
        f"{d - rank} directions are mapped to the mean",
    )
    return eigvecs[:, keep]


def _moments_and_span(
    x: Tensor,
    y: Tensor,
    num_classes: int,
    shrinkage: Shrinkage,
    batch_size: int,
    progress: FitProgress | None,
    restored: State,
    dtype: torch.dtype = torch.float64,
) -> tuple[ClassMoments, Tensor, dict[str, Tensor], State]:
    """The (shrunk) class moments, their covariances and the mean covariance's ``_mean_covariance_eigh``: each taken
    from ``restored`` when a stopped fit kept it, else computed (the moments' pass resumed where it stopped) and
    offered to ``progress``; and the state that holds both, which every later offer of the fit includes."""
    offer = progress.offer if progress is not None else lambda state, stable: None
    kept = {k: v.to(x.device) for k, v in part("moments_done", restored).items()}  # a finished pass, unshrunk
    if not kept:
        raw = accumulate_class_moments(x, y, num_classes, batch_size, progress, restored, dtype).finish()
        kept = {"counts": raw.counts, "means": raw.means, "scatters": raw.scatters}
        offer(lambda: with_prefix("moments_done", kept), stable=True)
    moments = shrink_moments(ClassMoments(kept["counts"], kept["means"], kept["scatters"]), shrinkage)
    covs, span = moments.covariances(), {k: v.to(x.device) for k, v in part("span", restored).items()}
    if not span:
        span = _mean_covariance_eigh(covs, moments.weights)
        offer(lambda: {**with_prefix("moments_done", kept), **with_prefix("span", span)}, stable=True)
    return moments, covs, span, {**with_prefix("moments_done", kept), **with_prefix("span", span)}


def _warn_singular_classes(bary: Barycenter, counts: Tensor) -> None:
    ranks = bary.keep.sum(-1)
    dim = bary.keep.shape[-1]
    singular = [(c, int(ranks[c])) for c in range(len(ranks)) if int(ranks[c]) < dim and counts[c] > 0]
    if singular:
        smallest = float(torch.where(bary.keep, bary.eigvals, torch.inf).amin())
        listed = ", ".join(f"class {c}: rank {r} ({int(counts[c])} samples)" for c, r in singular[:5])
        warn_once(
            "qleace-singular-class",
            f"QLEACE: {len(singular)} class covariance(s) are singular in the {dim}-dimensional data span "
            f"({listed}{', ...' if len(singular) > 5 else ''}); smallest kept eigenvalue {smallest:.3g}; "
            f"their maps use the pseudo-inverse on each class's range, so those classes match the "
            f"barycenter only there; pass shrinkage>0 (e.g. 0.01) for full-rank maps",
        )


@register_eraser("qleace")
@dataclass(frozen=True)
class QLeaceEraser(Eraser):
    """Class-dependent affine maps x -> T_z (x - mu_z) + mu onto the Gaussian W2 barycenter."""

    requires_labels = True
    erases_quadratic = True

    class_means: Tensor  # (k, d)
    mean: Tensor  # (d,)
    maps: Tensor  # (k, d, d) symmetric T_z
    barycenter: Tensor  # (d, d)
    dim: int
    num_classes: int
    class_counts: list[int]
    iterations: int
    residual: float
    objective: float
    tol: float
    max_iter: int
    shrinkage: Shrinkage
    span_rank: int

    @classmethod
    def fit(
        cls,
        x: Tensor,
        y: Tensor,
        num_classes: int,
        tol: float = 1e-6,
        max_iter: int = 100,
        shrinkage: Shrinkage = 0.0,
        device: str = "auto",
        batch_size: int = 8192,
        fit_dtype: str = "float64",
        progress: FitProgress | None = None,
    ) -> "QLeaceEraser":
        """Fit the barycenter and every class's transport map on x (n, d) and labels y (n,). ``device`` is only
        where the float64 moments and iterations run: the eraser's tensors come back on the CPU, and its user puts
        them where the data is. ``tol`` trades iterations for optimality only (erasure is exact at any tol).
        ``progress`` (not an option: how the fit runs, erasure.resumable): the fit resumes from the state it restores
        and offers its state after every batch of the moments, the span and every iteration of the barycenter.
        ``fit_dtype``: float64 (ours), or float32: moments, barycenter and maps in float32, and the eraser applies
        them in float32, as the original's concept-erasure QuadraticFitter built with dtype=torch.float32
        (experiments/cli.py@0cc7065:323, :330, :346, :386)."""
        if not (tol > 0 and max_iter >= 1):
            raise ValueError(f"QLEACE needs tol > 0 and max_iter >= 1, got tol={tol}, max_iter={max_iter}")
        check_shrinkage(shrinkage)
        dtype = dtype_named(fit_dtype)
        dev = compute_device(device)
        restored = (progress.restore() if progress is not None else None) or {}
        offer = progress.offer if progress is not None else lambda state, stable: None
        x, y = x.to(dev), y.to(dev)
        moments, covs, span, done = _moments_and_span(
            x, y, num_classes, shrinkage, batch_size, progress, restored, dtype
        )
        weights = moments.weights
        basis = _span_basis(covs, weights, span)
        reduced = covs if basis is None else basis.T @ covs @ basis
        saved_iterate = part("barycenter", restored)
        bary = wasserstein_barycenter(
            reduced,
            weights,
            tol=tol,
            max_iter=max_iter,
            resume=Iterate.from_state_dict(saved_iterate, dev) if saved_iterate else None,
            on_iterate=lambda it: offer(lambda: {**done, **with_prefix("barycenter", it.state_dict())}, stable=True),
        )
        _warn_singular_classes(bary, moments.counts)
        maps, s = transport_maps(bary), bary.covariance
        if basis is not None:
            maps, s = basis @ maps @ basis.T, basis @ s @ basis.T
        maps = (maps + maps.transpose(-1, -2)) / 2
        cpu = torch.device("cpu")
        return cls(
            class_means=moments.means.to(cpu),
            mean=moments.mean.to(cpu),
            maps=maps.to(cpu),
            barycenter=((s + s.T) / 2).to(cpu),
            dim=x.shape[1],
            num_classes=num_classes,
            class_counts=[int(c) for c in moments.counts],
            iterations=bary.iterations,
            residual=bary.residual,
            objective=bary.objective,
            tol=tol,
            max_iter=max_iter,
            shrinkage=shrinkage,
            span_rank=x.shape[1] if basis is None else basis.shape[1],
        )

    def targeted_gaps(self) -> tuple[str, ...]:
        return ("max_mean_gap", "max_cov_gap")

    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        """Each class's rows through its own map. The rows are grouped by a stable sort, so a class's
        rows meet its map in their original order (the same numbers as selecting them by a mask),
        and the class counts, which size the products, are the one value read back to the host
        (selecting by masks, a GPU waits for the host once or twice per class)."""
        assert y is not None
        order = torch.argsort(y, stable=True)
        counts = (y[:, None] == torch.arange(self.num_classes, device=y.device)).sum(0)  # any integer dtype
        grouped = x[order].to(self.maps.dtype)  # erased in place, class by class: memory of two copies of x; in the
        # fit's dtype (float64 unless fitted in float32, as the original)
        means, maps = self.class_means.to(x.device), self.maps.to(x.device)
        for c, rows in enumerate(grouped.split(counts.tolist())):
            if rows.shape[0]:
                rows.copy_(rows.sub_(means[c]) @ maps[c])
        out = torch.empty_like(grouped)
        out[order] = grouped.add_(self.mean.to(x.device))
        return out
