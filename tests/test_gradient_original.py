"""The gradient eraser's recipe ``original`` (EleutherAI/mdl experiments/iterative_erasure.py@2a41748, issue 35 D3):
its per-class objective at a hand-computed point, the targets, the optimum's direction, the uint8 round trip,
bad input, data.zscore=after_eraser, which lets it see the raw [0, 1] data in table16, and why it barely erases
digits (issue 45: its own optimum, not an early stop)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from conftest import pixel_classes
from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions
from datamodules.sources import load_digits_source
from erasure import fit_eraser
from erasure.gradient_original import original_targets, quantize_uint8
from erasure.gradient_objective import OriginalClassLoss
from erasure.preprocess import optimal_linear_shrinkage


def test_objective_at_a_hand_computed_point() -> None:
    # rows x' = (0.2, 0.6), (0.4, 0.8): mean (0.3, 0.7); unbiased covariance [[0.02, 0.02], [0.02, 0.02]]
    x = torch.tensor([[0.2, 0.6], [0.4, 0.8]], dtype=torch.float64)
    loss = OriginalClassLoss(
        start=torch.tensor([[0.2, 0.6], [0.4, 0.4]], dtype=torch.float64),  # squared steps 0, 0, 0, 0.16: MSE 0.04
        target_mean=torch.tensor([0.3, 0.3], dtype=torch.float64),  # ||(0, 0.4)||_2 = 0.4 (unsquared)
        target_cov=torch.tensor([[0.02, 0.02], [0.02, 0.05]], dtype=torch.float64),  # ||C - S||_F = 0.03 (unsquared)
        mean_weight=0.01,
        cov_weight=0.01,
        distance_weight=1.0,
    )
    terms = {key: float(value) for key, value in loss.terms(torch.logit(x)).items()}
    assert terms == pytest.approx({"mean_term": 0.4, "cov_term": 0.03, "distance_term": 0.04}, rel=1e-12)
    assert float(loss.loss(torch.logit(x))) == pytest.approx(0.01 * 0.4 + 0.01 * 0.03 + 0.04, rel=1e-12)  # 0.0443


def test_targets_are_the_shrunk_global_moments_clamped_elementwise() -> None:
    x, _ = pixel_classes(n_per_class=40, d=5, spread=0.08)
    x = x.float()
    mean, cov, eps = original_targets(x)
    assert eps == torch.finfo(torch.float32).eps and mean.dtype == cov.dtype == torch.float32
    shrunk = optimal_linear_shrinkage(torch.cov(x.double().T), x.shape[0])  # given the unbiased covariance, as :128
    expected = shrunk.float().clamp(eps, 1 - eps).logit().sigmoid()
    assert torch.allclose(cov, expected, rtol=1e-5, atol=1e-7)
    assert bool((shrunk < 0).any()) and float(cov.min()) > 0  # negative covariances become (about) eps
    assert torch.allclose(mean, x.double().mean(0).float().clamp(eps, 1 - eps), atol=1e-6)


def test_uint8_round_trip_truncates_as_the_original_stored_it() -> None:
    x = torch.tensor([0.0, 0.5, 3.99 / 255, 254.9 / 255, 1.0])
    assert torch.equal(quantize_uint8(x) * 255, torch.tensor([0.0, 127.0, 3.0, 254.0, 255.0]))  # floor(255 x)
    assert torch.equal(quantize_uint8(x), torch.tensor([0, 127, 3, 254, 255], dtype=torch.uint8).float() / 255)


@pytest.fixture(scope="module")
def fitted():
    x, y = pixel_classes(n_per_class=60, d=6, spread=0.08)
    x = x.float()
    # larger moment weights than the original's (which barely move 60-row toy classes) to see the direction clearly
    return x, y, fit_eraser("gradient", x, y, recipe="original", mean_weight=1.0, cov_weight=1.0, device="cpu")


def test_the_optimum_moves_class_moments_toward_the_targets_and_is_stored_as_uint8(fitted) -> None:
    x, y, eraser = fitted
    out = eraser(x)
    assert out.dtype == x.dtype and float(out.min()) >= 0 and float(out.max()) <= 1
    assert torch.equal(out * 255, (out * 255).round())  # k / 255: the uint8 images read back
    mean, cov, _ = original_targets(x)
    for c in range(3):
        before, after = x[y == c].double(), out[y == c].double()
        assert (after.mean(0) - mean).norm() < 0.5 * (before.mean(0) - mean).norm()
        assert (torch.cov(after.T) - cov).norm() < (torch.cov(before.T) - cov).norm()
    assert eraser.loss_history[1] < eraser.loss_history[0]
    assert (eraser.recipe, eraser.history_size, eraser.exact_means) == ("original", 100, False)


def test_bad_input_is_refused_with_the_fix() -> None:
    x, y = pixel_classes(n_per_class=10, d=3, spread=0.08)
    with pytest.raises(ValueError, match=r"data.zscore=after_eraser"):
        fit_eraser("gradient", x * 2 - 0.5, y, recipe="original", device="cpu")
    with pytest.raises(ValueError, match=r"value_range must be \[0, 1\] or null"):
        fit_eraser("gradient", x, y, recipe="original", value_range=[0, 255], device="cpu")
    with pytest.raises(ValueError, match="class 2 has 1"):
        keep = torch.cat([torch.nonzero(y != 2).squeeze(1), torch.nonzero(y == 2)[:1, 0]])
        fit_eraser("gradient", x[keep], y[keep], recipe="original", device="cpu")


def test_zscore_after_the_eraser_standardises_the_erased_splits_and_keys_only_the_data() -> None:
    data = dict(source="digits", zscore="after_eraser", device="cpu", cache_dir=None, diagnostics=False)
    after = ErasedDataModule(DataOptions.from_config(data, {"name": "none", "options": {}}))
    after.setup()
    x = after.train_set.x.double().flatten(1)
    assert torch.allclose(x.mean(0), torch.zeros_like(x.mean(0)), atol=1e-5)
    assert after.diagnostics["zscore"]["statistics"] == "erased training split"

    def leace(**data) -> DataOptions:
        return DataOptions.from_config({"source": "digits", "device": "cpu", **data}, {"name": "leace"})

    raw, later, before = leace(), leace(zscore="after_eraser"), leace(zscore=True)
    assert raw.eraser_key() == later.eraser_key() != before.eraser_key()  # the eraser sees the raw data
    assert len({raw.data_key(), later.data_key(), before.data_key()}) == 3
    with pytest.raises(ValueError, match="augment_then_erase"):
        leace(zscore="after_eraser", augment_order="augment_then_erase")


CLASSES = 5  # digits 0-4


def _digits_fit(
    caplog: pytest.LogCaptureFixture, margin: float
) -> tuple[torch.Tensor, torch.Tensor, object, list[int]]:
    """The recipe ``original`` on the embedded digits 0-4 (the 450 of the first 900 scans; 5 classes to keep the test
    fast), squeezed into [margin, 1 - margin] by one map for every pixel; with the L-BFGS iterations of each class's
    call (from the recipe's log)."""
    digits = load_digits_source().train
    keep = digits.y[:900] < CLASSES
    x, y = margin + (1 - 2 * margin) * digits.x[:900][keep].flatten(1), digits.y[:900][keep]
    with caplog.at_level(logging.INFO, logger="erasure.gradient_original"):
        eraser = fit_eraser("gradient", x, y, recipe="original", history_size=100, device="cpu", log_every=1)
    iterations = [int(m) for m in re.findall(r"in (\d+) L-BFGS iterations", caplog.text)]
    caplog.clear()
    return x, y, eraser, iterations


@pytest.mark.slow
def test_on_digits_the_recipe_stops_at_its_own_optimum_which_barely_moves_the_classes(caplog) -> None:
    """Why the original recipe barely erases digits (docs/differences-from-original.md D3): not an early stop.
    L-BFGS stops on torch's tolerance_grad long before ``steps``, at the optimum of its objective: there the
    unsquared mean term's pull (mean_weight) balances the MSE's cost of a shift s of the class, |s|^2 / d, so a
    class mean moves mean_weight * d / 2 = 0.32 toward the target on digits' 64 pixels (15.4 on CIFAR-10's 3072),
    where the gaps are 0.85-1.65; and pixels at exactly 0 (49% of digits) start at logit(eps), where the
    sigmoid's slope is eps: they never move, so the means move less still."""
    x, y, eraser, iterations = _digits_fit(caplog, margin=0.0)
    assert len(iterations) == CLASSES and max(iterations) < eraser.steps  # stopped by its own rule, not by max_iter
    out = eraser(x)
    assert torch.equal(out[x == 0], torch.zeros_like(out[x == 0]))  # saturated pixels stay where they were
    bound = eraser.mean_weight * x.shape[1] / 2  # 0.32
    target = original_targets(x)[0].double()

    def mean_moves(before: torch.Tensor, after: torch.Tensor) -> list[float]:
        return [
            float((before[y == c].double().mean(0) - target).norm() - (after[y == c].double().mean(0) - target).norm())
            for c in range(CLASSES)
        ]

    assert 0 < min(mean_moves(x, out)) and max(mean_moves(x, out)) < 0.7 * bound  # 0.10-0.17: frozen pixels
    x, y, eraser, iterations = _digits_fit(caplog, margin=0.05)  # no pixel at the clamp: the bound is met
    target = original_targets(x)[0].double()
    assert max(iterations) < eraser.steps
    assert mean_moves(x, eraser(x)) == pytest.approx([bound] * CLASSES, abs=0.01)  # 0.318-0.320 (uint8)
