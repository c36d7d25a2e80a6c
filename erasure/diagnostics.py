"""How much class information is left after erasure: moment gaps and held-out probe accuracy.

``erasure_report`` returns flat float metrics for a logger:
- ``max_mean_gap``: max_z ||mu_z - mu||_2 (mu = class-frequency weighted mean), data units;
- ``max_cov_gap``: max_z ||S_z - S_bar||_F / ||S_bar||_F, S_bar = weighted mean class covariance;
- ``linear_probe_acc`` (multinomial logistic regression) and ``qda_acc`` (quadratic discriminant):
  accuracy on held-out data, i.e. how much linear and quadratic information is left;
each with suffix ``_before`` and ``_after``, plus ``chance``: the expected accuracy of a guess drawn
from the probe-training class prior, sum_k p_train(k) p_heldout(k) (1/K for balanced classes; not the
majority-class rate, which is what a probe that learned nothing but the prior would score and
overstates chance on imbalanced data). The probes are kept cheap: at most ``max_samples``
training rows, and PCA to ``max_features`` dimensions (fitted on the probe's training rows) when
given; by default (None) as many dimensions as the data has, up to one less than the smallest class
of the probe's training rows (so QDA's class covariances are estimable: 3072-dimensional CIFAR-10 is
probed on about 500 dimensions). Features that vary only at rounding level
(``informative_features``) are left out before standardising. scikit-learn is imported lazily, so erasure/
stays importable with torch alone.

Diagnostics never stop a run: a probe that cannot be fitted (e.g. QDA with fewer samples per
class than features) is left out of the report, with the reason put in ``skipped`` and warned.
``erasure_shortfall`` compares gaps before and after, to say when an eraser did not erase;
``probe_shortfall`` names the probes left above chance (the gradient eraser's criterion).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Mapping

import torch
from torch import Tensor

from erasure.moments import class_moments

if TYPE_CHECKING:
    import numpy as np


def moment_gaps(x: Tensor, y: Tensor, num_classes: int | None = None, batch_size: int = 8192) -> dict[str, float]:
    """Largest class-mean gap (absolute) and largest relative class-covariance gap, in float64."""
    k = int(y.max()) + 1 if num_classes is None else num_classes
    moments = class_moments(x.reshape(x.shape[0], -1), y.long(), k, batch_size=batch_size)
    present = moments.counts > 0
    mean_gap = (moments.means[present] - moments.mean).norm(dim=1).max()
    covs = moments.covariances()[present]
    mean_cov = (moments.weights[present, None, None] * covs).sum(0)
    cov_gap = torch.linalg.matrix_norm(covs - mean_cov).max() / torch.linalg.matrix_norm(mean_cov).clamp_min(1e-300)
    return {"max_mean_gap": float(mean_gap), "max_cov_gap": float(cov_gap)}


ROUNDING_STD = 1e-5  # features whose std is below this fraction of the largest std are rounding noise


def informative_features(x: "np.ndarray") -> "np.ndarray":
    """Mask of the features the probes may use: std above ``ROUNDING_STD`` x the largest std.

    Why: an eraser maps a constant pixel (digits has several) to its constant plus float rounding
    error that depends on the other pixels, hence on the class. The probes' StandardScaler would
    blow that 1e-8-sized noise up to unit variance and read class information out of it (LEACE on
    digits: linear probe 59% instead of chance). No real pixel varies 1e5 times less than the
    most variable one.
    """
    std = x.std(axis=0)
    keep = std > ROUNDING_STD * std.max()
    return keep if keep.any() else std >= std.max()


def _probe_models(n_train: int, dim: int, max_features: int, seed: int) -> dict[str, object]:
    """The linear and quadratic probes (scaled, PCA-reduced when the data are wider than allowed); ``max_features`` is
    the dimension cap already resolved (see ``probe_dimensions``)."""
    from sklearn.decomposition import PCA
    from sklearn.discriminant_analysis import QuadraticDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    dims = max(1, min(max_features, dim, n_train - 1))

    def steps() -> list[object]:
        return [StandardScaler()] + ([PCA(dims, random_state=seed)] if dims < dim else [])

    return {
        "linear_probe_acc": make_pipeline(*steps(), LogisticRegression(max_iter=500)),
        "qda_acc": make_pipeline(*steps(), QuadraticDiscriminantAnalysis(reg_param=1e-3)),
    }


def _probe_accuracies(
    x_train: Tensor,
    y_train: Tensor,
    x_test: Tensor,
    y_test: Tensor,
    max_features: int,
    seed: int,
    skipped: dict[str, str],
) -> dict[str, float]:
    """Held-out accuracy of each probe; a probe sklearn cannot fit goes to ``skipped`` with its reason."""
    import numpy as np

    xtr = x_train.reshape(x_train.shape[0], -1).double().cpu().numpy()
    xte = x_test.reshape(x_test.shape[0], -1).double().cpu().numpy()
    varying = informative_features(xtr)
    xtr, xte = xtr[:, varying], xte[:, varying]
    ytr, yte = y_train.cpu().numpy(), y_test.cpu().numpy()
    out = {}
    dims = probe_dimensions(y_train, xtr.shape[1], max_features)
    for key, model in _probe_models(xtr.shape[0], xtr.shape[1], dims, seed).items():
        try:
            model.fit(xtr, ytr)
            out[key] = float((model.predict(xte) == yte).mean())
        except (ValueError, np.linalg.LinAlgError) as err:  # too few samples per class, one class only, ...
            skipped[key] = (
                f"{type(err).__name__}: {'. '.join(str(err).split('. ')[:2])}"  # sklearn's why, not its advice
            )
    return out


def probe_dimensions(y_train: Tensor, dim: int, max_features: int | None) -> int:
    """How many PCA dimensions the probes see: ``max_features`` if given, else every dimension the
    data has up to (smallest class count of the probe-training rows) - 1."""
    if max_features is not None:
        return max_features
    counts = torch.bincount(y_train.long())
    return max(1, min(dim, int(counts[counts > 0].min()) - 1))


def chance_accuracy(y_train: Tensor, y_held: Tensor) -> float:
    """Expected accuracy of a guess drawn from the training class prior: sum_k p_train(k) p_held(k)."""
    k = int(max(int(y_train.max()), int(y_held.max()))) + 1
    p_train = torch.bincount(y_train.long(), minlength=k).double() / y_train.shape[0]
    p_held = torch.bincount(y_held.long(), minlength=k).double() / y_held.shape[0]
    return float((p_train * p_held).sum())


def _unfittable(y_train: Tensor, y_test: Tensor) -> str | None:
    """Why no probe can be fitted on these labels at all (None when they can be tried)."""
    if y_test.numel() == 0:
        return "no held-out examples to score the probes on"
    if torch.unique(y_train).numel() < 2:
        return f"the probes' training rows hold {torch.unique(y_train).numel()} class(es); a classifier needs two"
    return None


def _warn_skipped(skipped: Mapping[str, str]) -> None:
    if skipped:
        listed = "; ".join(f"{key}: {why}" for key, why in skipped.items())
        warnings.warn(
            f"erasure diagnostics: {len(skipped)} probe result(s) skipped, the run goes on without them ({listed})",
            RuntimeWarning,
            stacklevel=3,
        )


def erasure_report(
    x_before: Tensor,
    x_after: Tensor,
    y: Tensor,
    x_test_before: Tensor | None = None,
    x_test_after: Tensor | None = None,
    y_test: Tensor | None = None,
    probes: bool = True,
    max_samples: int = 5000,
    max_features: int | None = None,
    holdout_fraction: float = 0.3,
    seed: int = 0,
    skipped: dict[str, str] | None = None,
) -> dict[str, float]:
    """Moment gaps and probe accuracies before / after erasure (see the module docstring).

    Without test data the training rows are split (seeded) into probe-train and held-out parts;
    the eraser itself was fitted on all of them, which slightly favours erasure. Probes that
    cannot be fitted are left out; pass a dict as ``skipped`` to receive why (key -> reason).
    """
    skipped = {} if skipped is None else skipped
    if x_before.shape != x_after.shape:
        raise ValueError(f"x_before {tuple(x_before.shape)} and x_after {tuple(x_after.shape)} differ in shape")
    has_test = [t is not None for t in (x_test_before, x_test_after, y_test)]
    if any(has_test) and not all(has_test):
        raise ValueError("pass x_test_before, x_test_after and y_test together (or none of them)")
    k = int(y.max()) + 1 if y_test is None or y_test.numel() == 0 else max(int(y.max()), int(y_test.max())) + 1
    report: dict[str, float] = {}
    for when, data in (("before", x_before), ("after", x_after)):
        for key, value in moment_gaps(data, y, k).items():
            report[f"{key}_{when}"] = value
    if not probes:
        return report
    gen = torch.Generator().manual_seed(seed)
    if y_test is None:
        order = torch.randperm(y.shape[0], generator=gen)
        n_test = max(1, int(round(holdout_fraction * y.shape[0])))
        test_idx, train_idx = order[:n_test], order[n_test:]
        splits = {"before": (x_before[train_idx], x_before[test_idx]), "after": (x_after[train_idx], x_after[test_idx])}
        y_train, y_held = y[train_idx], y[test_idx]
    else:
        splits = {"before": (x_before, x_test_before), "after": (x_after, x_test_after)}
        y_train, y_held = y, y_test
    keep = torch.randperm(y_train.shape[0], generator=gen)[:max_samples]
    reason = _unfittable(y_train[keep], y_held)
    if reason is not None:
        skipped.update({f"{key}_{when}": reason for when in splits for key in ("linear_probe_acc", "qda_acc")})
        _warn_skipped(skipped)
        return report
    for when, (train, test) in splits.items():
        missed: dict[str, str] = {}
        for key, value in _probe_accuracies(
            train[keep], y_train[keep], test, y_held, max_features, seed, missed
        ).items():
            report[f"{key}_{when}"] = value
        skipped.update({f"{key}_{when}": why for key, why in missed.items()})
    report["chance"] = chance_accuracy(y_train[keep], y_held)
    _warn_skipped(skipped)
    return report


def erasure_shortfall(
    before: Mapping[str, float],
    after: Mapping[str, float],
    keys: tuple[str, ...],
    max_ratio: float = 0.9,
    floor: float = 1e-6,
) -> list[str]:
    """The targeted gaps that shrank by less than 10% (``after > max_ratio * before``), as
    "key before -> after" strings: an eraser that leaves them so did not erase. Gaps already at
    or below ``floor`` before erasure count as erased (there was nothing to remove)."""
    return [
        f"{key} {before[key]:.4g} -> {after[key]:.4g}"
        for key in keys
        if key in before and key in after and before[key] > floor and after[key] > max_ratio * before[key]
    ]


def probe_shortfall(report: Mapping[str, float], keys: list[str] | tuple[str, ...], points: float) -> list[str]:
    """The probes in ``keys`` whose held-out accuracy after erasure (``<key>_after``) is more than
    ``points`` above ``report["chance"]``, as "key acc" strings (below chance counts as erased)."""
    chance = report["chance"]
    return [
        f"{key} {report[f'{key}_after']:.3f}"
        for key in keys
        if f"{key}_after" in report and report[f"{key}_after"] > chance + points
    ]
