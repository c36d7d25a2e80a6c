"""The report of a sweep over both training loops (``protocol=original,sound``): a table per protocol, side by
side with the paper's values, and the blocks each left at the untrained model (mdl/report/protocols.py).

Runs are results.json files written here (as in test_report.py) with chosen paper MDL and per-block
``best_after_epochs`` (0: the kept weights are the untrained model), so every count is known by hand; one
end-to-end multirun (slow) checks that real runs record what the report counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST, run_launch, sweep_report
from test_report import read_csv, write_run

from mdl.results import write_checked_json
from mdl.report.build import build_report
from mdl.report.protocols import untrained_blocks
from mdl.report.sweep import load_sweep

RULES = {
    "original": {
        "block_rounding": "oric",
        "backtrack": True,
        "evaluate_as_trained": True,
        "reshuffle": False,
        "augment_per_batch": True,
    },
    "sound": {
        "block_rounding": "cumulative",
        "backtrack": False,
        "evaluate_as_trained": False,
        "reshuffle": True,
        "augment_per_batch": False,
    },
}


def protocol_run(
    root: Path, job: int, protocol: str, eraser: str, seed: int, mdl: float, kept: list[int | None]
) -> Path:
    """A results.json of ``protocol`` (conf/protocol/<name>.yaml's keys) whose blocks kept weights trained for
    ``kept`` epochs (0: the untrained model; None: not recorded, as runs from before the key)."""
    path = write_run(root, job, "mlp", eraser, 128, 2, seed) / "results.json"
    results = json.loads(path.read_text())
    results["config"]["protocol"] = {"name": protocol, **RULES[protocol]}
    results["config"]["data"] |= {"source": "digits", "zscore": False}
    results["blocks"] = [
        {
            "n_train": 10 * (i + 1),
            "n_eval": 10,
            "eval_bits": 30.0,
            "epochs": 5,
            **({} if k is None else {"best_after_epochs": k}),
        }
        for i, k in enumerate(kept)
    ]
    results["paper_mdl"] = mdl
    write_checked_json(path, results)
    return path


def two_protocol_sweep(root: Path) -> Path:
    """MLP, none and LEACE, 2 seeds, under both protocols; original LEACE leaves 3 + 2 of 6 blocks untrained."""
    sweep = root / "multirun"
    kept = {
        ("original", "none"): ([4, 5, 3], [2, 6, 1]),
        ("original", "leace"): ([0, 0, 0], [0, 3, 0]),
        ("sound", "none"): ([4, 4, 4], [5, 5, 5]),
        ("sound", "leace"): ([0, 2, 2], [3, 3, 3]),
    }
    mdl = {("original", "none"): 1.2, ("original", "leace"): 10.8, ("sound", "none"): 1.23, ("sound", "leace"): 8.8}
    job = 0
    for (protocol, eraser), per_seed in kept.items():
        for seed, blocks in enumerate(per_seed):
            protocol_run(sweep, job, protocol, eraser, seed, mdl[protocol, eraser] + 0.1 * seed, blocks)
            job += 1
    return sweep


def test_blocks_at_the_untrained_model_are_counted_from_best_after_epochs(tmp_path: Path):
    path = protocol_run(tmp_path, 0, "original", "leace", 0, 10.0, [0, 3, 0, 7])
    [run] = load_sweep([tmp_path]).runs
    assert untrained_blocks(run) == (2, 4)
    protocol_run(tmp_path / "old", 0, "sound", "leace", 0, 10.0, [0, None])  # a run from before the key
    [old] = load_sweep([tmp_path / "old"]).runs
    assert untrained_blocks(old) is None and path.exists()


@pytest.mark.slow
def test_two_protocols_get_a_table_each_beside_the_paper_and_their_untrained_blocks(tmp_path: Path):
    sweep = two_protocol_sweep(tmp_path)
    assert load_sweep([sweep]).row_keys == ["protocol.name"]  # not one row key per loop rule
    out = tmp_path / "report"
    text = build_report([sweep], out, image_loader=None, compare_to="table16").read_text()

    assert "## Protocols side by side" in text
    assert (
        "| architecture | eraser | paper MDL, original | blocks at the untrained model, original | paper MDL, sound "
        "| blocks at the untrained model, sound | paper |"
    ) in text
    assert (
        "| mlp | none | 1.25 ± 0.07 (n=2) | 0 of 6 (0, 0) | 1.28 ± 0.07 (n=2) | 0 of 6 (0, 0) "
        "| 7.14 ± 0.05 (CIFAR-10 z-scored) |"
    ) in text
    assert (
        "| mlp | leace | 10.85 ± 0.07 (n=2) | 5 of 6 (3, 2) | 8.85 ± 0.07 (n=2) | 1 of 6 (1, 0) "
        "| 8.49 ± 0.10 (CIFAR-10 z-scored) |"
    ) in text
    for protocol, row in (
        ("original", "| mlp | 1.25 ± 0.07 (n=2) | 10.85 ± 0.07 (n=2) |"),
        ("sound", "| mlp | 1.28 ± 0.07 (n=2) | 8.85 ± 0.07 (n=2) |"),
    ):
        section = text.split(f"### protocol={protocol}\n", 1)[1].split("###", 1)[0]
        assert "| architecture | none | leace |" in section and row in section
    original = text.split("### protocol=original\n", 1)[1].split("### protocol=sound", 1)[0]
    assert "| mlp | 0 of 6 (0, 0) | 5 of 6 (3, 2) |" in original
    # beside the paper's value
    assert "| digits → cifar10+zscore | mlp | leace | 10.85 ± 0.07 (n=2) | 8.49 ± 0.10 (n=5) | +2.36 |" in original
    by_run = {
        (r["protocol.name"], r["eraser"], r["seed"]): r["blocks_at_untrained"] for r in read_csv(out / "runs.csv")
    }
    assert by_run[("original", "leace", "data_seed=0,seed=0")] == "3"
    assert by_run[("sound", "leace", "data_seed=1,seed=1")] == "0"
    # the comparison with the paper keeps a row per protocol
    assert len(read_csv(out / "paper_comparison.csv")) == 4


def test_protocols_of_two_code_versions_line_up_side_by_side(tmp_path: Path):
    """protocol=sound runs reused from an earlier sweep (another code version) beside protocol=original runs made
    now: cells stay split by version, but the side-by-side table pairs them, each with its version."""
    for job, (protocol, version, mdl) in enumerate(
        (("original", "bbbbbbbbbbbb", 10.0), ("sound", "aaaaaaaaaaaa", 8.0))
    ):
        path = protocol_run(tmp_path, job, protocol, "leace", 0, mdl, [0, 1])
        results = json.loads(path.read_text())
        results["code_version"] = version
        write_checked_json(path, results)
    text = build_report([tmp_path], tmp_path / "report", image_loader=None).read_text()
    assert (
        "| mlp | leace | 10.00 ± n/a (n=1) [bbbbbbbbbbbb] | 1 of 2 | 8.00 ± n/a (n=1) [aaaaaaaaaaaa] | 1 of 2 | — |"
        in text
    )
    assert "| architecture | code_version | leace |" in text.split("### protocol=sound", 1)[1]  # the cells keep it


def test_a_loop_rule_swept_within_one_protocol_stays_a_row_key(tmp_path: Path):
    """protocol=original protocol.backtrack=true,false: the rule is what the sweep varied, so it keys the rows."""
    for job, backtrack in enumerate((True, False)):
        path = protocol_run(tmp_path, job, "original", "leace", 0, 10.0, [0, 1])
        results = json.loads(path.read_text())
        results["config"]["protocol"]["backtrack"] = backtrack
        write_checked_json(path, results)
    assert load_sweep([tmp_path]).row_keys == ["protocol.backtrack"]


def test_one_protocol_gets_no_protocol_section(tmp_path: Path):
    sweep = tmp_path / "multirun"
    for seed in (0, 1):
        protocol_run(sweep, seed, "sound", "leace", seed, 8.8, [0, 2])
    assert load_sweep([sweep]).row_keys == []
    text = build_report([sweep], tmp_path / "report", image_loader=None).read_text()
    assert "Protocols side by side" not in text
    assert read_csv(tmp_path / "report" / "runs.csv")[0]["blocks_at_untrained"] == "1"


def test_unrecorded_blocks_read_not_available(tmp_path: Path):
    sweep = tmp_path / "multirun"
    protocol_run(sweep, 0, "original", "leace", 0, 10.0, [None, None])
    protocol_run(sweep, 1, "sound", "leace", 0, 9.0, [0, 1])
    text = build_report([sweep], tmp_path / "report", image_loader=None).read_text()
    assert "| mlp | leace | 10.00 ± n/a (n=1) | n/a | 9.00 ± n/a (n=1) | 1 of 2 | — |" in text
    assert "none matches these runs' data set" in text


@pytest.mark.slow
@pytest.mark.slow  # a sweep through launch.py (reports of both protocols in process: above)
def test_a_two_protocol_multirun_reports_both(tmp_path: Path):
    """A real sweep over both loops: its report has the two tables, with counts read from the runs' blocks."""
    proc = run_launch(
        [
            "-m",
            "protocol=original,sound",
            "report=table16",
            "hydra.callbacks.report.images=0",
            f"paths.output_root={tmp_path}",
            *FAST,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = sweep_report(tmp_path)
    text = report.read_text()
    assert "## Protocols side by side" in text and "### protocol=original" in text and "### protocol=sound" in text
    runs = read_csv(report.parent / "runs.csv")
    assert sorted(r["protocol.name"] for r in runs) == ["original", "sound"]
    assert all(r["blocks_at_untrained"].isdigit() for r in runs)
