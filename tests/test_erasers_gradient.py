"""Gradient erasure: loss decreases, values stay in range, gaps reported truthfully, no new data."""

import pytest
import torch

from conftest import pixel_classes as shared_pixel_classes
from erasure import fit_eraser, moment_gaps
from erasure.gradient import MomentLoss


def pixel_classes(n_per_class: int = 60, d: int = 6, **kw):
    return shared_pixel_classes(n_per_class=n_per_class, d=d, spread=0.08, **kw)


@pytest.fixture(scope="module")
def fitted():
    x, y = pixel_classes()
    return x, y, fit_eraser("gradient", x, y, steps=15, distance_weight=0.01, cov_weight=100.0, device="cpu")


def test_loss_decreases(fitted):
    _, _, eraser = fitted
    losses = eraser.loss_history
    assert len(losses) == eraser.steps + 1
    assert all(b <= a * (1 + 1e-12) for a, b in zip(losses, losses[1:]))  # L-BFGS + strong Wolfe
    assert losses[-1] < 0.5 * losses[0]


def test_values_stay_in_range(fitted):
    x, _, eraser = fitted
    out = eraser(x)
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    assert out.dtype == x.dtype and out.shape == x.shape


def test_final_moment_gaps_are_reported_truthfully_and_below_the_initial_ones(fitted):
    x, y, eraser = fitted
    measured = moment_gaps(eraser(x), y, 3)
    for key in ("max_mean_gap", "max_cov_gap"):
        assert abs(measured[key] - eraser.final_gaps[key]) <= 1e-9 * eraser.initial_gaps[key]
        assert eraser.final_gaps[key] < 0.5 * eraser.initial_gaps[key]
    assert eraser.initial_gaps == moment_gaps(x, y, 3)


def test_analytic_gradient_matches_autograd():
    x, y = pixel_classes(n_per_class=9, d=4)
    rows = [torch.nonzero(y == c).squeeze(1) for c in range(3)]
    loss_fn = MomentLoss(x, rows, lo=0.0, span=1.0, mean_weight=0.7, cov_weight=3.0, distance_weight=0.2, chunk_size=4)
    z = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss, grad, _ = loss_fn(z)

    zz = z.clone().requires_grad_(True)
    xp = torch.sigmoid(zz)
    n = x.shape[0]
    w = torch.tensor([len(r) / n for r in rows], dtype=torch.float64)
    means = torch.stack([xp[r].mean(0) for r in rows])
    mean = w @ means
    covs = torch.stack([(xp[r] - means[c]).T @ (xp[r] - means[c]) / len(r) for c, r in enumerate(rows)])
    total = (xp - mean).T @ (xp - mean) / n
    reference = (
        0.7 * (w * ((means - mean) ** 2).sum(1)).sum()
        + 3.0 * (w * ((covs - total) ** 2).sum((1, 2))).sum()
        + 0.2 * ((xp - x) ** 2).sum() / n
    )
    reference.backward()
    ref = float(reference.detach())
    assert abs(loss - ref) < 1e-12 * ref
    assert torch.allclose(grad, zz.grad, rtol=1e-9, atol=1e-14)


def test_cannot_transform_new_data(fitted):
    x, y, eraser = fitted
    assert eraser.can_transform_new_data is False
    with pytest.raises(ValueError, match="cannot transform new data"):
        eraser(x[:10])
    other = x.clone()
    other[0, 0] += 1e-6
    with pytest.raises(ValueError, match="cannot transform new data"):
        eraser(other)


def test_data_outside_the_value_range_is_rejected():
    x, y = pixel_classes()
    with pytest.raises(ValueError, match="value_range"):
        fit_eraser("gradient", x * 2, y, steps=1)
    eraser = fit_eraser("gradient", x * 2, y, steps=1, value_range=None, device="cpu")
    assert eraser.value_range == [float((x * 2).min()), float((x * 2).max())]
