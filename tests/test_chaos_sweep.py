"""scripts/chaos_sweep.py run small: a local and a packed sweep, killed, terminated, starved of disk, locked by a
stopped process, their cache and records damaged at seeded moments, relaunched until done, end with every run's
numbers and CSV series bit-identical to the undisturbed sweep's, nothing lost and nothing hung."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, python_path


@pytest.mark.slow
def test_a_small_chaos_sweep_ends_bit_identical_with_nothing_lost_or_hung(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos_sweep.py"), "--jobs", "4", "--faults", "6", "--seed", "0"]
        + ["--workdir", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1] == "4 of 4 runs bit-identical, 0 records lost, 0 hangs", (
        done.stdout[-4000:] + done.stderr[-3000:]
    )
    assert done.returncode == 0, done.stdout[-4000:]  # every fault ended in a clean message or a silent recovery
    assert "faults injected" in done.stdout and "problem" not in done.stdout.split("faults injected")[1]
