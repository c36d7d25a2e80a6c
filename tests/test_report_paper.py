"""The report against the paper: shipped Appendix C values, the flag rule, Figure 3, the config path.

Runs are results.json files written here (as in test_report.py) with chosen paper_mdl values, so
every expected difference, sigma and flag is computed by hand from the paper's printed numbers.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import CONF, sweep_report
from test_report import read_csv, write_run, write_sweep

from mdl.results import write_checked_json
from mdl.report.build import build_report, main
from mdl.report.paper import FLAG_SIGMAS, available_tables, compare, load_paper_table
from mdl.report.sweep import load_sweep
from mdl.report.stats import build_cells, mdl_increase

# The Appendix C table as the paper's text prints it (copied from the paper, not from the CSV):
PAPER_ROWS = """
| MLP | 7.14 ± 0.05 | 8.49 ± 0.10 | 8.94 ± 0.14 | 10.02 ± 0.08 | 11.41 ± 0.00 |
| LeNet | 5.62 ± 0.02 | 6.59 ± 0.28 | 6.83 ± 0.11 | 8.71 ± 0.09 | 8.68 ± 0.24 |
| ConvNeXtV2 | 5.09 ± 0.09 | 5.20 ± 0.15 | 4.92 ± 0.05 | 5.37 ± 0.02 | 1.67 ± 0.20 |
| Swin V2 | 8.18 ± 0.03 | 9.00 ± 0.13 | 8.67 ± 1.20 | 9.29 ± 0.06 | 9.08 ± 0.13 |
"""
ARCHS = {"MLP": "mlp", "LeNet": "lenet", "ConvNeXtV2": "convnext", "Swin V2": "swin"}
ERASERS = (
    "none",
    "leace",
    "alf_qleace",
    "gradient",
    "qleace",
)  # Control, LEACE, ALF-QLEACE, Gradient Quadratic, QLEACE


def run(
    root: Path,
    job: int,
    arch: str,
    eraser: str,
    seed: int,
    mdl: float,
    source: str = "cifar10",
    width: int = 128,
    zscore: bool = True,
) -> Path:
    """A results.json of data set ``source`` (z-scored before erasure, as the paper's table, unless
    ``zscore`` is false) whose paper MDL is ``mdl``."""
    path = write_run(root, job, arch, eraser, width, 2, seed) / "results.json"
    results = json.loads(path.read_text())
    results["config"]["data"]["source"] = source
    results["config"]["data"]["zscore"] = zscore
    results["paper_mdl"] = mdl
    write_checked_json(path, results)
    return path


# --- the shipped values ------------------------------------------------------------------------


def test_table16_ships_4_architectures_by_5_erasers_as_printed():
    """The one printed table sits under Figure 16's caption: z-scored CIFAR-10 at base model sizes."""
    assert available_tables() == ["table16"]
    table = load_paper_table("table16")
    assert len(table.cells) == 20 and table.datasets == ["cifar10+zscore"]
    assert any("normalized to zero-mean and unit-variance" in note for note in table.notes)
    assert {(c.arch, c.eraser) for c in table.cells} == {(a, e) for a in ARCHS.values() for e in ERASERS}
    for line in PAPER_ROWS.strip().splitlines():
        label, *printed = [part.strip() for part in line.strip("|").split("|")]
        for eraser, text in zip(ERASERS, printed, strict=True):
            cell = table.get("cifar10+zscore", ARCHS[label], eraser)
            mean, sd = (float(v) for v in text.split(" ± "))
            assert (cell.printed, cell.mean, cell.sd, cell.arch_paper) == (text, mean, sd, label)
    assert {(c.metric, c.unit, c.n_seeds, c.dataset_paper) for c in table.cells} == {
        ("paper_mdl", "bits/sample", 5, "CIFAR-10 z-scored")
    }
    assert all(c.location.startswith("Appendix C") for c in table.cells)
    assert any("arXiv:2502.02820" in note for note in table.notes)
    assert table.get("cifar10+zscore", "mlp", "none").rounding == pytest.approx(0.005)


def test_unknown_table_is_refused(tmp_path: Path, capsys):
    with pytest.raises(ValueError, match="table16"):
        load_paper_table("table_99")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--compare-to", "table_99"])
    assert "invalid choice" in capsys.readouterr().err


# --- the flag rule -----------------------------------------------------------------------------


@pytest.mark.slow
def test_cell_outside_the_error_bars_is_flagged_not_one_inside(tmp_path: Path):
    """MLP control 1 paper sd above the paper (inside), MLP LEACE 4 sd above (outside), 3 seeds each."""
    sweep = tmp_path / "multirun"
    for seed, d in enumerate((-0.01, 0.0, 0.01)):  # sample std 0.01, se 0.01 / sqrt(3)
        run(sweep, seed, "mlp", "none", seed, 7.14 + 0.05 + d)
        run(sweep, 10 + seed, "mlp", "leace", seed, 8.49 + 0.41 + d)
    out = tmp_path / "report"
    text = build_report([sweep], out, image_loader=None).read_text()

    by_eraser = {r["eraser"]: r for r in read_csv(out / "paper_comparison.csv")}
    se = 0.01 / math.sqrt(3)
    for eraser, delta, sd_paper, flagged in (("none", 0.05, 0.05, "0"), ("leace", 0.41, 0.10, "1")):
        row = by_eraser[eraser]
        sigma = math.sqrt(sd_paper**2 + se**2 + 0.005**2)
        assert float(row["delta"]) == pytest.approx(delta, abs=1e-9)
        assert float(row["delta_over_paper_std"]) == pytest.approx(delta / sd_paper, rel=1e-6)
        assert float(row["sigma"]) == pytest.approx(sigma, rel=1e-9)
        assert float(row["delta_over_sigma"]) == pytest.approx(delta / sigma, rel=1e-6)
        assert row["flagged"] == flagged and row["dataset"] == row["paper_dataset"] == "cifar10+zscore"
    assert "## Comparison with the paper" in text and "Data sets differ" not in text  # matched automatically
    assert "| cifar10+zscore | mlp | none | 7.19 ± 0.01 (n=3) | 7.14 ± 0.05 (n=5) | +0.05 | +1.0 | +1.0 | no |" in text
    assert (
        "| cifar10+zscore | mlp | leace | 8.90 ± 0.01 (n=3) | 8.49 ± 0.10 (n=5) | +0.41 | +4.1 | +4.1 | **yes** |"
        in text
    )
    assert "1 of 2 compared cell(s) beyond 2σ: mlp leace." in text
    assert "|Δ| > 2·σ" in text and "Paper cells with no run here: MLP × ALF-QLEACE" in text


@pytest.mark.parametrize("delta, flagged", [(0.55, False), (0.57, True), (-0.57, True)])
def test_threshold_with_one_seed(tmp_path: Path, delta: float, flagged: bool):
    """One seed: se_ours = 0, so the bar is 2 * sqrt(0.28^2 + 0.005^2) = 0.5601 for LeNet LEACE."""
    run(tmp_path, 0, "lenet", "leace", 0, 6.59 + delta)
    [x] = compare(build_cells(load_sweep([tmp_path])), load_paper_table("table16"))
    assert x.se == 0 and x.sigma == pytest.approx(math.hypot(0.28, 0.005))
    assert x.flagged is flagged and FLAG_SIGMAS == 2


def test_zero_paper_sd_uses_the_rounding_of_the_printed_value(tmp_path: Path):
    """MLP x QLEACE prints 11.41 ± 0.00: chance level in float32 (11.44) is flagged, 11.414 is not."""
    run(tmp_path / "a", 0, "mlp", "qleace", 0, 11.44)
    run(tmp_path / "b", 0, "mlp", "qleace", 0, 11.414)
    table = load_paper_table("table16")
    [far] = compare(build_cells(load_sweep([tmp_path / "a"])), table)
    [near] = compare(build_cells(load_sweep([tmp_path / "b"])), table)
    assert far.flagged and math.isnan(far.z_paper) and far.sigma == pytest.approx(0.005)
    assert not near.flagged


def test_a_paper_sd_of_zero_prints_no_infinity(tmp_path: Path):
    """Δ / sd_paper of MLP x QLEACE (printed 11.41 ± 0.00) read −∞ in the table and -inf in the CSV (issue 44.8):
    the paper's sd rounds to zero, so the ratio has no unit; the table says so and the CSV leaves it empty."""
    run(tmp_path / "sweep", 0, "mlp", "qleace", 0, 4.16)
    out = tmp_path / "out"
    assert main([str(tmp_path / "sweep"), "--out", str(out), "--images", "0", "--compare-to", "table16"]) == 0
    text = (out / "report.md").read_text()
    assert "∞" not in text and "inf" not in text.replace("information", "")
    assert "| -7.25 | n/a (paper sd 0.00) | -1450.0 | **yes** |" in text
    [row] = read_csv(out / "paper_comparison.csv")
    assert row["delta_over_paper_std"] == "" and float(row["delta_over_sigma"]) == pytest.approx(-1450.0)


def test_other_data_set_compared_only_on_request_and_said_so(tmp_path: Path):
    sweep = tmp_path / "multirun"
    for seed in (0, 1):
        run(sweep, seed, "mlp", "none", seed, 4.3 + 0.01 * seed, source="digits")
    auto = build_report([sweep], tmp_path / "auto", image_loader=None).read_text()
    assert "No paper table covers the data set(s) of these runs (digits)" in auto
    assert not (tmp_path / "auto" / "paper_comparison.csv").exists()
    assert main([str(sweep), "--out", str(tmp_path / "forced"), "--images", "0", "--compare-to", "table16"]) == 0
    forced = (tmp_path / "forced" / "report.md").read_text()
    assert "**Data sets differ: ours digits+zscore, the paper's CIFAR-10 z-scored.**" in forced
    assert "| digits+zscore → cifar10+zscore | mlp | none | 4.30 ± 0.01 (n=2) | 7.14 ± 0.05 (n=5) |" in forced
    [row] = read_csv(tmp_path / "forced" / "paper_comparison.csv")
    assert (row["dataset"], row["paper_dataset"], row["flagged"]) == ("digits+zscore", "cifar10+zscore", "1")


def test_raw_cifar10_is_not_compared_with_the_z_scored_table(tmp_path: Path):
    """The printed table is of z-scored data: runs on raw CIFAR-10 (paper/appendix_c) match nothing."""
    sweep = tmp_path / "multirun"
    run(sweep, 0, "mlp", "none", 0, 7.14, zscore=False)
    text = build_report([sweep], tmp_path / "auto", image_loader=None).read_text()
    assert "No paper table covers the data set(s) of these runs (cifar10)" in text
    assert not (tmp_path / "auto" / "paper_comparison.csv").exists()


# --- Figure 3 ----------------------------------------------------------------------------------


def test_figure3_draws_the_increase_over_the_control_per_width(tmp_path: Path, monkeypatch):
    """test_report's sweep: paper MDL = base(eraser) - 1 (LeNet) + 0.01 width/64 + 0.1 depth + 0.2 seed,
    except MLP / 128 / 2 / control = 7.0, 7.5, 8.5. Per (architecture, depth) panel, one line per eraser."""
    import mdl.report.figures as figs

    sweep = load_sweep([write_sweep(tmp_path / "runs", with_erasers=False)])
    cells = build_cells(sweep)
    drawn = {}

    def capture(fig, path):
        for ax in fig.axes:
            if ax.get_visible():
                handles, labels = ax.get_legend_handles_labels()
                drawn[ax.get_title()] = {
                    label: (list(h.lines[0].get_xdata()), list(h.lines[0].get_ydata()))
                    for h, label in zip(handles, labels)
                }
        return path

    monkeypatch.setattr(figs, "_save", capture)
    figures, notes = figs.figure3(sweep, cells, tmp_path)
    assert [f.path.name for f in figures] == ["figure3_mdl_increase.png"] and notes == []
    control_128 = (7.0 + 7.5 + 8.5) / 3
    expected = {  # mean over seeds 0, 1, 2 adds 0.2 to every generated value
        "lenet: depth=2": {"leace": ([64, 128], [1.0, 1.0])},
        "mlp: depth=2": {
            "leace": ([64, 128], [1.0, 8.0 + 0.02 + 0.2 + 0.2 - control_128]),
            "qleace": ([64, 128], [4.0, 11.0 + 0.02 + 0.2 + 0.1 - control_128]),
        },  # partial: seeds 0, 1
        "mlp: depth=4": {"leace": ([128], [1.0])},
    }
    assert set(drawn) == set(expected)
    for title, series in expected.items():
        assert set(drawn[title]) == set(series), title
        for eraser, (x, y) in series.items():
            assert drawn[title][eraser][0] == x and np.allclose(drawn[title][eraser][1], y), (title, eraser)

    # the standard error of a difference of two 3-seed cells with sample std 0.2 each
    [inc] = [i for i in mdl_increase(sweep, cells) if (i.arch, i.row, i.eraser) == ("lenet", (64, 2), "leace")]
    assert inc.se == pytest.approx(math.sqrt(2 * 0.04 / 3)) and (inc.n_erased, inc.n_control) == (3, 3)
    assert inc.relative == pytest.approx(1.0 / (7.0 - 1.0 + 0.01 + 0.2 + 0.2))


@pytest.mark.slow
def test_report_writes_figure3_and_its_data(tmp_path: Path):
    out = tmp_path / "report"
    text = build_report([write_sweep(tmp_path / "runs", with_erasers=False)], out, image_loader=None).read_text()
    assert "](figure3_mdl_increase.png)" in text and (out / "figure3_mdl_increase.png").stat().st_size > 0
    with open(out / "mdl_increase.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 + 2 + 1 + 2  # lenet leace x 2 widths, mlp leace x 3 settings, mlp qleace x 2 widths
    row = next(
        r for r in rows if (r["architecture"], r["width"], r["depth"], r["eraser"]) == ("mlp", "64", "2", "qleace")
    )
    assert float(row["increase_bits_per_sample"]) == pytest.approx(4.0) and row["n_control"] == "3"


# --- the config path: report after a multirun ----------------------------------------------------


def test_report_group_composes_to_the_callback():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["report=table16"], return_hydra_config=True)
    node = cfg.hydra.callbacks.report
    assert node._target_ == "mdl.report.callback.ReportAfterMultirun"
    assert (node.enabled, node.compare_to, node.images) == (True, "table16", 4)
    assert "report" not in cfg  # bookkeeping only: never in a run's config or hash


def test_callback_refuses_unknown_table_and_writes_the_report(tmp_path: Path):
    from omegaconf import OmegaConf

    from mdl.report.callback import ReportAfterMultirun

    with pytest.raises(SystemExit, match="no such paper table"):
        ReportAfterMultirun(compare_to="table_99").on_multirun_start(OmegaConf.create({}))
    sweep = tmp_path / "multirun"
    run(sweep, 0, "lenet", "none", 0, 4.0, source="digits")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    ReportAfterMultirun(compare_to="table16", images=0).on_multirun_end(config)
    assert "Data sets differ" in (sweep / "report" / "report.md").read_text()
    ReportAfterMultirun(enabled=False).on_multirun_end(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "x")}}})
    )
    assert not (tmp_path / "x").exists()


def test_multirun_with_report_group_writes_the_comparison(small_sweep):
    """report=table16 on a real multirun (the shared sweep: 2 erasers x 2 seeds of the MLP on digits): the sweep's
    report compares with the paper's table, one row per architecture and eraser."""
    report = sweep_report(small_sweep.root)
    text = report.read_text()
    assert "### Paper table `table16` (CIFAR-10 z-scored)" in text and "| digits → cifar10+zscore | mlp |" in text
    assert len(read_csv(report.parent / "paper_comparison.csv")) == 2
