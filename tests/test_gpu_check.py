"""scripts/gpu_check.py, the one command a GPU lease runs, kept alive between leases: its dry run on a CPU at toy
sizes runs every step and writes both records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, python_path

sys.path.insert(0, str(REPO / "scripts"))
from gpu_check import FIRST_CALL, LEASE, SECOND_CALL, STEPS, pytest_tally, trained_examples, training_seconds  # noqa: E402


def test_pytest_tally_counts_each_outcome_even_when_cut_short() -> None:
    output = (
        "tests/test_gpu.py::test_a[mlp] PASSED  [ 10%]\ntests/test_gpu.py::test_b FAILED  [ 20%]\n"
        "tests/test_x.py::test_c SKIPPED (no CUDA)  [ 30%]\n"
    )
    assert pytest_tally(output) == {
        "passed": 1,
        "failed": 1,
        "skipped": 1,
        "not_passed": ["tests/test_gpu.py::test_b"],
        "summary": "no summary line (cut short)",
    }
    assert (
        pytest_tally(output + "==== 1 failed, 1 passed, 1 skipped in 3.1s ====\n")["summary"]
        == "1 failed, 1 passed, 1 skipped in 3.1s"
    )


def test_trained_examples_counts_every_members_epochs() -> None:
    result = {
        "blocks": [{"n_train": 100, "epochs": 3}, {"n_train": 200, "epochs": 2}],
        "boundaries": [100, 200, 400],
        "final_epochs": 5,
    }
    assert trained_examples(result) == 100 * 3 + 200 * 2 + 400 * 5


def test_a_lease_runs_every_step_in_two_calls_that_each_fit_their_budget() -> None:
    """A lease is 15 minutes: a start and two calls of at most 420 s (the default --budget-s). The first call's steps
    fit it even when each runs to its cap; the second gives the GPU tests at least five minutes."""
    versions_and_wheels = 10  # the versions step and the wheels' install
    assert versions_and_wheels + sum(LEASE.caps_s[name] for name in FIRST_CALL if name != "versions") <= 420
    assert SECOND_CALL[:2] == ("versions", "pytest") and min(LEASE.caps_s["pytest"], 420 - versions_and_wheels) >= 300
    assert sorted(set(FIRST_CALL) | set(SECOND_CALL)) == sorted(STEPS)


def test_training_seconds_are_read_from_a_runs_log() -> None:
    log = (
        "[2026-11-28 05:47:15,106][datamodules.datamodule][INFO] - data digits: train 1197\n"
        "[2026-11-28 05:47:15,129][mdl.run.experiment][INFO] - run b908185aa6467fdb (fits: stacked) on cpu\n"
        "[2026-11-28 05:47:16,174][mdl.engine.ledger][INFO] - block 1/2: trained on 100\n"
        "[2026-11-28 05:47:18,235][mdl.engine.ledger][INFO] - final fit on 1197 examples\n"
        "[2026-11-28 05:47:19,243][mdl.run.experiment][WARNING] - block 1, the final fit stopped\n"
    )
    assert training_seconds(log) == pytest.approx(3.106)


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_its_records(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": python_path(), "PYTHON": sys.executable, "OUT": str(out)}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--work", str(tmp_path / "work")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    record = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in record["steps"]}
    assert tuple(steps) == STEPS, done.stdout[-3000:]
    failed = {name: (s["error"], s["tail"][-800:]) for name, s in steps.items() if not s["ok"]}
    assert not failed and done.returncode == 0, failed
    assert (
        steps["pytest"]["metrics"]["skipped"] > 0 and not steps["pytest"]["metrics"]["not_passed"]
    )  # no CUDA: skipped
    assert steps["mlp1024"]["metrics"]["ratio_all_over_1"]["training"] > 0
    for model in ("convnext", "swin"):  # the stack's compile time, cold and with the first job's cache
        assert set(steps[model]["metrics"]["stack_compile_s"]["fp32"]) == {"first_job", "second_job"}
    assert steps["pack"]["metrics"]["equal_to_the_bit"] is True and steps["pack"]["metrics"]["runs"] == 4
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")
    assert f"gpu check: {len(STEPS)} of {len(STEPS)} steps ok" in (out / "gpu_check.log").read_text()
