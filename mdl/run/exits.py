"""How a job ends when it cannot finish, the same for a single run (launch.py) and every job of a packed
launcher (hydra_plugins/mdl_packed/): a setting or a file to change prints one ``error:`` line and exits 2; a
preemption (SIGTERM, mdl.engine.preemption) prints the ``preempted:`` line and exits 143, so Slurm, submitit
and a sweep see a failed job and nothing later in the process starts; a Ctrl-C prints the ``interrupted:`` line and
exits 130 (the shell's status for it). Both lines give the command that resumes the run: this one, again. Anything
else is a bug and keeps its traceback. Light (no torch): Hydra imports the launchers' plugin module in every process
that composes a config.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from mdl.engine.preemption import EXIT_CODE, Preempted, interruption

# Errors that mean "change a setting or a file", reported as one message without a traceback
# (set MDL_TRACEBACK=1 to see it anyway); with mdl.run.storage's StalledLockHolder (``user_errors``).
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, OSError, ImportError, FloatingPointError)
ERROR_EXIT = 2
INTERRUPT_EXIT = 128 + signal.SIGINT  # 130: a Ctrl-C, as the shell reports it


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


def launch_command(overrides: Sequence[str]) -> str:
    """The command that runs the run of these overrides, and resumes it once interrupted (python -m mdl.runs)."""
    return shlex.join(["python", "launch.py", *overrides])


def this_command() -> str:
    """The command to type again: this process's (``python launch.py -m ...``); in a job a launcher started in a
    process of its own (submitit's, locally or on Slurm), ``python launch.py`` with the job's overrides, which
    resumes that run (the process's own command line is submitit's)."""
    if Path(sys.argv[0]).name != "launch.py":
        overrides = job_overrides()
        if overrides is not None:
            return launch_command(overrides)
    return shlex.join(["python", *sys.argv])


def job_overrides() -> list[str] | None:
    """The overrides of the Hydra job this process runs, or None outside one."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def preempted_line(err: Preempted) -> str:
    return f"preempted: {err}. Run the same command again to resume. Command: {this_command()}"


def interrupted_line(what: str) -> str:
    return (
        f"interrupted: {what}: stopped; finished blocks and the last checkpoint are kept. "
        f"Run the same command again to resume. Command: {this_command()}"
    )


@contextmanager
def ends_like_a_run() -> Iterator[None]:
    """Turn a preemption, a Ctrl-C or a user error raised inside into the entry point's message and exit status
    (``SystemExit``, which Hydra's job runners pass on instead of recording a failed job)."""
    try:
        yield
    except Preempted as err:
        print(preempted_line(err), file=sys.stderr, flush=True)
        end_now_if_work_was_abandoned(EXIT_CODE)
        sys.exit(EXIT_CODE)
    except (KeyboardInterrupt, SystemExit) as err:
        what = interruption(err)
        if what is None:  # an exit on its way (e.g. an inner ends_like_a_run's)
            raise
        print(interrupted_line(what), file=sys.stderr, flush=True)
        end_now_if_work_was_abandoned(INTERRUPT_EXIT)
        sys.exit(INTERRUPT_EXIT)
    except user_errors() as err:
        if os.environ.get("MDL_TRACEBACK"):
            raise
        print(f"error: {named(err)}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT)


def named(err: BaseException) -> str:
    """A full disk met where no folder was named yet (a bare ``[Errno 28] No space left on device``): named as the
    store's own full-disk errors are, with the file and the setting that moves it."""
    from mdl.run.storage import NO_SPACE, storage_error

    if isinstance(err, OSError) and err.errno in NO_SPACE and err.strerror == os.strerror(err.errno):
        where = Path(err.filename).parent if err.filename else Path("the output folder")
        return str(storage_error(where, "paths.output_root", err))
    return str(err)
