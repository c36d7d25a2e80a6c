"""Contract tests over every registered eraser: save/load, bad input, singular data, options."""

import json

import pytest
import torch

from erasure import available_erasers, erasure_report, fit_eraser, load_eraser, linalg
from conftest import RecordOps, host_reads, pixel_classes
from erasure.preprocess import Standardizer, shrink_covariances

FAST_OPTIONS = {"gradient": {"steps": 3, "device": "cpu"}}


def apply(eraser, x, y):
    return eraser(x, y) if eraser.requires_labels else eraser(x)


def test_registry_has_every_eraser():
    assert set(available_erasers()) >= {"none", "leace", "qleace", "alf_qleace", "gradient", "random"}


ONE_ERASER = """
import sys, torch
from erasure import available_erasers, fit_eraser, load_eraser
gen = torch.Generator().manual_seed(0)
x, y = torch.rand(60, 4, generator=gen), torch.arange(60) % 3
fit_eraser("leace", x, y)
after_leace = sorted(m for m in sys.modules if m.startswith("erasure."))
fit_eraser("qleace", x, y).save(sys.argv[1])
print(len(available_erasers()), "erasure.qleace" in after_leace, "erasure.gradient" in sys.modules)
"""


@pytest.mark.slow
def test_a_run_imports_only_its_own_erasers_code_and_every_name_is_listed(tmp_path):
    """erasure.base.SHIPPED: an eraser's module is imported when its name is first used, so a LEACE run does not
    import QLEACE's or the gradient eraser's code; every shipped name is listed (and checked) before that."""
    from conftest import run_python

    path = tmp_path / "q.safetensors"
    proc = run_python(ONE_ERASER, str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["6", "False", "False"], proc.stdout
    assert type(load_eraser(path)).name == "qleace"


@pytest.mark.parametrize("name", available_erasers())
@pytest.mark.parametrize("zscore", [False, True])
def test_save_load_round_trip_is_bit_identical(name, zscore, tmp_path):
    x, y = pixel_classes()
    x = x.reshape(-1, 1, 2, 3)  # image-shaped input is flattened inside and restored
    options = dict(FAST_OPTIONS.get(name, {}))
    if zscore and name == "gradient":
        options["value_range"] = None  # z-scored data leaves [0, 1]: use the data's own range
    eraser = fit_eraser(name, x, y, zscore=zscore, **options)
    path = eraser.save(tmp_path / f"{name}.safetensors")
    loaded = load_eraser(path)
    assert type(loaded) is type(eraser)
    assert json.dumps(loaded.metadata(), sort_keys=True) == json.dumps(eraser.metadata(), sort_keys=True)
    before, after = apply(eraser, x, y), apply(loaded, x, y)
    assert before.shape == x.shape and before.dtype == x.dtype
    assert torch.equal(before, after)
    assert (loaded.input_shift is not None) == zscore


@pytest.mark.parametrize("name", available_erasers())
def test_singular_data_never_gives_nan(name):
    # a constant pixel, and a class with fewer samples than features
    x, y = pixel_classes(d=8)
    x[:, 5] = 0.0
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[torch.nonzero(y == 2).squeeze(1)[4:]] = False
    x, y = x[keep], y[keep]
    linalg._warned.clear()  # warnings are once per process and message; the same data ran before
    with pytest.warns() if name in ("leace", "qleace", "alf_qleace") else _no_check():
        eraser = fit_eraser(name, x, y, **FAST_OPTIONS.get(name, {}))
    out = apply(eraser, x, y)
    assert torch.isfinite(out).all()


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", available_erasers())
def test_bad_input_is_rejected_with_a_clear_message(name):
    x, y = pixel_classes()
    options = FAST_OPTIONS.get(name, {})
    with pytest.raises(ValueError, match="NaN"):
        bad = x.clone()
        bad[0, 0] = float("nan")
        fit_eraser(name, bad, y, **options)
    with pytest.raises(TypeError, match="integer class indices"):
        fit_eraser(name, x, y.double(), **options)
    with pytest.raises(ValueError, match="labels must lie"):
        fit_eraser(name, x, y - 1, **options)
    with pytest.raises(TypeError, match="float tensor"):
        fit_eraser(name, (x * 100).long(), y, **options)
    with pytest.raises(ValueError, match="unknown"):
        fit_eraser(name, x, y, not_an_option=1, **options)
    eraser = fit_eraser(name, x, y, **options)
    if eraser.can_transform_new_data:
        with pytest.raises(ValueError, match="fitted on 6 features"):
            apply(eraser, x[:, :5], y)


NEW_DATA_ERASERS = [n for n in available_erasers() if n != "gradient"]  # gradient edits only its fitting data


def _batch(k: int = 3):
    """A fitted eraser's training data and a batch drawn from it (float32, as training batches are)."""
    x, y = pixel_classes(k=k)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))[:32]
    return x, y, x[perm].float(), y[perm]


@pytest.mark.parametrize("name", NEW_DATA_ERASERS)
@pytest.mark.parametrize("zscore", [False, True])
def test_erasing_checked_batches_gives_the_checked_numbers_without_reading_them(name, zscore):
    """Training batches (augment_then_erase) skip the value checks; on a GPU each was a host stall.
    QLEACE reads one thing: the batch's class counts, which size its per-class products."""
    x, y, xb, yb = _batch()
    eraser = fit_eraser(name, x, y, zscore=zscore)
    labels = yb if eraser.requires_labels else None
    with RecordOps() as record:
        out = eraser.erase_checked(xb, labels)
    assert torch.equal(out, apply(eraser, xb, yb))
    assert host_reads(record) == (["Tensor.tolist"] if name == "qleace" else []), host_reads(record)


@pytest.mark.parametrize("name", NEW_DATA_ERASERS)
def test_an_eraser_moved_to_the_datas_device_erases_there(name, monkeypatch):
    """``meta`` stands in for a GPU: like CUDA it refuses to mix with CPU tensors, so a tensor the
    map leaves on (or makes on) the CPU fails here. It holds no values, so QLEACE's class counts are
    taken from the CPU batch (the one read it makes, see the test above)."""

    x, y, xb, yb = _batch()
    meta = torch.device("meta")
    eraser = fit_eraser(name, x, y, zscore=True).to(meta)
    if name == "qleace":
        counts, real_tolist = torch.bincount(yb, minlength=3), torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: counts.tolist() if t.is_meta else real_tolist(t))
    out = eraser.erase_checked(xb.to(meta), yb.to(meta) if eraser.requires_labels else None)
    assert out.device == meta and out.shape == xb.shape and out.dtype == xb.dtype


@pytest.mark.parametrize("name", NEW_DATA_ERASERS)
def test_erasing_checked_batches_still_checks_shapes(name):
    x, y, xb, yb = _batch()
    eraser = fit_eraser(name, x, y)
    with pytest.raises(ValueError, match="fitted on 6 features"):
        eraser.erase_checked(xb[:, :5], yb)
    with pytest.raises(TypeError, match="float tensor"):
        eraser.erase_checked((xb * 100).long(), yb)
    if eraser.requires_labels:
        with pytest.raises(ValueError, match="needs labels"):
            eraser.erase_checked(xb)
        with pytest.raises(ValueError, match=r"y must have shape \(32,\)"):
            eraser.erase_checked(xb, yb[:5])


def _qleace_by_masks(eraser, x, y):
    """QLEACE's map as first written: each class's rows selected by a boolean mask."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for c in torch.unique(y).tolist():
        rows = y == c
        out[rows] = (x[rows].double() - eraser.class_means[c]) @ eraser.maps[c] + eraser.mean
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_qleace_grouped_by_class_gives_the_numbers_of_selecting_each_class_by_mask(dtype):
    """The sort-grouped form, bit for bit, for batches in any order, missing classes, of one class,
    or of one example, and for any integer label type."""
    x, y = pixel_classes(k=4, d=24, n_per_class=50)
    eraser = fit_eraser("qleace", x, y)
    batches = [
        torch.arange(len(y)).flip(0),
        torch.tensor([5]),
        torch.nonzero(y != 1).squeeze(1),
        torch.nonzero(y == 2).squeeze(1),
        torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:77],
    ]
    for rows in batches:
        xb, yb = x[rows].float(), y[rows]
        assert torch.equal(eraser.erase_checked(xb, yb.to(dtype)), _qleace_by_masks(eraser, xb, yb).float())


def test_unknown_eraser_name_lists_the_choices():
    x, y = pixel_classes()
    with pytest.raises(ValueError, match="choose one of"):
        fit_eraser("qleace2", x, y)


def test_zscore_standardises_and_keeps_constant_features_finite():
    x, y = pixel_classes()
    x[:, 2] = 0.7
    out = fit_eraser("none", x, y, zscore=True)(x)
    assert torch.allclose(out.mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-12)
    std = out.std(0, unbiased=False)
    assert torch.allclose(std[[0, 1, 3, 4, 5]], torch.ones(5, dtype=torch.float64), atol=1e-12)
    assert float(out[:, 2].abs().max()) == 0.0
    with pytest.raises(TypeError, match="zscore"):
        fit_eraser("none", x, y, zscore="yes")


def test_standardizer_streaming_matches_one_shot():
    x, y = pixel_classes()
    a, b = Standardizer.fit(x, batch_size=7), Standardizer.fit(x)
    assert torch.allclose(a.shift, b.shift, atol=1e-14) and torch.allclose(a.scale, b.scale, atol=1e-14)


def test_shrinkage_keeps_trace_and_moves_towards_identity():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64)
    covs = a @ a.transpose(1, 2)
    shrunk = shrink_covariances(covs, 0.3)
    trace = lambda m: torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
    assert torch.allclose(trace(shrunk), trace(covs))
    assert torch.allclose(shrink_covariances(covs, 1.0)[0], trace(covs)[0] / 5 * torch.eye(5, dtype=torch.float64))
    assert torch.equal(shrink_covariances(covs, 0.0), covs)


def test_erasure_report_shows_what_leace_removes():
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(3).repeat(150)
    centres = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    x = centres[y] + 0.3 * torch.randn(450, 6, generator=gen, dtype=torch.float64)
    out = fit_eraser("leace", x, y)(x)
    report = erasure_report(x, out, y, max_features=4)
    assert report["max_mean_gap_after"] < 1e-10 < report["max_mean_gap_before"]
    assert report["linear_probe_acc_before"] > 0.8 and report["linear_probe_acc_after"] < 0.6
    assert set(report) >= {"qda_acc_before", "qda_acc_after", "max_cov_gap_before", "max_cov_gap_after", "chance"}
    with pytest.raises(ValueError, match="together"):
        erasure_report(x, out, y, x_test_before=x)
