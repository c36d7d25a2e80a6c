"""Where a run writes: checked up front, one process per run at a time.

A read-only or full output folder is reported before any work with the folder and the setting
that moves it, instead of as an OSError after the eraser fit. Two processes started with the
same config (a re-submitted sweep, a double click) share one run-store folder: a lock file there
makes the second wait for the first, then skip its finished result or resume its progress; they
never train the same blocks at once or write the same checkpoint.
"""

from __future__ import annotations

import functools

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback

from mdl.results import atomic_write_json, read_json

log = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def storage_error(folder: Path, setting: str, err: OSError) -> OSError:
    """An OSError whose message names the folder, the cause and the setting that moves it."""
    if err.errno in NO_SPACE:
        return type(err)(
            err.errno,
            f"cannot write to {folder}: the disk is full. Free space or choose another folder with {setting}=<dir>",
        )
    return type(err)(
        err.errno,
        f"cannot write to {folder}: it is not writable ({err.strerror or err}). Choose another folder "
        f"with {setting}=<dir>",
    )


def require_writable(folder: Path, setting: str) -> None:
    """Create ``folder`` and write (then remove) a small probe file there."""
    probe = folder / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
    except OSError as err:
        raise storage_error(folder, setting, err) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


HOLDER_FILE = "run.lock.holder.json"  # who holds the lock; its modification time is the holder's heartbeat


class StalledLockHolder(RuntimeError):
    """The process holding a run's lock stopped renewing its lease (suspended or hung)."""


def lock_holder(lease_s: float | None = None) -> dict[str, Any]:
    """What identifies this process to someone waiting for its lock: host, pid, Slurm job, start time, and the
    lease it renews (a waiter judges the heartbeat by it, whatever its own mdl.lock_lease_s)."""
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm and os.environ.get("SLURM_ARRAY_TASK_ID"):
        slurm = f"{os.environ.get('SLURM_ARRAY_JOB_ID', slurm)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job": slurm,
        "started": time.time(),
        "lease_s": lease_s,
    }


def holder_lease(holder: dict[str, Any], lease_s: float) -> float:
    """The lease the holder renews, as it recorded it; a record without one (older code): the waiter's own."""
    recorded = holder.get("lease_s")
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)) or not recorded > 0:
        return lease_s
    return float(recorded)


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (it left no holder record: an older version of this code?)"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, started {started}"


def read_holder(store: Path) -> tuple[dict[str, Any] | None, float | None]:
    """The holder record and the age of its heartbeat in seconds (None, None when there is none)."""
    path = store / HOLDER_FILE
    try:
        age = time.time() - path.stat().st_mtime
        return read_json(path), age
    except (OSError, ValueError):
        return None, None


def lock_is_held(store: Path, lease_s: Any = None) -> bool:
    """Whether a process holds the run's lock now, as its holder record says (python -m mdl.runs: running, or
    interrupted): the record is there, its heartbeat is younger than the lease it renews (``lease_s``, the run's
    mdl.lock_lease_s, for a record that does not say) and, on this host, its process exists. A record left by a
    killed holder is gone stale or names a dead process."""
    holder, age = read_holder(store)
    if not isinstance(holder, dict) or age is None:
        return False
    usable = isinstance(lease_s, (int, float)) and not isinstance(lease_s, bool) and lease_s > 0
    lease = holder_lease(holder, float(lease_s) if usable else 0.0)
    return age <= lease and not _dead_here(holder)


def _dead_here(holder: dict[str, Any]) -> bool:
    """Whether the record's process ran on this host and no longer exists (its record is a leftover)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class Heartbeat:
    """Touches the holder record every ``interval`` seconds from a daemon thread. A suspended
    process (SIGSTOP, Slurm's gang scheduling) stops its threads too, so the heartbeat ages."""

    def __init__(self, path: Path, interval: float) -> None:
        self.path, self.interval = path, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):  # a full or vanished disk must not kill the run
                os.utime(self.path)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class NotEnoughRoom(OSError):
    """Too little free space for a run, found before it trains (its message is complete)."""


class OutputRootCheck(Callback):
    """Hydra callback: check ``paths.output_root`` before Hydra creates the run or sweep folder in it,
    so a read-only, full or missing root (or a regular file) reads as one message, not Hydra's traceback."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        root = Path(str(config.paths.output_root))
        try:
            if root.exists() and not root.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR,
                    f"paths.output_root={root} is a file, not a folder; choose a folder with paths.output_root=<dir>",
                )
            require_writable(root, "paths.output_root")
        except OSError as err:
            print(f"error: {err.strerror or err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    on_multirun_start = on_run_start  # the same check before a sweep's folder is made


def require_space(folder: Path, needed_bytes: int, what: str, setting: str) -> None:
    """Fail before training when ``folder``'s file system has less room than ``needed_bytes``
    (e.g. the checkpoints' estimated size), instead of at the first checkpoint."""
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise NotEnoughRoom(
            errno.ENOSPC,
            f"not enough room in {folder}: {what} need about {needed_bytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are "
            f"free. Free space or choose another folder with {setting}=<dir>",
        )


def no_space_error(err: OSError, folders: tuple[Path, ...], setting: str) -> OSError | None:
    """A full disk met while writing under ``folders`` (checkpoints, results), as one message naming the
    folder, the setting and what is kept; None for any other error (a cache folder reports its own)."""
    if err.errno not in NO_SPACE or isinstance(err, NotEnoughRoom):
        return None
    where = Path(err.filename) if err.filename else None
    if where is not None and not any(where.is_relative_to(f) for f in folders):
        return None
    message = storage_error(where.parent if where else folders[0], setting, err).strerror
    return OSError(err.errno, f"{message}; the run resumes from its last checkpoint when launched again")


@contextlib.contextmanager
def run_lock(store: Path, lease_s: float = 300.0) -> Iterator[None]:
    """Hold the run's lock; if another process holds it, name it and wait for it.

    The holder renews a lease (``mdl.lock_lease_s``, recorded in its holder record) by touching the record. A
    waiter whose holder's heartbeat is older than the holder's lease stops waiting with StalledLockHolder, naming the
    holder and what to do, instead of hanging for ever; it never takes the lock over, since a
    suspended holder may be resumed and would then write the same run at the same time."""
    lock = FileLock(str(store / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _wait_for(lock, store, lease_s)
    try:
        atomic_write_json(store / HOLDER_FILE, lock_holder(lease_s))
        with Heartbeat(store / HOLDER_FILE, interval=max(lease_s / 10, 0.05)):
            yield
    finally:
        with contextlib.suppress(OSError):
            (store / HOLDER_FILE).unlink()
        lock.release()


def _wait_for(lock: FileLock, store: Path, lease_s: float) -> None:
    holder, _ = read_holder(store)
    log.warning("%s is running this config (%s); waiting for it to finish", describe_holder(holder), store / LOCK_FILE)
    first_seen: dict[tuple, float] = {}  # record -> when this waiter first saw it
    while True:
        try:
            lock.acquire(timeout=min(lease_s / 4, 5.0))
            return
        except Timeout:
            holder, age = read_holder(store)
            if holder is None or age is None:
                continue
            key = (holder.get("host"), holder.get("pid"), holder.get("started"))
            # a record left by a killed holder is old before the live holder has written its own: age counts
            # from when this waiter first saw the record, and a dead holder on this host is not blamed
            age = min(age, time.monotonic() - first_seen.setdefault(key, time.monotonic()))
            lease = holder_lease(holder, lease_s)  # a holder renewing a longer lease beats less often: not hung
            if age > lease and not _dead_here(holder):
                raise StalledLockHolder(
                    f"the run in {store} is locked by {describe_holder(holder)}, whose heartbeat stopped {age:.0f} s "
                    f"ago (its mdl.lock_lease_s={lease:g}): it is suspended (SIGSTOP, Slurm gang scheduling) or hung. "
                    f"Resume it (kill -CONT <pid>, scontrol resume <job>) or end it (kill <pid>, scancel <job>): "
                    f"its checkpoints are resumed by the next launch. This launch waits no longer."
                ) from None


MAX_JOB_DIRNAME = 120  # bytes of a job folder's name kept readable; file systems allow 255 per name


def job_dirname(num: Any, overrides: str) -> str:
    """A multirun job's folder name, ``<num>_<overrides>``; overrides longer than ``MAX_JOB_DIRNAME``
    are cut and end in a hash of the whole string, so the name stays unique and under the file
    system's 255-byte limit (long values, e.g. several extensions combined in one sweep, failed with
    ENAMETOOLONG). Slashes are written %2F. The full overrides are in the job's .hydra/overrides.yaml
    and results.json."""
    overrides = overrides.replace("/", "%2F")  # a value holding a path would nest folders (one job, one folder)
    name = f"{num}_{overrides}" if overrides else str(num)
    if len(name.encode()) <= MAX_JOB_DIRNAME:
        return name
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:12]
    head = name.encode()[: MAX_JOB_DIRNAME - len(digest) - 1].decode(errors="ignore")
    return f"{head}~{digest}"


def register_resolvers() -> None:
    """OmegaConf resolvers the configs use (conf/config.yaml's hydra.sweep.subdir, conf/hydra/help/mdl.yaml); idempotent."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("job_dirname"):
        OmegaConf.register_new_resolver("job_dirname", job_dirname)
    if not OmegaConf.has_resolver("mdl_help"):  # conf/hydra/help/mdl.yaml: python launch.py --help
        OmegaConf.register_new_resolver("mdl_help", _help_text)


@functools.cache
def _help_text() -> str:
    """``--help``'s page. OmegaConf resolves the template whenever Hydra merges its config (at every compose), and the
    page reads every config group (0.09 CPU-s): built only when ``--help`` or ``-h`` asked for it."""
    if not {"--help", "-h"} & set(sys.argv[1:]):
        return "python launch.py --help"
    from mdl.run.help import help_text

    return help_text().replace("$", "$$")  # Hydra's template substitution
