"""QLEACE: transport maps, known barycenters, exact moment equality and optimality (float64)."""

import numpy as np
import pytest
import scipy.linalg
import torch

from erasure import class_moments, fit_eraser
from erasure.qleace import wasserstein_barycenter


def gaussian_classes(n_per_class=300, d=6, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        mix = torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.eye(d, dtype=torch.float64)
        xs.append(torch.randn(n_per_class + 50 * c, d, generator=gen, dtype=torch.float64) @ mix.T + c)
        ys.append(torch.full((n_per_class + 50 * c,), c))
    return torch.cat(xs), torch.cat(ys)


def transport_map(source, target):
    """The optimal transport map (symmetric) from N(0, source) onto N(0, target): S^-1/2 (S^1/2 T S^1/2)^1/2 S^-1/2."""
    root = scipy.linalg.sqrtm(source.numpy()).real
    inv = np.linalg.inv(root)
    return torch.from_numpy(inv @ scipy.linalg.sqrtm(root @ target.numpy() @ root).real @ inv)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def random_spd(d, gen):
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    return a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)


def test_maps_push_each_class_covariance_onto_the_barycenter():
    x, y = gaussian_classes()
    eraser = fit_eraser("qleace", x, y)
    covs = class_moments(x, y, 3).covariances()
    for c in range(3):
        t = eraser.maps[c]
        assert rel(t @ covs[c] @ t, eraser.barycenter) < 1e-9
        assert torch.equal(t, t.T)
        assert float(torch.linalg.eigvalsh(t).min()) > 0


def test_records_iterations_and_residual():
    x, y = gaussian_classes()
    eraser = fit_eraser("qleace", x, y, tol=1e-11)
    assert 1 <= eraser.iterations < eraser.max_iter
    assert eraser.residual <= 1e-11
    loose = fit_eraser("qleace", x, y, tol=1e-3)
    assert loose.iterations < eraser.iterations and loose.residual <= 1e-3


def test_commuting_covariances_give_the_squared_mean_of_square_roots():
    gen = torch.Generator().manual_seed(0)
    d, k = 5, 4
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    spectra = torch.rand(k, d, generator=gen, dtype=torch.float64) * 3 + 0.1
    covs = torch.stack([(basis * s) @ basis.T for s in spectra])
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    expected = (basis * (w @ spectra.sqrt()) ** 2) @ basis.T
    assert rel(wasserstein_barycenter(covs, w, tol=1e-14).covariance, expected) < 1e-10


def test_one_dimension_gives_the_weighted_mean_of_standard_deviations():
    x, y = gaussian_classes(d=1, k=4)
    moments = class_moments(x, y, 4)
    sigmas = moments.covariances()[:, 0, 0].sqrt()
    eraser = fit_eraser("qleace", x, y)
    assert abs(float(eraser.barycenter[0, 0]) - float(moments.weights @ sigmas) ** 2) < 1e-12 * float(sigmas.max()) ** 2


def test_identical_classes_give_identity_maps():
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(100, 4, generator=gen, dtype=torch.float64)
    x = torch.cat([block, block, block])
    y = torch.arange(3).repeat_interleave(100)
    eraser = fit_eraser("qleace", x, y)
    eye = torch.eye(4, dtype=torch.float64)
    assert all(rel(eraser.maps[c], eye) < 1e-10 for c in range(3))
    assert torch.allclose(eraser(x, y), x, atol=1e-10)


def test_after_erasure_class_means_and_covariances_are_equal():
    x, y = gaussian_classes()
    out = fit_eraser("qleace", x, y)(x, y)
    before, after = class_moments(x, y, 3), class_moments(out, y, 3)
    assert rel(before.covariances()[0], before.covariances()[1]) > 0.1  # there was something to erase
    covs, means = after.covariances(), after.means
    for c in range(1, 3):
        assert rel(covs[c], covs[0]) < 1e-9
        assert float((means[c] - means[0]).norm()) < 1e-10 * float(x.abs().max())
    # the common mean is the class-frequency weighted mean
    assert torch.allclose(means[0], before.mean, atol=1e-12)


def w2_squared(mean_a, cov_a, mean_b, cov_b):
    root = scipy.linalg.sqrtm(cov_a.numpy())
    cross = np.real(scipy.linalg.sqrtm(root @ cov_b.numpy() @ root))
    return float((mean_a - mean_b).norm() ** 2 + torch.trace(cov_a) + torch.trace(cov_b)) - 2 * np.trace(cross)


def test_mean_squared_edit_is_the_barycenter_cost_and_beats_a_perturbed_target():
    x, y = gaussian_classes()
    eraser = fit_eraser("qleace", x, y, tol=1e-11)
    moments = class_moments(x, y, 3)
    covs, w = moments.covariances(), moments.weights
    cost = ((eraser(x, y) - x) ** 2).sum(1).mean()
    expected = sum(
        float(w[c]) * w2_squared(moments.means[c], covs[c], moments.mean, eraser.barycenter) for c in range(3)
    )
    assert abs(float(cost) - expected) < 1e-9 * expected
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        noise = torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.05
        target = eraser.barycenter + noise @ noise.T + 0.01 * (noise + noise.T)
        maps = [transport_map(covs[c], target) for c in range(3)]
        moved = torch.cat([(x[y == c] - moments.means[c]) @ maps[c] + moments.mean for c in range(3)])
        original = torch.cat([x[y == c] for c in range(3)])
        assert ((moved - original) ** 2).sum(1).mean() > cost


def test_needs_labels_at_transform_time():
    x, y = gaussian_classes()
    eraser = fit_eraser("qleace", x, y)
    assert eraser.requires_labels
    with pytest.raises(ValueError, match="needs labels"):
        eraser(x)


def test_singular_classes_are_deterministic_warned_and_finite():
    x, y = gaussian_classes(d=8, k=3)
    x[:, 2] = 0.25  # a constant pixel
    small = torch.nonzero(y == 1).squeeze(1)[5:]
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[small] = False  # class 1 keeps 5 samples < 8 features
    x, y = x[keep], y[keep]
    with pytest.warns(RuntimeWarning) as record:
        first = fit_eraser("qleace", x, y)
    text = " ".join(str(w.message) for w in record)
    assert "span 7 of 8" in text and "class 1: rank 4" in text
    second = fit_eraser("qleace", x, y)
    out = first(x, y)
    assert torch.isfinite(out).all() and torch.isfinite(first.maps).all()
    assert torch.equal(out, second(x, y))
    assert torch.allclose(out[:, 2], torch.full_like(out[:, 2], 0.25), atol=1e-12)
    # the full-rank classes still match the barycenter exactly
    covs = class_moments(out, y, 3).covariances()
    assert rel(covs[2], covs[0]) < 1e-9


def test_shrinkage_gives_full_rank_maps_for_small_classes():
    x, y = gaussian_classes(n_per_class=5, d=8, k=2)
    eraser = fit_eraser("qleace", x, y, shrinkage=0.1)
    assert all(int((torch.linalg.eigvalsh(t) > 1e-12).sum()) == 8 for t in eraser.maps)


@pytest.mark.parametrize("name", ["qleace", "alf_qleace"])
def test_class_by_class_products_give_the_bits_of_the_batched_ones(name, monkeypatch):
    """The class covariances' products run one class at a time (a SIGTERM is honoured between classes; batched, one
    call at CIFAR-10's size took minutes on a busy CPU): every map is the same to the bit as the batched products'."""
    import erasure.alf_qleace
    import erasure.qleace

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 40, generator=gen, dtype=torch.float64) @ torch.randn(
        40, 40, generator=gen, dtype=torch.float64
    )
    y = torch.arange(600) % 5
    one_by_one = fit_eraser(name, x, y)
    batched = lambda product, *stacks: product(*stacks)  # noqa: E731 - the products as they were: one call for all classes
    monkeypatch.setattr(erasure.qleace, "per_class", batched)
    monkeypatch.setattr(erasure.alf_qleace, "per_class", batched)
    at_once = fit_eraser(name, x, y)
    assert torch.equal(
        one_by_one(x, y) if one_by_one.requires_labels else one_by_one(x),
        at_once(x, y) if at_once.requires_labels else at_once(x),
    )
    for field in ("maps", "directions"):
        if hasattr(at_once, field):
            assert torch.equal(getattr(one_by_one, field), getattr(at_once, field)), field
