"""The default CPU thread count: Slurm's allocation to the task, else one thread (a shared machine's
cores are not ours to fight over); never the load of the moment (it is part of a CPU run's identity)."""

from __future__ import annotations

import os

import pytest

from mdl.run.identity import allocated_cpus


def test_outside_slurm_the_default_is_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert allocated_cpus() == 1


def test_under_slurm_the_tasks_cpus_capped_by_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert allocated_cpus() == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(mine + 8))
    assert allocated_cpus() == mine  # no more threads than CPUs this process may run on
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "")
    assert allocated_cpus() == 1


def test_the_default_does_not_depend_on_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same answer whatever runs beside it: the run's identity must not change with the load."""
    import subprocess
    import sys

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        assert allocated_cpus() == 1
    finally:
        for p in busy:
            p.kill()
            p.wait()
