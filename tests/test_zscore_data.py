"""data.zscore: every split standardised per (pixel, channel) with the training split's statistics
before the eraser is fitted (paper Figure 16's condition; where the original code did it)."""

from __future__ import annotations

import torch

from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions


def datamodule(zscore: bool, eraser: str = "none") -> ErasedDataModule:
    data = dict(source="digits", zscore=zscore, device="cpu", cache_dir=None, diagnostics=False)
    dm = ErasedDataModule(DataOptions.from_config(data, {"name": eraser, "options": {}}))
    dm.setup()
    return dm


def test_training_split_has_zero_mean_and_unit_variance_and_constant_pixels_stay_finite() -> None:
    raw, z = datamodule(False), datamodule(True)
    x = z.train_set.x.double().flatten(1)
    varying = raw.train_set.x.flatten(1).std(0) > 0
    assert bool((~varying).any())  # digits has constant pixels: they map to 0, not NaN
    assert torch.isfinite(z.train_set.x).all() and torch.isfinite(z.val_set.x).all()
    assert torch.allclose(x.mean(0), torch.zeros_like(x.mean(0)), atol=1e-5)
    assert torch.allclose(
        x.std(0)[varying], torch.ones(int(varying.sum()), dtype=torch.float64), atol=1e-3
    )  # std + eps
    assert bool((x[:, ~varying] == 0).all())
    # val and test use the training split's statistics (not their own)
    mean, std = (
        raw.train_set.x.double().flatten(1).mean(0),
        raw.train_set.x.double().flatten(1).std(0) + torch.finfo(torch.float32).eps,
    )
    expected = ((raw.val_set.x.double().flatten(1) - mean) / std).float()
    assert torch.allclose(z.val_set.x.flatten(1), expected, atol=1e-6)
    assert z.diagnostics["zscore"]["statistics"] == "training split"


def test_the_eraser_is_fitted_on_the_z_scored_data_and_the_cache_keys_differ() -> None:
    z = datamodule(True, eraser="leace")
    # LEACE fitted on z-scored data leaves z-scored class means equal: erased data has the same mean per class
    x, y = z.train_set.x.double().flatten(1), z.train_set.y
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    assert torch.allclose(means, means.mean(0, keepdim=True).expand_as(means), atol=1e-4)
    plain = DataOptions.from_config(dict(source="digits", device="cpu"), {"name": "leace"})
    scored = DataOptions.from_config(dict(source="digits", device="cpu", zscore=True), {"name": "leace"})
    assert plain.eraser_key() != scored.eraser_key() and plain.data_key() != scored.data_key()


def test_zscore_must_be_a_boolean() -> None:
    import pytest

    with pytest.raises(ValueError, match="data.zscore='yes'"):
        DataOptions.from_config(dict(source="digits", device="cpu", zscore="yes"), {"name": "none"})
