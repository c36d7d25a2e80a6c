"""Each job's own log file in a process that trains several jobs together (a pack, ``hydra/launcher=packed``).

Hydra writes a job's lines to its folder's log file (``launch.log``) while the job's task runs; the packed launcher's
task only checks the job, and the pack trains every job after all of them were checked. So the pack opens each job's
file again (``job_log_files``), and every line goes to the file of the job it belongs to: the jobs named by the
innermost ``own_lines`` around it, or, outside any, every job of the pack (a line of the whole pack: its fit, a
resume). Light on purpose (no torch): the launcher imports it before the heavy imports.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

_owners: ContextVar[frozenset[str] | None] = ContextVar("mdl_job_log_owners", default=None)


@dataclass(frozen=True)
class LogFile:
    """A log file and how its lines are formatted."""

    path: Path
    formatter: logging.Formatter | None = None


def current_log_files() -> tuple[LogFile, ...]:
    """The files the root logger writes to now: inside a Hydra job's task, that job's own log file."""
    return tuple(
        LogFile(Path(h.baseFilename), h.formatter)
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler)
    )


@contextmanager
def own_lines(*jobs: str) -> Iterator[None]:
    """Lines logged inside belong to these jobs (by key; several: e.g. the data module that runs share)."""
    token = _owners.set(frozenset(jobs))
    try:
        yield
    finally:
        _owners.reset(token)


def owned_by(jobs: Sequence[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose lines belong to these jobs wherever it is called (a hook the engine calls for one run of a fit)."""

    @wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with own_lines(*jobs):
            return fn(*args, **kwargs)

    return call


class _OwnedBy(logging.Filter):
    """Passes the lines of one job and the lines that belong to no job in particular."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def filter(self, record: logging.LogRecord) -> bool:
        owners = _owners.get()
        return owners is None or self.job in owners


@contextmanager
def job_log_files(files: dict[str, Sequence[LogFile]]) -> Iterator[None]:
    """Each job's log files (by job key) appended to while inside, each with that job's lines only."""
    root = logging.getLogger()
    handlers = []
    for job, paths in files.items():
        for log_file in paths:
            handler = logging.FileHandler(log_file.path)
            if log_file.formatter is not None:
                handler.setFormatter(log_file.formatter)
            handler.addFilter(_OwnedBy(job))
            root.addHandler(handler)
            handlers.append(handler)
    try:
        yield
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
