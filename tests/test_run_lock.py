"""A run's lock: a second launch of the same config waits for a live holder, and stops with a
message naming a holder that no longer renews its lease (suspended by SIGSTOP, as Slurm's gang
scheduling does) instead of hanging for ever. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from mdl.run.storage import HOLDER_FILE, StalledLockHolder, read_holder, run_lock

HOLD = """
import sys, time
from pathlib import Path
from mdl.run.storage import run_lock
with run_lock(Path(sys.argv[1]), lease_s=float(sys.argv[2])):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def hold(store: Path, lease_s: float, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(store), str(lease_s), str(seconds)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.slow
def test_suspended_holder_is_named_not_waited_for_ever(tmp_path: Path) -> None:
    holder = hold(tmp_path, lease_s=1.0, seconds=120)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(StalledLockHolder) as err:
            with run_lock(tmp_path, lease_s=1.0):
                pytest.fail("took a lock held by a suspended process")
        waited = time.monotonic() - start
        message = str(err.value)
        assert f"pid {holder.pid}" in message and "mdl.lock_lease_s" in message and "kill -CONT" in message
        assert waited < 30, waited
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_live_holder_is_waited_for_past_the_lease(tmp_path: Path) -> None:
    """A holder that runs longer than the lease renews it: the waiter waits, then takes the lock."""
    holder = hold(tmp_path, lease_s=0.5, seconds=3)
    try:
        record, age = read_holder(tmp_path)
        assert record["pid"] == holder.pid and age is not None
        start = time.monotonic()
        with run_lock(tmp_path, lease_s=0.5):
            assert time.monotonic() - start > 2.0  # waited through six leases for the live holder
            assert read_holder(tmp_path)[0]["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / HOLDER_FILE).exists()  # released: no record left behind


@pytest.mark.slow
def test_a_waiter_with_a_shorter_lease_judges_the_holder_by_the_holders_lease(tmp_path: Path) -> None:
    """A holder renewing a 20 s lease beats every 2 s; a waiter with a 0.2 s lease used to call it "suspended or hung"
    within a second and suggest killing it."""
    holder = hold(tmp_path, lease_s=20.0, seconds=4)
    try:
        assert read_holder(tmp_path)[0]["lease_s"] == 20.0
        start = time.monotonic()
        with run_lock(tmp_path, lease_s=0.2):
            assert time.monotonic() - start > 2.0  # waited for the live holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # launch.py against a suspended holder (the lock's own message: the first test)
def test_stalled_holder_ends_launch_with_one_message(tmp_path: Path) -> None:
    """launch.py reports a stalled holder as `error: ...` with exit code 2, not a traceback or a hang."""
    from conftest import FAST, compose_config
    from mdl.run.identity import config_hash

    overrides = FAST + [f"paths.output_root={tmp_path}", "mdl.lock_lease_s=1"]
    store = Path(compose_config(overrides).paths.store_dir) / config_hash(compose_config(overrides))
    store.mkdir(parents=True)
    holder = hold(store, lease_s=1.0, seconds=120)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        done = subprocess.run(
            [sys.executable, "launch.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=300
        )
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: the run in" in done.stderr and f"pid {holder.pid}" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_dead_holders_leftover_record_is_not_blamed(tmp_path: Path) -> None:
    """A holder killed with SIGKILL leaves its record; while the live holder has not written its own yet, a
    waiter must not stop naming the dead one (its record looks stale from the start)."""
    import json

    from filelock import FileLock

    from mdl.run.storage import LOCK_FILE

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": __import__("socket").gethostname(), "pid": dead.pid, "slurm_job": None, "started": 0.0}
    (tmp_path / HOLDER_FILE).write_text(json.dumps(record))
    os.utime(tmp_path / HOLDER_FILE, (time.time() - 3600, time.time() - 3600))  # an hour old
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock; "
            "l = FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(3)",
            str(tmp_path / LOCK_FILE),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # holds, writes no record
    try:
        assert holder.stdout.readline().strip() == "held"
        with run_lock(tmp_path, lease_s=0.5):  # waits for the live holder instead of raising
            assert FileLock  # the lock is ours now
    finally:
        holder.kill()
        holder.wait()
