"""How a job ends when it cannot finish, the same for a single run (launch.py) and every job of a packed
launcher (hydra_plugins/mdl_packed/): a setting or a file to change prints one ``error:`` line and exits 2; a
preemption (SIGTERM, mdl.engine.preemption) prints the ``preempted:`` line and exits 143, so Slurm, submitit
and a sweep see a failed job and nothing later in the process starts. Anything else is a bug and keeps its
traceback. Light (no torch): Hydra imports the launchers' plugin module in every process that composes a config.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from mdl.engine.preemption import EXIT_CODE, Preempted

# Errors that mean "change a setting or a file", reported as one message without a traceback
# (set MDL_TRACEBACK=1 to see it anyway); with mdl.run.storage's StalledLockHolder (``user_errors``).
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, OSError, ImportError, FloatingPointError)
ERROR_EXIT = 2


def user_errors() -> tuple[type[BaseException], ...]:
    from mdl.run.storage import StalledLockHolder  # imports torch: only once an error is on its way

    return (*USER_ERRORS, StalledLockHolder)


def end_now_if_work_was_abandoned(code: int) -> None:
    """Data work stopped by the signal still runs in a worker thread (datamodules.interrupts), inside a LAPACK
    call that the interpreter's shutdown would wait for or crash in: end the process at once. Nothing is lost:
    the run's data come before its loggers and trainer, finished runs and blocks are saved, the cache is written by
    renames; only exit hooks (an earlier pack's logger's) do not run."""
    if "datamodules.interrupts" not in sys.modules or not sys.modules["datamodules.interrupts"].abandoned():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def preempted_line(err: Preempted) -> str:
    return f"preempted: {err}. Run the same command again to resume."


@contextmanager
def ends_like_a_run() -> Iterator[None]:
    """Turn a preemption or a user error raised inside into the entry point's message and exit status
    (``SystemExit``, which Hydra's job runners pass on instead of recording a failed job)."""
    try:
        yield
    except Preempted as err:
        print(preempted_line(err), file=sys.stderr, flush=True)
        end_now_if_work_was_abandoned(EXIT_CODE)
        sys.exit(EXIT_CODE)
    except user_errors() as err:
        if os.environ.get("MDL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT)
