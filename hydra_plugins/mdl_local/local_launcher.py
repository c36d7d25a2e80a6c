"""``hydra/launcher=local``: hydra-submitit-launcher's local launcher, whose sweep ends as launch.py ends a run.

A job that stops for a SIGTERM (checkpointed, ``preempted:``, exit 143) or a setting to change (``error:``, exit 2)
leaves no result for submitit, which the plugin reports as an ``UncompletedJobError`` traceback with exit status 1.
Here the job's own last line is printed instead and the sweep exits with the job's status (mdl.run.exits), so
Slurm, a shell or a wrapper sees the same as for ``python launch.py``. A SIGTERM to the launching process itself
is recorded while it waits for its jobs and passed on to them (a plain ``kill <pid>`` reaches the launcher alone;
Slurm and a process group's kill reach every process, and a job takes a repeated SIGTERM as the same request), so
they checkpoint and stop, and the sweep ends as preempted.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

ENDINGS = re.compile(r"^(preempted|error): .*$", re.MULTILINE)  # launch.py's last words (mdl.run.exits)


class LocalLauncher(submitit_launcher.LocalLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import UncompletedJobError

        with sigterm_recorded() as requested:
            try:
                return super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError as err:
                ending = job_ending(str(err), bool(requested))
                if ending is None:
                    raise
        line, code = ending
        print(line, file=sys.stderr, flush=True)
        sys.exit(code)


def job_ending(message: str, sigterm: bool) -> tuple[str, int] | None:
    """The line and exit status a job that left no result ended with (from submitit's message, which holds its
    stderr): its own last words, the launcher's preemption, or a job killed outright (SIGKILL: submitit's traceback
    before); None for any other message."""
    from mdl.engine.preemption import EXIT_CODE
    from mdl.run.exits import ERROR_EXIT

    last = list(ENDINGS.finditer(message))[-1:]
    if last:
        return last[0].group(0), EXIT_CODE if last[0].group(1) == "preempted" else ERROR_EXIT
    if sigterm:
        return (
            "preempted: SIGTERM received (preemption or time limit): the sweep's jobs stopped. "
            "Run the same command again to resume.",
            EXIT_CODE,
        )
    killed = NO_RESULT.search(message)
    if killed:  # no result pickle: the job's process died before it could write one (a Python error writes one)
        job, folder = killed.group("job"), killed.group("result").rpartition("/")[0]
        return (
            f"error: job {job} of the sweep ended without a result or a message: it was killed (SIGKILL, the "
            f"out-of-memory killer) or its interpreter crashed; its logs are in {folder}. Run the same command again "
            "to resume: finished runs are skipped, interrupted ones resume from their checkpoints.",
            KILLED_EXIT,
        )
    return None


# submitit's UncompletedJobError for a job that left no result pickle
NO_RESULT = re.compile(r"^Job (?P<job>\S+) \(task: \d+\) with path (?P<result>\S+)\s+has not produced any output", re.M)
KILLED_EXIT = 1  # a failed job, not a setting to change (mdl.run.exits.ERROR_EXIT) nor a preemption


@contextmanager
def sigterm_recorded() -> Iterator[list[Any]]:
    """While the launcher waits for its jobs: a SIGTERM is recorded (the list gets an item), not fatal, and passed
    on to the running jobs, so the launcher reports how its jobs ended."""
    requested: list[Any] = []
    previous = signal.getsignal(signal.SIGTERM)

    def record(signum: int, frame: Any) -> None:
        requested.append(signum)
        pass_on_to_jobs(signum)

    signal.signal(signal.SIGTERM, record)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def pass_on_to_jobs(signum: int) -> None:
    """The signal sent to each running job's submitit controller (``python -m submitit.local._local``, a child of this
    process), which forwards it to the job's process. Linux: the children are read from /proc."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = stat.read_text().rsplit(")", 1)[1].split()[1]  # after "pid (name) state": the parent's pid
            command = (stat.parent / "cmdline").read_bytes()
            if parent == me and b"submitit.local._local" in command:
                os.kill(int(stat.parent.name), signum)
        except (OSError, IndexError):  # ended meanwhile
            continue
