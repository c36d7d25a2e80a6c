"""eraser.options.shrinkage=optimal: concept-erasure's estimator, which its LeaceFitter and
QuadraticFitter apply by default and which the original code's QLEACE fits used (cli.py builds
QuadraticFitter without a shrinkage argument). Checked against concept-erasure itself in float64."""

from __future__ import annotations

import pytest
import torch

from erasure import fit_eraser
from erasure.preprocess import optimal_linear_shrinkage

ce = pytest.importorskip("concept_erasure")


def gaussian_classes(n_per_class: int = 400, d: int = 8, k: int = 3, seed: int = 0):
    """Equal-size classes with distinct means and full-rank, class-specific covariances (concept-erasure's
    QLEACE targets the unweighted mean of the class means; with equal classes it is ours too)."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        mix = torch.randn(d, d, generator=g, dtype=torch.float64) * (0.5 + 0.3 * c)
        xs.append(torch.randn(n_per_class, d, generator=g, dtype=torch.float64) @ mix.T + 2.0 * c)
        ys.append(torch.full((n_per_class,), c))
    return torch.cat(xs), torch.cat(ys)


def test_the_estimator_is_concept_erasures() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 30, 12, generator=g, dtype=torch.float64)
    covs, n = a.mT @ a / 30, torch.tensor([30.0, 31.0, 50.0, 200.0], dtype=torch.float64)
    from concept_erasure.shrinkage import optimal_linear_shrinkage as theirs

    ours = optimal_linear_shrinkage(covs, n)
    assert torch.allclose(ours, theirs(covs, n.view(-1, 1, 1)), rtol=1e-12, atol=1e-14)
    assert torch.equal(
        optimal_linear_shrinkage(torch.zeros(3, 3, dtype=torch.float64), 10), torch.zeros(3, 3, dtype=torch.float64)
    )


def test_leace_with_optimal_shrinkage_erases_as_concept_erasure() -> None:
    x, y = gaussian_classes()
    fitter = ce.LeaceFitter(x.shape[1], 3, dtype=torch.float64, shrinkage=True, constrain_cov_trace=False)
    fitter.update(x, torch.nn.functional.one_hot(y, 3).double())
    theirs = fitter.eraser(x)
    ours = fit_eraser("leace", x, y, num_classes=3, shrinkage="optimal")(x)
    assert torch.allclose(ours.double(), theirs, atol=1e-6, rtol=0)
    exact = fit_eraser("leace", x, y, num_classes=3)(x)
    assert not torch.allclose(exact.double(), theirs, atol=1e-3)  # shrinkage changes the map
    means = torch.stack([ours[y == c].double().mean(0) for c in range(3)])
    assert torch.allclose(means, means.mean(0).expand_as(means), atol=1e-9)  # still linearly erased


def test_qleace_with_optimal_shrinkage_erases_as_concept_erasure() -> None:
    x, y = gaussian_classes()
    fitter = ce.QuadraticFitter(x.shape[1], 3, dtype=torch.float64, shrinkage=True)
    fitter.update(x, y)
    theirs = fitter.eraser(x, y)
    ours = fit_eraser("qleace", x, y, num_classes=3, shrinkage="optimal", tol=1e-12, max_iter=1000)(x, y)
    assert torch.allclose(ours.double(), theirs, atol=1e-6, rtol=0)


def test_shrinkage_values_are_checked_and_recorded(tmp_path) -> None:
    from erasure import load_eraser

    x, y = gaussian_classes(n_per_class=50)
    with pytest.raises(ValueError, match="'optimal'"):
        fit_eraser("qleace", x, y, num_classes=3, shrinkage="best")
    eraser = fit_eraser("qleace", x, y, num_classes=3, shrinkage="optimal")
    eraser.save(tmp_path / "e.safetensors")
    assert load_eraser(tmp_path / "e.safetensors").shrinkage == "optimal"


def test_alf_qleace_without_a_rank_cap_may_use_every_direction(tmp_path) -> None:
    """max_rank=null: up to d rank-1 erasures (paper Sec. 2.3); it stops at the target, not at a cap."""
    from erasure import load_eraser

    x, y = gaussian_classes(d=12)
    capped = fit_eraser("alf_qleace", x, y, num_classes=3, max_rank=2, target_fraction=0.0)
    uncapped = fit_eraser("alf_qleace", x, y, num_classes=3, max_rank=None, target_fraction=0.0)
    assert capped.rank == 2 and uncapped.rank > 2 and uncapped.max_rank is None
    uncapped.save(tmp_path / "a.safetensors")
    assert load_eraser(tmp_path / "a.safetensors").max_rank is None
    with pytest.raises(ValueError, match="max_rank"):
        fit_eraser("alf_qleace", x, y, num_classes=3, max_rank=-1)
