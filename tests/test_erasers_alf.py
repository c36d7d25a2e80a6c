"""ALF-QLEACE: orthonormal directions, monotone deviation, equal means, size invariance, label-free."""

import pytest
import torch

from erasure import class_moments, fit_eraser
from erasure.alf_qleace import dominant_eigpair


def gaussian_classes(n_per_class=250, d=10, k=3, seed=0, equal_means=False):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        scales = torch.rand(d, generator=gen, dtype=torch.float64) * 2 + 0.2
        mix = torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.diag(scales)
        xc = torch.randn(n_per_class + 20 * c, d, generator=gen, dtype=torch.float64) @ mix.T
        xc = xc - xc.mean(0) if equal_means else xc + torch.randn(d, generator=gen, dtype=torch.float64)
        xs.append(xc)
        ys.append(torch.full((xc.shape[0],), c))
    return torch.cat(xs), torch.cat(ys)


def max_deviation(x, y, k, norm="fro"):
    covs = class_moments(x, y, k).covariances()
    deltas = covs - covs.mean(0)
    return float(torch.linalg.matrix_norm(deltas, ord="fro" if norm == "fro" else 2).max())


def test_directions_are_orthonormal():
    x, y = gaussian_classes()
    eraser = fit_eraser("alf_qleace", x, y, target_fraction=0.0, max_rank=6)
    u = eraser.directions
    assert u.shape == (10, 6)
    assert torch.allclose(u.T @ u, torch.eye(6, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("norm", ["fro", "spectral"])
def test_max_class_deviation_never_increases_with_rank(norm):
    x, y = gaussian_classes()
    measured = []
    for rank in range(6):
        eraser = fit_eraser("alf_qleace", x, y, target_fraction=0.0, max_rank=rank, deviation_norm=norm)
        measured.append(max_deviation(eraser(x), y, 3, norm))
        assert abs(eraser.deviations[-1] - measured[-1]) < 1e-9 * measured[0]  # recorded = measured
    assert all(b <= a * (1 + 1e-12) for a, b in zip(measured, measured[1:]))
    assert measured[-1] < 0.9 * measured[0]  # and it does decrease


def test_stops_at_the_target_fraction():
    x, y = gaussian_classes()
    eraser = fit_eraser("alf_qleace", x, y, target_fraction=0.5, max_rank=10)
    dev = eraser.deviations
    assert dev[-1] <= 0.5 * dev[0] < min(dev[:-1])
    assert eraser.rank == len(dev) - 1 < 10
    assert eraser.edit_rank == eraser.rank + eraser.leace_rank


def test_class_means_stay_equal():
    x, y = gaussian_classes()
    out = fit_eraser("alf_qleace", x, y)(x)
    means = class_moments(out, y, 3).means
    assert float((means - means.mean(0)).abs().max()) < 1e-10 * float(x.abs().max())


def test_duplicating_a_class_leaves_the_directions_unchanged():
    # Equal class means make LEACE the identity, whose fit does depend on class sizes; the ALF
    # directions then depend only on the per-class (count-normalised) covariances.
    x, y = gaussian_classes(equal_means=True)
    base = fit_eraser("alf_qleace", x, y, target_fraction=0.0, max_rank=4)
    twice = torch.cat([x, x[y == 1]]), torch.cat([y, y[y == 1]])
    dup = fit_eraser("alf_qleace", *twice, target_fraction=0.0, max_rank=4)
    assert base.leace_rank == dup.leace_rank == 0
    proj_a = base.directions @ base.directions.T
    proj_b = dup.directions @ dup.directions.T
    assert torch.allclose(proj_a, proj_b, atol=1e-8)


def test_no_labels_needed_at_transform_time():
    x, y = gaussian_classes()
    eraser = fit_eraser("alf_qleace", x, y)
    assert not eraser.requires_labels
    assert torch.equal(eraser(x), eraser(x, y))


def test_dominant_eigpair_matches_dense_eigh():
    gen = torch.Generator().manual_seed(0)
    for d in (5, 40, 200):
        a = torch.randn(d, d, generator=gen, dtype=torch.float64)
        sym = a + a.T
        value, vector = dominant_eigpair(sym)
        evals, evecs = torch.linalg.eigh(sym)
        i = int(evals.abs().argmax())
        assert abs(value - float(evals[i])) < 1e-10 * abs(float(evals[i]))
        assert abs(abs(float(vector @ evecs[:, i])) - 1) < 1e-8


def test_constant_pixels_are_never_chosen():
    x, y = gaussian_classes()
    x[:, 4] = 0.0
    eraser = fit_eraser("alf_qleace", x, y, target_fraction=0.0, max_rank=5)
    assert torch.isfinite(eraser(x)).all()
    assert float(eraser.directions[4].abs().max()) < 1e-10
