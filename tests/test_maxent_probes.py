"""Max-ent probes (Belrose et al. 2024): class Gaussians matching the erased training split's class
means and covariances, evaluated every epoch of the final fit in both engines, and the report's
figure of probe accuracy against validation accuracy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import FITS, FAST, compose_config
from datamodules.maxent_probes import class_cholesky, sample_class_gaussians
from erasure import class_moments, fit_eraser
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash
from test_resume import EXACT, assert_resumes_exactly, run_killed_after

PROBES = ["probes=maxent"]
CURVES = ("maxent_probe_accuracy_curve", "maxent_probe_loss_curve", "val_accuracy_curve")
# Gaussian classes that an MLP separates in a few epochs (synthetic source: means and covariances differ)
GAUSSIAN = [
    "data=synthetic",
    "data.options.mean_shift=1.0",
    "data.val_size=900",
    "mdl.num_blocks=2",
    "width=32",
    "model.base_width=32",
    "trainer.patience=100",
]


def binomial_tolerance(p: float, n: int, sigmas: float = 4.0) -> float:
    return sigmas * math.sqrt(max(p * (1 - p), 1e-3) / n)


# --- sampling ----------------------------------------------------------------------------------


def gaussian_data(n_per_class: int = 4000, d: int = 5, k: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        mix = torch.randn(d, d, generator=gen, dtype=torch.float64)
        xs.append(torch.randn(n_per_class, d, generator=gen, dtype=torch.float64) @ mix.T + c)
        ys.append(torch.full((n_per_class,), c))
    return torch.cat(xs), torch.cat(ys)


def test_samples_match_each_class_mean_and_covariance_and_keep_the_shape():
    x, y = gaussian_data()
    images = x.reshape(-1, 1, 5, 1).float()
    sx, sy, info = sample_class_gaussians(images, y, 3, [20000, 20000, 20000], seed=0)
    assert sx.shape == (60000, 1, 5, 1) and sx.dtype == torch.float32 and torch.bincount(sy).tolist() == [20000] * 3
    real, probe = class_moments(images, y, 3), class_moments(sx, sy, 3)
    for c in range(3):
        scale = real.covariances()[c].diagonal().sqrt()
        # mean within 5 standard errors per coordinate; covariance within a relative 5%
        assert ((probe.means[c] - real.means[c]).abs() / scale < 5 / math.sqrt(20000)).all()
        rel = torch.linalg.matrix_norm(probe.covariances()[c] - real.covariances()[c]) / torch.linalg.matrix_norm(
            real.covariances()[c]
        )
        assert rel < 0.05, (c, float(rel))
    assert max(info["ridges"]) < 1e-12 * float(real.covariances().diagonal(dim1=1, dim2=2).max())


def test_sampling_is_deterministic_per_seed():
    x, y = gaussian_data(200)
    a = sample_class_gaussians(x, y, 3, [50, 60, 70], seed=3)
    b = sample_class_gaussians(x, y, 3, [50, 60, 70], seed=3)
    c = sample_class_gaussians(x, y, 3, [50, 60, 70], seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    assert torch.bincount(a[1]).tolist() == [50, 60, 70]


def test_singular_covariances_sample_without_nan():
    """Constant pixels (digits has several) and a class with fewer examples than features."""
    x, y = gaussian_data(100, d=6)
    x[:, 2] = 0.25  # a constant pixel
    x, y = torch.cat([x, torch.ones(3, 6, dtype=torch.float64)]), torch.cat([y, torch.full((3,), 3)])  # 3 equal rows
    sx, sy, info = sample_class_gaussians(x, y, 4, [500] * 4, seed=0)
    assert torch.isfinite(sx).all()
    assert (sx[sy < 3, 2] - 0.25).abs().max() < 1e-5  # the ridge is tiny: a constant stays (almost) constant
    assert (sx[sy == 3] - 1).abs().max() < 1e-5  # a zero covariance: samples at the mean
    factor, ridge = class_cholesky(torch.zeros(4, 4, dtype=torch.float64))
    assert torch.isfinite(factor).all() and 0 < ridge < 1e-13


def test_after_qleace_every_class_gaussian_is_the_same():
    x, y = gaussian_data(2000)
    erased = fit_eraser("qleace", x, y)(x, y)
    moments = class_moments(erased, y, 3)
    covs = moments.covariances()
    assert (moments.means - moments.means[0]).abs().max() < 1e-8
    assert torch.linalg.matrix_norm(covs - covs[0]).max() < 1e-8 * torch.linalg.matrix_norm(covs[0])


# --- end to end --------------------------------------------------------------------------------


def test_probes_off_keep_the_config_hash():
    assert config_hash(compose_config([])) == config_hash(compose_config(["probes=none"]))
    assert config_hash(compose_config([])) != config_hash(compose_config(PROBES))


@pytest.mark.parametrize("engine", ["stacked", "sequential"])
def test_digits_run_writes_the_curves_and_trains_as_without_probes(engine: str, tmp_path: Path):
    settings = [*FAST, FITS[engine], "trainer.kwargs.max_epochs=4", "trainer.patience=10"]
    off = run_experiment(compose_config(settings, tmp_path / "off"), tmp_path / "off")
    on = run_experiment(compose_config([*settings, *PROBES], tmp_path / "on"), tmp_path / "on")
    probe_only = [key for key in CURVES if key.startswith("maxent_probe")]
    assert not any(key in off for key in (*probe_only, "maxent_probes"))
    # every run keeps its validation accuracy (a logger's series); the probes' evaluation of it gives the same
    assert on["val_accuracy_curve"] == off["val_accuracy_curve"] and len(off["val_accuracy_curve"]) == 4
    for key in EXACT:  # evaluating the probes changes nothing in training
        assert on[key] == off[key], key
    for key in CURVES:
        assert len(on[key]) == len(on["val_loss_curve"]) == 4, key
    info = on["maxent_probes"]
    assert (
        info["n"] == 300 and sum(info["n_per_class"]) == 300
    )  # the validation split's class counts (digits val_size=300)
    assert all(0 <= a <= 1 for key in ("maxent_probe_accuracy_curve", "val_accuracy_curve") for a in on[key])
    assert all(math.isfinite(v) and v > 0 for v in on["maxent_probe_loss_curve"])


def test_engines_record_the_same_curves(tmp_path: Path):
    """The stacked engine mirrors the sequential one (same init, batches, protocol), probes included."""
    settings = [*FAST, "trainer.kwargs.max_epochs=3", *PROBES]
    runs = {
        e: run_experiment(compose_config([*settings, FITS[e]], tmp_path / e), tmp_path / e)
        for e in ("stacked", "sequential")
    }
    for key in CURVES:
        assert runs["stacked"][key] == pytest.approx(runs["sequential"][key], abs=2 / 300), key


def test_on_gaussian_classes_probe_accuracy_equals_real_accuracy(tmp_path: Path):
    """The real data ARE class Gaussians: probes and validation are samples of (almost) the same
    distribution, so their accuracies agree within binomial error at every epoch."""
    cfg = compose_config(
        [*GAUSSIAN, "eraser=none", "mdl.members_per_fit=all", "trainer.kwargs.max_epochs=8", *PROBES], tmp_path
    )
    r = run_experiment(cfg, tmp_path / "run")
    n = r["maxent_probes"]["n"]
    assert n == 900
    val, probe = r["val_accuracy_curve"], r["maxent_probe_accuracy_curve"]
    assert val[-1] > 0.6, val  # well above chance (1/3): the comparison means something
    for a, b in zip(val, probe):
        assert abs(a - b) < binomial_tolerance((a + b) / 2, n) * math.sqrt(2), (val, probe)


@pytest.mark.slow
def test_after_qleace_probes_are_at_chance_from_the_first_epoch(tmp_path: Path):
    """Every class Gaussian is the same after QLEACE: whatever the model predicts is independent of
    the probe's class, so with equal class counts its accuracy is 1/K within binomial error."""
    settings = [*GAUSSIAN, "mdl.members_per_fit=1", "trainer.kwargs.max_epochs=6", *PROBES, "probes.n_per_class=400"]
    r = run_experiment(compose_config([*settings, "eraser=qleace"], tmp_path / "q"), tmp_path / "q")
    n, k = r["maxent_probes"]["n"], r["num_classes"]
    assert n == 1200 and r["maxent_probes"]["n_per_class"] == [400] * 3
    for epoch, acc in enumerate(r["maxent_probe_accuracy_curve"]):
        assert abs(acc - 1 / k) < binomial_tolerance(1 / k, n), (epoch, r["maxent_probe_accuracy_curve"])
    # the same data without erasure: the probes are far from chance (the test above can fail)
    control = run_experiment(compose_config([*settings, "eraser=none"], tmp_path / "n"), tmp_path / "n")
    assert control["maxent_probe_accuracy_curve"][-1] > 1 / k + 3 * binomial_tolerance(1 / k, n)


@pytest.mark.slow
def test_stacked_resume_with_probes_is_bit_identical(tmp_path: Path, monkeypatch):
    settings = [
        *FAST,
        "mdl.members_per_fit=all",
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
        "trainer.kwargs.max_epochs=5",
        "trainer.patience=3",
        *PROBES,
    ]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    assert_resumes_exactly(settings, reference, (1, 3), tmp_path, monkeypatch, keys=(*EXACT, *CURVES))


@pytest.mark.slow
def test_sequential_resume_with_probes_is_bit_identical(tmp_path: Path, monkeypatch):
    settings = [
        *FAST,
        "mdl.members_per_fit=1",
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
        "trainer.kwargs.max_epochs=3",
        "trainer.patience=3",
        *PROBES,
    ]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    assert reference["final_epochs"] == 3
    saves = sum(b["epochs"] for b in reference["blocks"]) + 2  # killed in the final fit after its second epoch
    root = tmp_path / "kill"
    cfg = compose_config(settings, root)
    assert run_killed_after(cfg, root / "a", saves, monkeypatch)
    resumed = run_experiment(cfg, root / "b")
    for key in (*EXACT, *CURVES):
        assert resumed[key] == reference[key], key


# --- the report ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_report_plots_probe_accuracy_against_validation_accuracy(tmp_path: Path, monkeypatch):
    import mdl.report.figures as figs
    from mdl.report.build import build_report

    runs = {}
    for eraser in ("none", "qleace"):
        for seed in (0, 1):
            d = tmp_path / "sweep" / f"{eraser}{seed}"
            runs[eraser, seed] = run_experiment(
                compose_config([*FAST, f"eraser={eraser}", f"seed={seed}", "trainer.kwargs.max_epochs=3", *PROBES], d),
                d,
            )
    drawn = []
    original = figs._save

    def keep(fig, path):
        drawn.append(
            (
                path.name,
                [
                    (line.get_label(), [float(v) for v in line.get_ydata()])
                    for ax in fig.axes
                    for line in ax.get_lines()
                ],
            )
        )
        return original(fig, path)

    monkeypatch.setattr(figs, "_save", keep)
    report = build_report([tmp_path / "sweep"], tmp_path / "report", image_loader=None, echo=None)
    probe = [lines for name, lines in drawn if name.startswith("maxent_probes_")]
    assert len(probe) == 1 and len(list((tmp_path / "report").glob("maxent_probes_*.png"))) == 1, drawn
    # per eraser its validation line (solid, labelled with the eraser: the figure's one legend keys the colours and,
    # below, solid = validation, dashed = max-ent probes), then its probe line; last the dotted 1/K line
    drawn_lines = probe[0]
    for eraser in ("none", "qleace"):
        (at,) = [i for i, (label, _) in enumerate(drawn_lines) if label == eraser]
        for (_, y), key in zip(drawn_lines[at : at + 2], ("val_accuracy_curve", "maxent_probe_accuracy_curve")):
            expected = [(a + b) / 2 for a, b in zip(runs[eraser, 0][key], runs[eraser, 1][key])]
            assert y == pytest.approx(expected), (eraser, key)
    assert drawn_lines[-1][1] == pytest.approx([0.1, 0.1])  # the dotted 1/K line (digits: K = 10)
    assert "Max-ent probes over the final fit" in report.read_text()
