"""The report on a synthetic sweep written here with known numbers.

Sweep: MLP and LeNet x widths 64, 128 (depth 2) x erasers none / leace (/ qleace for the MLP)
x seeds 0, 1, 2, plus an MLP depth-4 point at width 128. MLP + QLEACE at width 128 lacks seed 2
(partial cell); LeNet has no QLEACE at all (missing cells). The MLP width-128 depth-2 LEACE loss
curve is built to cross below the control's; the QLEACE curve is its mirror image.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mdl.results import write_checked_json
from mdl.report.build import build_report, main
from mdl.report.sweep import load_sweep
from mdl.report.stats import backfire_flags, build_cells, coverage, detect_backfire

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 20
CONTROL_CURVE = np.linspace(2.0, 1.0, EPOCHS)
# erased - control = 0.5 - 0.06 t (t = 0-based index): +0.02 at index 8, -0.04 at index 9 -> crossing epoch 10.
CROSSING_CURVE = CONTROL_CURVE + 0.5 - 0.06 * np.arange(EPOCHS)
MIRROR_CURVE = 2 * CONTROL_CURVE - CROSSING_CURVE
# paper MDL of MLP / width 128 / depth 2 / control, seeds 0, 1, 2:
CONTROL_MDL = (7.0, 7.5, 8.5)
CONTROL_MDL_MEAN = 23 / 3  # 7.6667
CONTROL_MDL_STD = math.sqrt(7 / 12)  # deviations -2/3, -1/6, 5/6: squares sum to 7/6, / (3 - 1)


def paper_mdl(arch: str, eraser: str, width: int, depth: int, seed: int) -> float:
    if (arch, eraser, width, depth) == ("mlp", "none", 128, 2):
        return CONTROL_MDL[seed]
    base = {"none": 7.0, "leace": 8.0, "alf_qleace": 9.0, "gradient": 10.0, "qleace": 11.0}[eraser] - (
        1.0 if arch == "lenet" else 0.0
    )
    return base + 0.01 * width / 64 + 0.1 * depth + 0.2 * seed


def curve(arch: str, eraser: str, width: int, depth: int, seed: int) -> list[float]:
    noise = 0.001 * seed
    if (arch, width, depth) == ("mlp", 128, 2) and eraser == "leace":
        return list(CROSSING_CURVE + noise)
    if (arch, width, depth) == ("mlp", 128, 2) and eraser == "qleace":
        return list(MIRROR_CURVE + noise)
    shift = {"none": 0.0, "leace": 0.3, "alf_qleace": 0.4, "gradient": 0.5, "qleace": 0.6}[eraser]
    return list(CONTROL_CURVE + shift + noise)


def write_run(
    root: Path,
    job: int,
    arch: str,
    eraser: str,
    width: int,
    depth: int,
    seed: int,
    eraser_path: str | None = None,
    activation: str = "relu",
    eraser_options: dict | None = None,
    code_version: str | None = None,
    environment: dict | None = None,
) -> Path:
    run_dir = root / f"{job}_eraser={eraser},model={arch},seed={seed},width={width}"
    run_dir.mkdir(parents=True)
    online = paper_mdl(arch, eraser, width, depth, seed) / 2
    results = {
        "config": {
            "seed": seed,
            "data_seed": seed,
            "width": width,
            "depth": depth,
            "data": {"source": "synthetic-test", "val_size": 16, "root": f"/tmp/data-{seed}"},
            "eraser": {"name": eraser, "options": eraser_options or {}},
            "model": {"name": arch, "options": {"activation": activation}},
            "logger": {"name": f"run-{job}"},
            "output_dir": str(run_dir),
        },
        "overrides": [f"eraser={eraser}", f"seed={seed}"],
        "git_sha": "abc123",
        "num_classes": 3,
        "n_train": 100,
        "blocks": [{"n_train": 10, "n_eval": 10, "eval_bits": 12.0}],
        "online_codelength_bits": online * 100,
        "online_bits_per_example": online,
        "uniform_codelength_bits": 100 * math.log2(3),
        "paper_mdl": paper_mdl(arch, eraser, width, depth, seed),
        "final_val_loss": float(min(curve(arch, eraser, width, depth, seed))),
        "val_loss_curve": curve(arch, eraser, width, depth, seed),
        "eraser_path": eraser_path,
    }
    if code_version is not None:
        results["code_version"] = code_version
    if environment is not None:
        results["environment"] = environment
    write_checked_json(run_dir / "results.json", results)
    return run_dir


def tiny_images(n: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    x = torch.rand(n, 1, 4, 4, generator=gen) * 0.5 + 0.15 * y.view(-1, 1, 1, 1)
    return x, y


def write_sweep(root: Path, with_erasers: bool = True) -> Path:
    from erasure import fit_eraser

    x, y = tiny_images()
    files = {}
    if with_erasers:
        for name in ("none", "leace"):
            files[name] = str(fit_eraser(name, x.double(), y).save(root / "erasers" / f"{name}.safetensors"))
    sweep = root / "multirun" / "2025-01-01" / "12-00-00"
    job = 0
    for arch, erasers in (("mlp", ("none", "leace", "qleace")), ("lenet", ("none", "leace"))):
        for eraser in erasers:
            for width, depth in ((64, 2), (128, 2)) + (((128, 4),) if arch == "mlp" and eraser != "qleace" else ()):
                for seed in (0, 1, 2):
                    if (arch, eraser, width, seed) == ("mlp", "qleace", 128, 2):
                        continue  # the partial cell
                    write_run(sweep, job, arch, eraser, width, depth, seed, files.get(eraser))
                    job += 1
    return sweep


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="module")
def report(sweep_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    return build_report([sweep_dir], out, image_loader=lambda config: tiny_images())


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def find_row(rows, **match) -> dict[str, str]:
    hits = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(hits) == 1, f"{len(hits)} rows match {match}"
    return hits[0]


def test_seeds_grouped_despite_paths_logger_and_data_seed(sweep_dir: Path):
    sweep = load_sweep([sweep_dir])
    assert sweep.row_keys == ["width", "depth"]
    cells = build_cells(sweep)
    # MLP none/leace: 3 settings x 3 seeds; MLP qleace: 2 x 3 - 1; LeNet none/leace: 2 x 3.
    assert len(sweep.runs) == 2 * 9 + 5 + 2 * 6
    assert len(cells) == 3 + 3 + 2 + 2 + 2
    assert sweep.replicate_keys == ["data_seed", "seed"]


def test_activation_and_eraser_options_split_labels_not_rows(tmp_path: Path):
    """Several MLP activations -> 'mlp-gelu'; an eraser option sweep -> 'leace (rank=1)': both
    stay in the same row as their control, and nothing else becomes a row key."""
    job = 0
    for activation in ("relu", "gelu"):
        for eraser, options in (("none", {}), ("leace", {"rank": 1}), ("leace", {"rank": 2})):
            for seed in (0, 1):
                write_run(tmp_path, job, "mlp", eraser, 128, 2, seed, activation=activation, eraser_options=options)
                job += 1
    sweep = load_sweep([tmp_path])
    assert sweep.row_keys == []
    cells = build_cells(sweep)
    assert sorted((c.arch, c.eraser, c.n) for c in cells) == [
        (arch, e, 2) for arch in ("mlp-gelu", "mlp-relu") for e in ("leace (rank=1)", "leace (rank=2)", "none")
    ]


def test_settings_differing_between_erasers_of_a_row_are_reported(tmp_path: Path):
    from mdl.report.stats import row_differences

    for job, eraser in enumerate(("none", "qleace")):
        run_file = write_run(tmp_path, job, "mlp", eraser, 128, 2, 0) / "results.json"
        results = json.loads(run_file.read_text())
        results["config"]["data"]["eval_labels"] = eraser == "none" or "predicted"
        write_checked_json(run_file, results)
    cells = build_cells(load_sweep([tmp_path]))
    assert row_differences(cells) == [("mlp", (), "data.eval_labels", {"none": "true", "qleace": '"predicted"'})]


def test_copies_counted_once_conflicts_and_broken_files_reported(tmp_path: Path):
    """The run store holds a copy of every results.json: read once. A re-run of the same seed
    with different numbers keeps the newer file and is listed; a truncated file is listed."""
    first = write_run(tmp_path / "sweep", 0, "mlp", "none", 128, 2, 0) / "results.json"
    store = tmp_path / "store" / "abc"
    store.mkdir(parents=True)
    (store / "results.json").write_text(first.read_text())
    rerun = write_run(tmp_path / "sweep2", 0, "mlp", "none", 128, 2, 0) / "results.json"
    changed = json.loads(rerun.read_text())
    changed["paper_mdl"] = 9.0
    write_checked_json(rerun, changed)
    os.utime(rerun, (first.stat().st_mtime + 10,) * 2)
    (tmp_path / "sweep" / "broken").mkdir()
    (tmp_path / "sweep" / "broken" / "results.json").write_text('{"config": {"se')
    sweep = load_sweep([tmp_path])
    assert [r.metric("paper_mdl") for r in sweep.runs] == [9.0]
    assert sweep.copies == 1
    [(kept, dropped)] = sweep.duplicates
    assert kept.path == rerun.resolve() and dropped.metric("paper_mdl") == CONTROL_MDL[0]
    assert [p.path.parent.name for p in sweep.problems] == ["broken"]


def test_table_means_and_stds_equal_hand_computed(report: Path):
    rows = read_csv(report.parent / "table.csv")
    control = find_row(rows, architecture="mlp", width=128, depth=2, eraser="none")
    assert float(control["paper_mdl_mean"]) == pytest.approx(CONTROL_MDL_MEAN, rel=1e-12)
    assert float(control["paper_mdl_std"]) == pytest.approx(CONTROL_MDL_STD, rel=1e-12)
    assert float(control["online_bits_per_example_std"]) == pytest.approx(CONTROL_MDL_STD / 2, rel=1e-12)
    assert control["n_seeds"] == "3"
    # Another cell: values base + 0.2 * seed -> mean base + 0.2, sample std 0.2 exactly.
    leace = find_row(rows, architecture="lenet", width=64, depth=2, eraser="leace")
    assert float(leace["paper_mdl_mean"]) == pytest.approx(8.0 - 1.0 + 0.01 + 0.2 + 0.2, rel=1e-12)
    assert float(leace["paper_mdl_std"]) == pytest.approx(0.2, rel=1e-12)
    text = report.read_text()
    assert "7.67 ± 0.76 (n=3)" in text
    assert "ddof = 1" in text and "bits per sample" in text
    assert "L(c_i) measured as `val_min` (minimum validation loss" in text  # runs without paper_loss predate last_block


def test_partial_and_missing_cells_are_flagged(report: Path, sweep_dir: Path):
    sweep = load_sweep([sweep_dir])
    cov = coverage(sweep, build_cells(sweep))
    assert cov.max_seeds == 3
    assert [(c.arch, c.row, c.eraser, lacking) for c, lacking in cov.partial] == [
        ("mlp", (128, 2), "qleace", ["data_seed=2,seed=2"])
    ]
    assert sorted(cov.missing) == [
        ("lenet", (64, 2), "qleace"),
        ("lenet", (128, 2), "qleace"),
        ("mlp", (128, 4), "qleace"),
    ]
    rows = read_csv(report.parent / "table.csv")
    partial = find_row(rows, architecture="mlp", width=128, depth=2, eraser="qleace")
    assert partial["n_seeds"] == "2" and partial["missing_seeds"] == "data_seed=2,seed=2"
    assert find_row(rows, architecture="lenet", width=64, depth=2, eraser="qleace")["n_seeds"] == "0"
    text = report.read_text()
    assert "partial: mlp width=128, depth=2 **qleace**: n=2 of 3" in text
    assert "(n=2) †" in text and "missing" in text


def test_detector_flags_crossing_curve_not_its_mirror():
    hit = detect_backfire(CONTROL_CURVE, CROSSING_CURVE)
    assert hit is not None and hit.crossing_epoch == 10 and hit.epochs == EPOCHS
    # early window = first 5 epochs: d = 0.5 - 0.06 t, t = 0..4 -> mean 0.38; late = last 5: t = 15..19 (mean 17) -> -0.52
    assert hit.early_gap == pytest.approx(0.38) and hit.late_gap == pytest.approx(-0.52)
    assert detect_backfire(CONTROL_CURVE, MIRROR_CURVE) is None
    assert detect_backfire(CROSSING_CURVE, CONTROL_CURVE) is None  # roles swapped
    assert detect_backfire(CONTROL_CURVE, CONTROL_CURVE + 0.1) is None  # always above: just slower


def test_backfiring_flags_in_sweep(report: Path, sweep_dir: Path):
    flags = backfire_flags(build_cells(load_sweep([sweep_dir])))
    assert [(f.arch, f.row, f.eraser, f.result.crossing_epoch) for f in flags] == [("mlp", (128, 2), "leace", 10)]
    rows = read_csv(report.parent / "backfiring.csv")
    assert [(r["architecture"], r["eraser"], r["crossing_epoch"]) for r in rows] == [("mlp", "leace", "10")]


def test_every_figure_written_and_not_blank(report: Path):
    import matplotlib.image as mpimg

    out = report.parent
    expected = {
        "mdl_vs_width_mlp-relu.png",
        "mdl_vs_width_lenet-relu.png",
        "mdl_vs_depth_mlp-relu.png",
        "val_loss_mlp-relu.png",
        "val_loss_lenet-relu.png",
        "figure1_synthetic-test.png",
        "figure3_mdl_increase.png",
    }
    expected = {e.replace("-relu", "") for e in expected}  # one activation: the label is the bare name
    written = {p.name for p in out.glob("*.png")}
    assert written == expected
    text = report.read_text()
    for name in written:
        assert f"]({name})" in text, f"{name} is not referenced in the report"
        rgb = (mpimg.imread(out / name)[..., :3] * 255).astype(np.uint32)
        colours = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])
        assert rgb.std() > 10 and len(colours) > 10, f"{name} looks blank"
    assert "removes 2 random directions (edit rank of leace)" in text
    assert "qleace: not shown; eraser_path is null" in text
    assert "MDL vs depth: not drawn for lenet" in text


def test_figure1_shows_erased_images(tmp_path: Path):
    """Columns: originals, LEACE (really applied: it changes the images), random control of
    LEACE's rank (no ALF-QLEACE here); the control's identity column is not repeated."""
    from mdl.report.figure1 import figure1
    from mdl.report.sweep import load_sweep as load

    sweep = load([write_sweep(tmp_path)])
    captured = {}

    def spy_draw(columns, path, lo, hi):
        captured.update(columns)
        return path

    import mdl.report.figure1 as figs

    original = figs._draw_figure1
    figs._draw_figure1 = spy_draw
    try:
        figures, notes = figure1(sweep, tmp_path, lambda config: tiny_images(), n_images=3)
    finally:
        figs._draw_figure1 = original
    assert list(captured) == ["original", "leace", "random (rank 2)"]
    x, y = tiny_images()
    assert torch.equal(captured["original"], x[[0, 1, 2]])  # first example of classes 0, 1, 2
    assert not torch.allclose(captured["leace"], captured["original"])
    edit = (captured["random (rank 2)"] - captured["original"]).reshape(3, -1).double()
    assert torch.linalg.matrix_rank(edit, rtol=1e-5) == 2  # as many directions as LEACE (float32 output)
    assert captured["original"].shape == (3, 1, 4, 4)


def test_figure1_degrades_when_images_unavailable(sweep_dir: Path, tmp_path: Path):
    from mdl.report.figure1 import figure1

    def broken(config):
        raise ImportError("no module named datamodules")

    figures, notes = figure1(load_sweep([sweep_dir]), tmp_path, broken)
    assert figures == [] and not list(tmp_path.glob("*.png"))
    assert notes == [
        "Figure 1 (synthetic-test): skipped, the images could not be loaded (ImportError: no module named datamodules)."
    ]


def test_default_image_loader_reads_the_runs_data_source():
    """Figure 1's real loader goes through datamodules.load_source with config.data."""
    from mdl.report.figure1 import default_image_loader

    x, y = default_image_loader({"data": {"source": "digits", "options": {}, "val_size": 300}})
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))


@pytest.mark.slow
def test_cli_runs_on_synthetic_sweep(tmp_path: Path):
    """A small sweep (2 erasers x 2 seeds) through the real command line (Figure 1 off with
    --images 0, so the subprocess needs neither torch nor the data sources: fast)."""
    sweep = tmp_path / "multirun"
    for job, (eraser, seed) in enumerate((e, s) for e in ("none", "leace") for s in (0, 1)):
        write_run(sweep, job, "mlp", eraser, 128, 2, seed)
    out = tmp_path / "cli-report"
    proc = subprocess.run(
        [sys.executable, "-m", "mdl.report", str(sweep), "--out", str(out), "--images", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"report: {out / 'report.md'}" in proc.stdout
    for name in ("report.md", "table.csv", "runs.csv", "loss_curves.csv", "backfiring.csv", "val_loss_mlp.png"):
        assert (out / name).stat().st_size > 0
    assert len(read_csv(out / "runs.csv")) == 4
    text = (out / "report.md").read_text()
    assert "7.25 ± 0.35 (n=2)" in text  # control seeds 0, 1: 7.0 and 7.5 -> std 0.5 / sqrt(2)
    assert "Figure 1: skipped" in text


@pytest.mark.slow  # a launch and two reports (a list-valued setting in process: test_list_valued_setting_...)
def test_report_over_two_real_sweeps_and_over_their_parent_folder(small_sweep, tmp_path: Path):
    """Two sweeps run by launch.py (the shared small sweep, and one with a list-valued optimizer setting of its own,
    which crashed the report: unhashable list), reported together and through the folder that holds them."""
    from conftest import FAST, copy_output, run_launch

    copy_output(small_sweep, tmp_path / "out")
    sweep = ["eraser=leace", "+optimizer.betas=[0.95,0.99]", "seed=0"]
    proc = run_launch(["-m", *sweep, f"paths.output_root={tmp_path / 'out'}", "report=none", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = sorted(p.parent for p in (tmp_path / "out" / "multirun").glob("*/*/multirun.yaml"))
    assert len(sweeps) == 2
    for name, folders in (("together", [str(s) for s in sweeps]), ("parent", [str(tmp_path / "out" / "multirun")])):
        out = tmp_path / name
        assert main([*folders, "--out", str(out), "--images", "0"]) == 0
        assert len(read_csv(out / "runs.csv")) == 5, name
        table = read_csv(out / "table.csv")
        assert {r["optimizer.betas"] for r in table} == {"(0.9, 0.999)", "(0.95, 0.99)"}, name  # the key that differs
        assert len(parse_plain_tabular((out / "table.tex").read_text())) == 1 + sum(
            r["n_seeds"] != "0" for r in table
        ), name


def test_cli_clear_error_on_empty_dir(tmp_path: Path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no readable results.json" in capsys.readouterr().err


def test_code_versions_split_cells_by_default_merge_on_request(tmp_path: Path, capsys):
    """Two seeds of one config computed by different code versions: two cells (n=1 each, a
    code_version column) by default, one cell of n=2 with --merge-code-versions; a console line
    and report.md say how many versions and which way."""
    sweep = tmp_path / "multirun"
    for job, (seed, version) in enumerate(((0, "c0de0000aaaa"), (1, "c0de1111bbbb"))):
        write_run(sweep, job, "mlp", "none", 128, 2, seed, code_version=version)

    split = load_sweep([sweep])
    assert split.row_keys == ["code_version"] and split.code_versions == ["c0de0000aaaa", "c0de1111bbbb"]
    assert sorted((c.row, c.n) for c in build_cells(split)) == [(("c0de0000aaaa",), 1), (("c0de1111bbbb",), 1)]
    merged = load_sweep([sweep], merge_code_versions=True)
    assert merged.row_keys == [] and [(c.row, c.n) for c in build_cells(merged)] == [((), 2)]

    out = tmp_path / "split"
    assert main([str(sweep), "--out", str(out), "--images", "0"]) == 0
    console = capsys.readouterr().out
    lines = [line for line in console.splitlines() if "code versions" in line]
    assert len(lines) == 1 and "2 code versions" in lines[0] and "split" in lines[0]
    assert "--merge-code-versions" in lines[0]
    rows = read_csv(out / "table.csv")
    assert sorted((r["code_version"], r["n_seeds"]) for r in rows) == [("c0de0000aaaa", "1"), ("c0de1111bbbb", "1")]
    text = (out / "report.md").read_text()
    assert "2 code versions" in text and "cells were split by code version" in text
    assert "| architecture | code_version | none |" in text and "7.00 ± n/a (n=1)" in text

    out = tmp_path / "merged"
    assert main([str(sweep), "--out", str(out), "--images", "0", "--merge-code-versions"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "code versions" in line]
    assert len(lines) == 1 and "2 code versions" in lines[0] and "merged" in lines[0]
    [row] = read_csv(out / "table.csv")
    assert row["n_seeds"] == "2" and "code_version" not in row
    text = (out / "report.md").read_text()
    assert "7.25 ± 0.35 (n=2)" in text and "cells were merged across code versions" in text
    assert "averages runs of code versions `c0de0000aaaa`, `c0de1111bbbb`" in text


@pytest.mark.slow
def test_code_version_cli_line_in_subprocess(tmp_path: Path):
    sweep = tmp_path / "multirun"
    for job, (seed, version) in enumerate(((0, "c0de0000aaaa"), (1, "c0de1111bbbb"), (2, None))):
        write_run(sweep, job, "mlp", "none", 128, 2, seed, code_version=version)
    proc = subprocess.run(
        [sys.executable, "-m", "mdl.report", str(sweep), "--out", str(tmp_path / "r"), "--images", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # the run without code_version falls back to its git_sha
    assert "runs come from 3 code versions (abc123, c0de0000aaaa, c0de1111bbbb); cells were split" in proc.stdout


def test_a_hand_edited_results_file_is_a_problem_not_a_number(tmp_path: Path):
    """A results.json whose number was changed by hand (its checksum no longer matches) is named among the sweep's
    problems and left out of every cell, instead of entering the report as 94.39 beside 4.39."""
    kept = write_run(tmp_path / "sweep", 0, "mlp", "none", 128, 2, 0) / "results.json"
    edited = write_run(tmp_path / "sweep", 1, "mlp", "none", 128, 2, 1) / "results.json"
    edited.write_text(edited.read_text().replace('"paper_mdl": ', '"paper_mdl": 9', 1))
    sweep = load_sweep([tmp_path])
    assert [r.path for r in sweep.runs] == [kept.resolve()]
    [problem] = sweep.problems
    assert problem.path == edited.resolve() and "checksum missing or wrong" in problem.reason
    said: list[str] = []
    build_report([tmp_path], tmp_path / "report", image_loader=None, echo=said.append)
    assert any("1 results.json left out" in line and str(edited.resolve()) in line for line in said), said


def test_copies_counted_once_with_several_code_versions(tmp_path: Path):
    """A store copy of a run (same config, seed, version and numbers) still counts once when the
    sweep holds several code versions, split or merged; a version-less, git-less run is 'unknown'."""
    old = write_run(tmp_path / "sweep", 0, "mlp", "none", 128, 2, 0, code_version="0ld0ld0ld0ld") / "results.json"
    store = tmp_path / "store" / "abc"
    store.mkdir(parents=True)
    (store / "results.json").write_text(old.read_text())
    skipped = json.loads(old.read_text())
    skipped.update(skipped=True, reused_from=str(store / "results.json"))
    relaunch = write_run(tmp_path / "relaunch", 0, "mlp", "none", 128, 2, 0) / "results.json"
    write_checked_json(relaunch, skipped)  # a re-launch's skipped job: the original's numbers and version
    new = write_run(tmp_path / "sweep", 1, "mlp", "none", 128, 2, 0, code_version="new0new0new0") / "results.json"
    changed = json.loads(new.read_text())
    changed["paper_mdl"] = 9.0
    write_checked_json(new, changed)
    nogit = write_run(tmp_path / "sweep", 2, "mlp", "none", 128, 2, 1) / "results.json"
    results = json.loads(nogit.read_text())
    results["git_sha"] = None
    write_checked_json(nogit, results)

    split = load_sweep([tmp_path])
    assert split.copies == 2 and split.duplicates == []
    assert split.code_versions == ["0ld0ld0ld0ld", "new0new0new0", "unknown"]
    assert sorted((c.row, c.n, c.runs[0].metric("paper_mdl")) for c in build_cells(split)) == [
        (("0ld0ld0ld0ld",), 1, CONTROL_MDL[0]),
        (("new0new0new0",), 1, 9.0),
        (("unknown",), 1, CONTROL_MDL[1]),
    ]
    assert not split.runs[0].results.get("skipped")

    os.utime(new, (old.stat().st_mtime + 10,) * 2)
    merged = load_sweep([tmp_path], merge_code_versions=True)
    assert merged.copies == 2 and len(merged.duplicates) == 1  # seed 0: the newer re-run with other numbers kept
    assert sorted(r.metric("paper_mdl") for r in merged.runs) == [CONTROL_MDL[1], 9.0]


def test_one_code_version_no_column_no_console_line(tmp_path: Path, capsys):
    sweep = tmp_path / "multirun"
    for seed in (0, 1):
        write_run(sweep, seed, "mlp", "none", 128, 2, seed, code_version="c0de0000aaaa")
    assert main([str(sweep), "--out", str(tmp_path / "r"), "--images", "0"]) == 0
    assert "code version" not in capsys.readouterr().out
    [row] = read_csv(tmp_path / "r" / "table.csv")
    assert row["n_seeds"] == "2" and "code_version" not in row
    assert (
        "Code version (results.json `code_version`, else `git_sha`): `c0de0000aaaa`."
        in (tmp_path / "r" / "report.md").read_text()
    )


def test_report_over_an_interrupted_sweep_names_the_missing_jobs(small_sweep, tmp_path: Path, capsys):
    """A real multirun as a kill after its first two jobs leaves it (the shared sweep, copied: the third job's folder
    without results.json, the fourth never made): the report says which of the planned jobs are missing, by their
    own overrides (Hydra's basic sweeper replayed from multirun.yaml)."""
    import shutil

    from conftest import copy_output

    root = copy_output(small_sweep, tmp_path / "out")
    (sweep,) = root.glob("multirun/*/*")
    jobs = sorted(p for p in sweep.iterdir() if p.name[0].isdigit())
    assert [j.name.split("_")[0] for j in jobs] == ["0", "1", "2", "3"]
    (jobs[2] / "results.json").unlink()  # killed while training
    shutil.rmtree(jobs[3])  # not started
    shutil.rmtree(sweep / "report")

    assert main([str(sweep), "--images", "0"]) == 0
    expected = ["job #2: eraser=leace seed=0", "job #3: eraser=leace seed=1"]
    text = (sweep / "report" / "report.md").read_text()
    assert "## Missing jobs" in text
    for job in expected:
        assert job in text
    assert "job #0" not in text and "job #1" not in text
    assert f"{len(expected)} planned job(s) have no results.json" in capsys.readouterr().out


def test_report_to_an_unwritable_folder_is_one_message(tmp_path: Path, capsys):
    sweep = tmp_path / "multirun"
    write_run(sweep, 0, "mlp", "none", 128, 2, 0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([str(sweep), "--out", str(blocker / "report"), "--images", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report to" in err and "--out DIR" in err


def test_list_valued_setting_that_differs_splits_rows_without_crashing(tmp_path: Path):
    """optimizer.betas differing between runs (a list-valued key) is a row key like any other
    (it raised TypeError: unhashable type: 'list')."""
    sweep = tmp_path / "multirun"
    for job, (betas, seed) in enumerate((b, s) for b in ([0.9, 0.999], [0.95, 0.99]) for s in (0, 1)):
        run = write_run(sweep, job, "mlp", "none", 128, 2, seed)
        results = json.loads((run / "results.json").read_text())
        results["config"]["optimizer"] = {"betas": betas}
        write_checked_json(run / "results.json", results)
    path = build_report([sweep], tmp_path / "out", image_loader=None, echo=None)
    rows = read_csv(path.parent / "table.csv")
    assert (
        len(rows) == 2
        and {r["n_seeds"] for r in rows} == {"2"}
        and {r["optimizer.betas"] for r in rows} == {"(0.9, 0.999)", "(0.95, 0.99)"}
    )


# What a plain LaTeX tabular may hold without any package: the escapes latex_escape writes, \\pm in math, \\hline.
LATEX_TEXT_ESCAPES = (
    "\\&",
    "\\%",
    "\\$",
    "\\#",
    "\\_",
    "\\{",
    "\\}",
    "\\textasciitilde{}",
    "\\textasciicircum{}",
    "\\textbackslash{}",
    "\\textless{}",
    "\\textgreater{}",
    "\\textbar{}",
)


def parse_plain_tabular(tex: str) -> list[list[str]]:
    """The rows of a tabular, checked as LaTeX would read it with no package loaded: one begin/end pair,
    \\hline rules, every row ending in \\\\ with as many cells as the column spec, math balanced and
    holding only \\pm, and no character LaTeX reads as markup left unescaped. Raises AssertionError."""
    import re

    lines = [line for line in tex.splitlines() if line.strip()]
    head = re.fullmatch(r"\\begin\{tabular\}\{([lrc]+)\}", lines[0])
    assert head and lines[-1] == "\\end{tabular}", (lines[0], lines[-1])
    columns, rows = len(head.group(1)), []
    for line in lines[1:-1]:
        if line == "\\hline":
            continue
        assert line.endswith(" \\\\"), f"a row must end in \\\\: {line!r}"
        body = line[:-3]
        plain = body  # the escapes removed, a $ left is a math delimiter
        for escape in LATEX_TEXT_ESCAPES:
            plain = plain.replace(escape, "")
        pieces = plain.split("$")
        assert len(pieces) % 2 == 1, f"unbalanced math: {line!r}"
        for i, piece in enumerate(pieces):
            if i % 2:  # math: numbers, n, =, and \\pm only
                assert re.fullmatch(r"(\\pm|[\w=.\s])*", piece), f"math LaTeX cannot read without packages: {piece!r}"
            else:
                assert not re.search(r"[\\%#_{}~^<>|]", piece), f"markup left unescaped: {piece!r} in {line!r}"
        cells = [c.strip() for c in re.split(r"(?<!\\)&", body)]
        assert len(cells) == columns, f"{len(cells)} cells for {columns} columns: {line!r}"
        rows.append(cells)
    return rows


def test_figures_for_a_paper_and_a_latex_table(report: Path):
    """Every figure also as PDF and SVG, a column wide; the table a plain LaTeX tabular with the paper's eraser names."""
    out = report.parent
    for png in out.glob("*.png"):
        assert png.with_suffix(".pdf").stat().st_size > 0 and png.with_suffix(".svg").stat().st_size > 0, png
    tex = (out / "table.tex").read_text()
    rows = parse_plain_tabular(tex)
    header, body = rows[0], rows[1:]
    assert len(body) == sum(r["n_seeds"] != "0" for r in read_csv(out / "table.csv"))  # a row per cell with runs
    erasers = {row[header.index("eraser")] for row in body}
    assert {"LEACE", "QLEACE", "Control"} <= erasers and "leace" not in erasers


def test_latex_table_escapes_what_latex_reads_as_markup(tmp_path: Path):
    """A setting's value full of LaTeX's special characters is printed, not read as markup."""
    from mdl.report.tables import latex_escape

    nasty = "a_b%c&d~e^f\\g{h}#i$j<k>l|m\nn"
    assert latex_escape(nasty) == (
        "a\\_b\\%c\\&d\\textasciitilde{}e\\textasciicircum{}f\\textbackslash{}g\\{h\\}\\#i\\$j"
        "\\textless{}k\\textgreater{}l\\textbar{}m n"
    )
    sweep = tmp_path / "multirun"
    for job, (note, seed) in enumerate((n, s) for n in (nasty, "plain") for s in (0, 1)):
        run = write_run(sweep, job, "mlp", "leace", 128, 2, seed)
        results = json.loads((run / "results.json").read_text())
        results["config"]["model"]["options"]["note"] = note
        write_checked_json(run / "results.json", results)
    path = build_report([sweep], tmp_path / "out", image_loader=None, echo=None)
    rows = parse_plain_tabular((path.parent / "table.tex").read_text())
    assert len(rows) == 3 and any(latex_escape(nasty) in cell for row in rows for cell in row)


def test_chance_levels_of_a_uniform_predictor():
    """paper MDL's chance is log2 K times the share of examples the blocks after the first code; loss ln K."""
    from types import SimpleNamespace

    from mdl.report.figures import display_name
    from mdl.report.stats import chance_level

    run = SimpleNamespace(results={"num_classes": 4, "boundaries": [10, 30, 100]})
    cells = [SimpleNamespace(runs=[run])]
    assert chance_level(cells, "paper_mdl") == pytest.approx(2.0 * 130 / 100)
    assert chance_level(cells, "online_bits_per_example") == 2.0
    assert chance_level(cells, "val_loss") == pytest.approx(math.log(4))
    other = SimpleNamespace(results={"num_classes": 10, "boundaries": [10, 30, 100]})
    assert chance_level([SimpleNamespace(runs=[run, other])], "paper_mdl") is None  # no one chance level
    assert display_name("qleace (shrinkage=optimal)") == "QLEACE (shrinkage=optimal)" and display_name("foo") == "foo"


@pytest.mark.slow
def test_lr_search_names_the_best_learning_rate_and_the_grid_edge(tmp_path: Path):
    """A sweep over optimizer.lr: report.md's "Learning rate" section picks the lr of lowest mean paper MDL
    per architecture and eraser, and says when it is at the edge of the grid."""
    from mdl.report.lr import best_learning_rates

    sweep = tmp_path / "multirun"
    job = 0
    for lrs, eraser in (((1e-3, 3e-3, 1e-2), "none"), ((1e-3, 3e-3, 1e-2), "leace")):
        for lr in lrs:
            for seed in (0, 1):
                run = write_run(sweep, job, "mlp", eraser, 128, 2, seed)
                job += 1
                results = json.loads((run / "results.json").read_text())
                results["config"]["optimizer"] = {"lr": lr}
                results["config"]["data"]["source"] = "digits"
                best = 2.5 if eraser == "none" else 3.0  # lowest near 10^-2.5 (none), 10^-3 (leace)
                results["paper_mdl"] = (math.log10(lr) + best) ** 2 + 0.01 * seed
                write_checked_json(run / "results.json", results)
    path = build_report([sweep], tmp_path / "out", image_loader=None, echo=None)
    choices = {c.eraser: c for c in best_learning_rates(load_sweep([sweep]), build_cells(load_sweep([sweep])))}
    assert choices["none"].lr == 3e-3 and not choices["none"].at_edge
    assert choices["leace"].lr == 1e-3 and choices["leace"].at_edge  # its lowest point is the grid's first
    text = path.read_text()
    assert (
        "## Learning rate" in text and "| mlp | - | none | 0.003 |" in text and "0.001 (at the edge of the grid" in text
    )
    # written where a sweep uses it: +lr=best from the report folder sets optimizer.lr per data set, model and eraser
    assert (tmp_path / "out" / "lr" / "best.yaml").is_file() and "+lr=best" in text
    from conftest import compose_config

    searchpath = f"hydra.searchpath=[file://{tmp_path / 'out'}]"
    for eraser, lr in (("none", 3e-3), ("leace", 1e-3), ("qleace", None)):
        cfg = compose_config([searchpath, "+lr=best", f"eraser={eraser}", "width=512"])
        assert cfg.optimizer.lr == lr, eraser  # at any width (muP); an eraser the search did not cover: none
    from mdl.run.config_checks import validate_config
    from mdl.run.identity import config_hash

    with pytest.raises(
        ValueError, match="the lr search's table, \\+lr=best, has none for data digits, model mlp, eraser qleace"
    ):
        validate_config(compose_config([searchpath, "+lr=best", "eraser=qleace"]))
    by_table = compose_config([searchpath, "+lr=best", "eraser=leace"])
    assert config_hash(by_table) == config_hash(compose_config(["eraser=leace", "optimizer.lr=0.001"]))  # the same run


@pytest.mark.slow
def test_lr_transfer_across_widths_is_drawn_and_judged(tmp_path: Path):
    """A sweep over optimizer.lr and width: the best lr per width in a table that says whether it transfers,
    and a figure with one line per width. Known answer: the optimum at 3e-3 for widths 64 and 256, and at
    1e-2 for width 1024 (it does not transfer for that eraser), at 3e-3 everywhere for the other."""
    from mdl.report.lr import best_lr_by_width

    sweep = tmp_path / "multirun"
    job = 0
    optimum = {
        ("none", 64): 3e-3,
        ("none", 256): 3e-3,
        ("none", 1024): 3e-3,
        ("leace", 64): 3e-3,
        ("leace", 256): 3e-3,
        ("leace", 1024): 1e-2,
    }
    for (eraser, width), best in optimum.items():
        for lr in (1e-3, 3e-3, 1e-2, 3e-2):
            for seed in (0, 1):
                run = write_run(sweep, job, "mlp", eraser, width, 2, seed)
                job += 1
                results = json.loads((run / "results.json").read_text())
                results["config"]["optimizer"] = {"lr": lr}
                results["paper_mdl"] = (math.log10(lr) - math.log10(best)) ** 2 + 0.01 * seed + width / 1e4
                write_checked_json(run / "results.json", results)
    path = build_report([sweep], tmp_path / "out", image_loader=None, echo=None)
    loaded = load_sweep([sweep])
    best = best_lr_by_width(loaded, build_cells(loaded))
    assert best[("mlp", "", "none")] == {64: 3e-3, 256: 3e-3, 1024: 3e-3}
    assert best[("mlp", "", "leace")] == {64: 3e-3, 256: 3e-3, 1024: 1e-2}
    text = path.read_text()
    assert "Does the optimum transfer across widths?" in text
    assert "| mlp | - | none | 64: 0.003, 256: 0.003, 1024: 0.003 | yes |" in text
    assert "| mlp | - | leace | 64: 0.003, 256: 0.003, 1024: 0.01 | no |" in text
    for fmt in ("png", "pdf", "svg"):
        assert (tmp_path / "out" / f"lr_transfer_mlp.{fmt}").stat().st_size > 0
    assert "lr_transfer_mlp.png" in text


def test_a_cell_whose_seeds_mix_environments_is_flagged(tmp_path: Path, capsys):
    """Seeds of one cell computed under two torch builds: the cell stays one (the same experiment), and the console
    and report.md name the environments and the cell that mixes them."""
    sweep = tmp_path / "multirun"
    base = {"torch": "2.14.1", "gpu": None, "cpu_capability": "AVX512", "threads": 1}
    for job, torch_version in enumerate(("2.14.1", "2.15.0")):
        write_run(sweep, job, "mlp", "none", 128, 2, job, environment={**base, "torch": torch_version})
    write_run(sweep, 2, "mlp", "leace", 128, 2, 0, environment=base)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--images", "0"]) == 0
    (line,) = [text for text in capsys.readouterr().out.splitlines() if "mix environments" in text]
    assert "1 cell(s) mix environments" in line and "none" in line and "leace" not in line.split("mix environments")[1]
    text = (out / "report.md").read_text()
    assert "`torch 2.14.1 cpu/AVX512 1t` (2 runs)" in text and "`torch 2.15.0 cpu/AVX512 1t` (1 runs)" in text


def test_runs_of_one_environment_say_so_without_a_flag(tmp_path: Path):
    sweep = tmp_path / "multirun"
    write_run(sweep, 0, "mlp", "none", 128, 2, 0)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--images", "0"]) == 0
    text = (out / "report.md").read_text()
    assert "Environment: `unrecorded`." in text and "mix environments" not in text


# --- figures a paper can use (mdl/report/style.py) ----------------------------------------------


@pytest.fixture
def drawn_figures(monkeypatch):
    """A function running ``build()`` that returns every (file name, matplotlib figure) the report saves while it
    runs, kept open for inspection (closed when the test ends)."""
    import matplotlib.pyplot as plt

    import mdl.report.figure1 as figure1_module
    import mdl.report.figures as figures_module
    import mdl.report.lr as lr_module

    figures = []

    def keep(fig, path):
        figures.append((path.name, fig))
        fig.savefig(path, dpi=50)
        return path

    for module in (figures_module, figure1_module, lr_module):
        monkeypatch.setattr(module, "_save", keep)

    def run(build) -> list:
        figures.clear()
        build()
        return list(figures)

    yield run
    plt.close("all")


def eraser_colours_drawn(fig) -> dict[str, str]:
    """Display name -> colour, from the legends' lines and from Figure 1's coloured column titles."""
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    found: dict[str, str] = {}
    for legend in fig.legends:  # one per figure, below its panels
        for text, handle in zip(legend.get_texts(), legend.legend_handles):
            if isinstance(handle, Line2D) and handle.get_linestyle() == "None":
                continue  # a marker kind's key (hollow, star), in grey
            colour = handle.get_color() if hasattr(handle, "get_color") else handle.get_edgecolor()
            found[text.get_text()] = to_hex(colour)
    for ax in fig.axes:
        if ax.get_title() and not fig.legends:
            found[ax.get_title().replace("\n", " ").split(" (")[0]] = to_hex(ax.title.get_color())  # wrapped
    return found


def test_pdf_figures_embed_truetype_fonts_not_type3(report: Path):
    """Venues reject Type 3 fonts: every PDF figure embeds its text as TrueType (Type 42)."""
    from pypdf import PdfReader

    pdfs = sorted(report.parent.glob("*.pdf"))
    assert pdfs
    for pdf in pdfs:
        subtypes = set()
        for page in PdfReader(pdf).pages:
            for font in (page["/Resources"].get("/Font") or {}).values():
                font = font.get_object()
                subtypes.add(str(font["/Subtype"]))
                for descendant in font.get("/DescendantFonts") or []:
                    subtypes.add(str(descendant.get_object()["/Subtype"]))
        assert subtypes and "/Type3" not in subtypes, (pdf.name, subtypes)
        assert subtypes & {"/TrueType", "/CIDFontType2"}, (pdf.name, subtypes)


@pytest.mark.slow
def test_every_figure_uses_the_style_names_colours_and_font_sizes(sweep_dir: Path, tmp_path: Path, drawn_figures):
    """One colour per eraser across all figures (Figure 1's column titles included), the paper's eraser
    names (Figure 1 included), legends one step below the axis labels, not 6 pt beside 10 pt."""
    from matplotlib.colors import to_hex

    from mdl.report.style import ERASER_COLORS, ERASER_NAMES, FONT_SIZE, SMALL_FONT_SIZE

    figures = drawn_figures(
        lambda: build_report([sweep_dir], tmp_path, image_loader=lambda c: tiny_images(), echo=None)
    )
    names = {name for name, _ in figures}
    assert {"figure1_synthetic-test.png", "figure3_mdl_increase.png", "val_loss_mlp.png"} <= names
    expected = {ERASER_NAMES[e]: to_hex(ERASER_COLORS[e]) for e in ("none", "leace", "qleace", "random")}
    seen: dict[str, set[str]] = {}
    for name, fig in figures:
        for label, colour in eraser_colours_drawn(fig).items():
            seen.setdefault(label, set()).add(colour)
        for legend in fig.legends:
            assert {t.get_fontsize() for t in legend.get_texts()} == {SMALL_FONT_SIZE}, name
        for ax in fig.axes:
            if ax.get_xlabel():
                assert ax.xaxis.label.get_fontsize() == FONT_SIZE, name
            assert ax.title.get_fontsize() == FONT_SIZE, name
    assert "leace" not in seen and "none" not in seen, seen  # config names never reach a figure
    for label, colour in expected.items():
        assert seen.get(label) == {colour}, (label, seen.get(label))
    figure1_titles = {
        ax.get_title().replace("\n", " ") for name, fig in figures if name.startswith("figure1") for ax in fig.axes
    }
    assert {"LEACE", "Random projection (rank 2)"} <= figure1_titles


@pytest.mark.slow
def test_panels_that_compare_share_their_y_scale(sweep_dir: Path, tmp_path: Path, drawn_figures):
    """Within a figure, every visible panel of one quantity (same y label) has the same y limits."""
    figures = drawn_figures(lambda: build_report([sweep_dir], tmp_path, image_loader=None, echo=None))
    compared = 0
    for name, fig in figures:
        by_quantity: dict[str, set] = {}
        for ax in fig.axes:
            if ax.get_visible() and ax.get_ylabel():
                by_quantity.setdefault(ax.get_ylabel(), set()).add(tuple(round(v, 9) for v in ax.get_ylim()))
        for quantity, limits in by_quantity.items():
            assert len(limits) == 1, (name, quantity, limits)
        compared += sum(1 for ax in fig.axes if ax.get_visible() and ax.get_ylabel()) > len(by_quantity)
    assert compared >= 3  # val_loss_mlp, figure3, mdl_vs_width_mlp... have several panels


def paper_lookup_tables() -> dict:
    """A paper preset's lookup tables (conf/experiment/paper/common.yaml): many keys a plain sweep lacks."""
    archs, erasers = ("mlp", "lenet", "convnext", "swin"), ("none", "leace", "qleace", "alf_qleace", "gradient")
    return {
        "lr": {a: 5e-4 for a in archs},
        "beta1": {a: 0.9 for a in archs},
        "lr_by_eraser": {"convnext": {e: 1e-4 for e in erasers}},
        "augment_order": {e: "erase_then_augment" for e in erasers},
    }


def write_mixed_folder(root: Path) -> Path:
    """A parent folder of two sweeps: a plain one and a paper preset's (the same grid plus ``paper.*`` tables)."""
    job = 0
    for sweep, extra in (("plain", None), ("preset", paper_lookup_tables())):
        for eraser in ("none", "leace"):
            for width in (64, 128):
                for seed in (0, 1):
                    run = write_run(root / sweep, job, "mlp", eraser, width, 2, seed)
                    job += 1
                    if extra:
                        results = json.loads((run / "results.json").read_text())
                        results["config"]["paper"] = extra
                        results["paper_mdl"] += 1.0
                        write_checked_json(run / "results.json", results)
    return root


def test_a_folder_of_mixed_sweeps_gets_a_table_per_design(tmp_path: Path, drawn_figures, capsys):
    """The paper preset's lookup keys are not row keys: each design has its own table, rows keyed by width
    only (the key its sweep varied), and every panel title fits in two lines."""
    root = write_mixed_folder(tmp_path / "multirun")
    figures = drawn_figures(lambda: main([str(root), "--out", str(tmp_path / "out"), "--images", "0"]))
    designs = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert designs == ["design1_paper", "design2_shared_keys_only"], designs
    for design, control in (("design1_paper", 8.31), ("design2_shared_keys_only", 7.31)):
        table = read_csv(tmp_path / "out" / design / "table.csv")
        assert list(table[0])[:3] == ["architecture", "width", "eraser"], design
        assert len(table) == 4 and len(read_csv(tmp_path / "out" / design / "runs.csv")) == 8
        cell = find_row(table, architecture="mlp", width=64, eraser="none")
        assert float(cell["paper_mdl_mean"]) == pytest.approx(control), design
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Design 1: paper.*" in text and "## Design 2: shared keys only" in text
    assert "[Full report](design1_paper/report.md)" in text and "| architecture | width |" in text
    assert "2 designs" in capsys.readouterr().out
    titles = [ax.get_title() for _, fig in figures for ax in fig.axes if ax.get_title()]
    assert titles and max(t.count("\n") + 1 for t in titles) <= 2


def test_panel_titles_fit_in_two_lines():
    from mdl.report.style import MAX_TITLE_LINES, TITLE_WIDTH, panel_title

    setting = ", ".join(f"paper.lr_by_eraser.convnext.{e}=0.0001" for e in range(12))
    title = panel_title("convnext", setting)
    lines = title.split("\n")
    assert len(lines) == MAX_TITLE_LINES and all(len(line) <= TITLE_WIDTH for line in lines) and title.endswith("…")
    assert panel_title("mlp", "width=64") == "mlp: width=64" and panel_title("mlp") == "mlp"


@pytest.mark.slow
def test_rows_option_chooses_and_orders_the_row_keys(sweep_dir: Path, tmp_path: Path, capsys):
    """--rows sets the row keys in order; a key that still splits a pair must be named or --ignore'd."""
    out = tmp_path / "rows"
    assert main([str(sweep_dir), "--out", str(out), "--images", "0", "--rows", "depth,width"]) == 0
    assert list(read_csv(out / "table.csv")[0])[:4] == ["architecture", "depth", "width", "eraser"]
    assert main([str(sweep_dir), "--out", str(out), "--images", "0", "--rows", "width"]) == 2
    assert "also differ in depth: add it to --rows, or --ignore depth" in capsys.readouterr().err
    assert main([str(sweep_dir), "--out", str(out), "--images", "0", "--rows", "widht"]) == 2
    assert "did you mean width" in capsys.readouterr().err
    assert main([str(sweep_dir), "--out", str(out), "--images", "0", "--rows", "width", "--ignore", "depth"]) == 0
    assert {k for k in read_csv(out / "table.csv")[0]} >= {"architecture", "width", "eraser"}
    assert "depth" not in read_csv(out / "table.csv")[0]


# --- the lr search's report (conf/experiment/lr_search.yaml, mdl/report/lr.py) -------------------

LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2)


def write_lr_search(root: Path, max_epochs: int = 200) -> Path:
    """An lr search of two erasers x three seeds whose two lowest lrs hit the epoch cap in every run."""
    job = 0
    for eraser in ("none", "leace"):
        for lr in LR_GRID:
            for seed in (0, 1, 2):
                run = write_run(root, job, "mlp", eraser, 128, 2, seed)
                job += 1
                results = json.loads((run / "results.json").read_text())
                results["config"]["optimizer"] = {"lr": lr}
                results["config"]["trainer"] = {"kwargs": {"max_epochs": max_epochs}}
                epochs = 200 if lr < 3e-3 else 40  # the two lowest lrs run 200 epochs
                results["blocks"] = [{"n_train": 10, "n_eval": 10, "eval_bits": 12.0, "epochs": epochs}] * 3
                results["final_epochs"] = epochs
                results["paper_mdl"] = (math.log10(lr) + 2.5) ** 2 + (1.0 if eraser == "leace" else 0.0) + 0.01 * seed
                write_checked_json(run / "results.json", results)
    return root


def test_capped_fits_are_the_fits_that_reached_max_epochs():
    from mdl.results import capped_fits

    results = {
        "config": {"trainer": {"kwargs": {"max_epochs": 200}}},
        "blocks": [{"epochs": 200}, {"epochs": 12}],
        "final_epochs": 200,
    }
    assert capped_fits(results) == ["block 1", "the final fit"]
    assert capped_fits(results, max_epochs=300) == []
    assert capped_fits({**results, "config": {"trainer": {"kwargs": {"max_epochs": -1}}}}) == []  # until early stopping


def test_lr_search_draws_mdl_against_lr_and_flags_capped_fits(tmp_path: Path, drawn_figures):
    """The lr search's report: a figure of paper MDL against lr with a line per eraser in the style's colours, and
    the lrs whose runs hit trainer.kwargs.max_epochs flagged in the table and in words."""
    from matplotlib.colors import to_hex

    from mdl.report.style import ERASER_COLORS

    sweep = write_lr_search(tmp_path / "multirun")
    out = tmp_path / "out"
    figures = dict(drawn_figures(lambda: build_report([sweep], out, image_loader=None, echo=None)))
    (ax,) = [ax for ax in figures["lr_mlp.png"].axes if ax.get_visible()]
    assert ax.get_xscale() == "log" and "MDL" in ax.get_ylabel()
    lines = {to_hex(line.get_color()): list(line.get_xdata()) for line in ax.get_lines() if len(line.get_xdata()) > 1}
    assert lines == {to_hex(ERASER_COLORS["none"]): list(LR_GRID), to_hex(ERASER_COLORS["leace"]): list(LR_GRID)}
    assert "capped fits (under-trained)" in [t.get_text() for t in figures["lr_mlp.png"].legends[0].get_texts()]
    text = (out / "report.md").read_text()
    assert "](lr_mlp.png)" in text
    assert "| mlp | - | none | 0.003 | " in text and "| 0.0003: 3/3, 0.001: 3/3 |" in text
    assert (
        "**Capped fits** — some fits stopped at `trainer.kwargs.max_epochs` = 200 before early stopping ended them, "
        "at lr 0.0003: 6 of 6 runs; 0.001: 6 of 6 runs."
    ) in text


@pytest.mark.slow
def test_lr_search_without_capped_fits_says_nothing_of_caps(tmp_path: Path):
    sweep = write_lr_search(tmp_path / "multirun", max_epochs=1000)
    text = build_report([sweep], tmp_path / "out", image_loader=None, echo=None).read_text()
    assert "**Capped fits**" not in text and "| 0.003 | " in text and "| none |" in text
    for fmt in ("png", "pdf", "svg"):
        assert (tmp_path / "out" / f"lr_mlp.{fmt}").stat().st_size > 0


@pytest.mark.parametrize(
    "damage",
    [
        "hydra:\n  run: {dir: [",
        "[]",
        "hydra: {sweeper: {_target_: hydra._internal.core_plugins."
        "basic_sweeper.BasicSweeper}, overrides: {task: ['seed=0,,']}}",
    ],
)
def test_a_damaged_multirun_record_is_named_and_the_report_still_made(tmp_path: Path, caplog, damage: str):
    """A multirun.yaml cut short or garbled used to end `python -m mdl.report` in a yaml traceback."""
    from mdl.run.sweep_jobs import missing_jobs

    (tmp_path / "multirun.yaml").write_text(damage)
    assert missing_jobs([tmp_path]) == []
    assert f"{tmp_path / 'multirun.yaml'} is damaged" in caplog.text


def test_saving_a_pdf_figure_logs_nothing_at_info(tmp_path: Path, caplog):
    """Embedding Type 42 fonts runs fontTools' subsetter, which logs every table it prunes at INFO: under Hydra's
    logging about 60 lines at the end of every sweep. The report's style keeps them out."""
    import logging

    import matplotlib.pyplot as plt

    import mdl.report.style  # noqa: F401 - the style the report draws with

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0], label="LEACE")
    ax.set_title("a title")
    ax.legend()
    with caplog.at_level(logging.INFO):
        fig.savefig(tmp_path / "f.pdf")
    plt.close(fig)
    assert not [r for r in caplog.records if r.name.startswith("fontTools")], caplog.text[:500]
