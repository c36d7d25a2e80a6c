"""Where a run writes: checked up front, one process per run at a time.

A read-only or full output folder is reported before any work with the folder and the setting
that moves it, instead of as an OSError after the eraser fit. Two processes started with the
same config (a re-submitted sweep, a double click) share one run-store folder: a lock file there
makes the second wait for the first, then skip its finished result or resume its progress; they
never train the same blocks at once or write the same checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def storage_error(folder: Path, setting: str, err: OSError) -> OSError:
    """An OSError whose message names the folder, the cause and the setting that moves it."""
    cause = "the disk is full" if err.errno in NO_SPACE else f"it is not writable ({err.strerror or err})"
    return type(err)(err.errno, f"cannot write to {folder}: {cause}. Free space or choose another folder with {setting}=<dir>")


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


@contextlib.contextmanager
def run_lock(store: Path) -> Iterator[None]:
    """Hold the run's lock; if another process holds it, say so and wait for it."""
    lock = FileLock(str(store / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another process is running this config (%s); waiting for it to finish", store / LOCK_FILE)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
    """OmegaConf resolvers the configs use (conf/config.yaml's hydra.sweep.subdir); idempotent."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("job_dirname"):
        OmegaConf.register_new_resolver("job_dirname", job_dirname)
