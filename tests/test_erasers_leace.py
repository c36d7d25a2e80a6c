"""LEACE: the properties of the least-squares linear eraser, on float64 Gaussian class data."""

import pytest
import torch

from erasure import class_moments, fit_eraser


def gaussian_classes(n_per_class: int = 200, d: int = 12, k: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        mix = torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.eye(d, dtype=torch.float64)
        mean = torch.randn(d, generator=gen, dtype=torch.float64)
        xs.append(torch.randn(n_per_class + 10 * c, d, generator=gen, dtype=torch.float64) @ mix.T + mean)
        ys.append(torch.full((n_per_class + 10 * c,), c))
    return torch.cat(xs), torch.cat(ys)


def one_hot_cross_covariance(x, y, k):
    z = torch.nn.functional.one_hot(y, k).double()
    return (x - x.mean(0)).T @ (z - z.mean(0)) / x.shape[0]


def test_cross_covariance_zero_and_class_means_equal():
    x, y = gaussian_classes()
    out = fit_eraser("leace", x, y)(x)
    scale = x.std()
    assert one_hot_cross_covariance(out, y, 4).abs().max() < 1e-10 * scale
    # before erasure the same statistic is far from zero, so the check can fail
    assert one_hot_cross_covariance(x, y, 4).abs().max() > 1e-2 * scale
    means = class_moments(out, y, 4).means
    assert (means - means.mean(0)).abs().max() < 1e-10 * scale


def test_idempotent():
    x, y = gaussian_classes()
    eraser = fit_eraser("leace", x, y)
    once = eraser(x)
    assert torch.allclose(eraser(once), once, rtol=0, atol=1e-10 * x.abs().max())


def test_edit_has_rank_at_most_k_minus_1():
    k = 5
    x, y = gaussian_classes(k=k, d=16)
    eraser = fit_eraser("leace", x, y)
    edit = x - eraser(x)
    s = torch.linalg.svdvals(edit)
    assert int((s > s[0] * 1e-10).sum()) == k - 1 == eraser.rank


def test_mean_squared_edit_is_minimal_among_projections_that_zero_the_cross_covariance():
    k, d = 4, 10
    x, y = gaussian_classes(k=k, d=d)
    centred = x - x.mean(0)
    leace_cost = ((x - fit_eraser("leace", x, y)(x)) ** 2).sum(1).mean()
    sigma_xz = one_hot_cross_covariance(x, y, k)
    span, _, _ = torch.linalg.svd(sigma_xz, full_matrices=False)
    span = span[:, : k - 1]
    gen = torch.Generator().manual_seed(1)
    for extra in range(0, 4):
        for _ in range(10):
            a = torch.cat([span, torch.randn(d, extra, generator=gen, dtype=torch.float64)], 1)
            b = torch.randn(d, a.shape[1], generator=gen, dtype=torch.float64)
            proj = a @ torch.linalg.solve(b.T @ a, b.T)  # oblique projection with range(proj) >= span
            alternative = x - centred @ proj.T
            assert one_hot_cross_covariance(alternative, y, k).abs().max() < 1e-8  # a valid competitor
            assert ((x - alternative) ** 2).sum(1).mean() >= leace_cost * (1 - 1e-12)
    orthogonal = x - centred @ (span @ span.T)
    assert ((x - orthogonal) ** 2).sum(1).mean() > leace_cost  # the naive projection costs more


def test_streaming_fit_equals_one_shot():
    x, y = gaussian_classes()
    one_shot = fit_eraser("leace", x, y, batch_size=10**6)
    streamed = fit_eraser("leace", x, y, batch_size=7)
    assert torch.allclose(one_shot.proj, streamed.proj, rtol=0, atol=1e-10 * one_shot.proj.abs().max())
    assert torch.allclose(one_shot.mean, streamed.mean, rtol=1e-12, atol=0)


def test_constant_pixels_are_left_alone_and_never_nan():
    x, y = gaussian_classes(d=8)
    x[:, 3] = 0.5
    with pytest.warns(RuntimeWarning, match="rank 7 of 8"):
        out = fit_eraser("leace", x, y)(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, 3], x[:, 3], rtol=0, atol=1e-12)


def test_already_equal_class_means_give_an_identity_edit():
    x, y = gaussian_classes()
    for c in range(4):
        x[y == c] -= x[y == c].mean(0)  # exactly equal means up to rounding: nothing to erase
    eraser = fit_eraser("leace", x, y)
    assert eraser.rank == 0
    assert torch.allclose(eraser(x), x, rtol=0, atol=1e-12)


def test_shrinkage_option_changes_the_map_and_rejects_bad_values():
    x, y = gaussian_classes()
    exact = fit_eraser("leace", x, y)
    shrunk = fit_eraser("leace", x, y, shrinkage=0.5)
    assert not torch.allclose(exact.proj, shrunk.proj)
    assert shrunk.shrinkage == 0.5
    with pytest.raises(ValueError, match="shrinkage"):
        fit_eraser("leace", x, y, shrinkage=1.5)
