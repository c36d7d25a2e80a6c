"""SIGTERM, Slurm's preemption and time-limit signal: checkpoint, say so, exit non-zero.

Lightning turns SIGTERM into ``SystemExit(None)`` at the next batch: exit status 0, no message, no
checkpoint, and a sweep that reports success. Instead, for the whole of a run (``sigterm_guard``):

- outside a fit (loading data, fitting the eraser, scoring a block) SIGTERM raises ``Preempted`` at
  once: every finished block is already in progress.json and cache writes are atomic (the data's
  preparation runs in a worker thread that is abandoned, datamodules.interrupts: one LAPACK call
  there can outlast Slurm's grace; a QLEACE fit's last finished step is saved first, and the re-run
  resumes it, datamodules.fit_progress);
- inside a fit that checkpoints (``SaveLastCheckpoint``, mdl.engine.trainer) the fit trains on to its
  next checkpoint point (the longest member's next epoch end, where the pass ends early: datamodules.stacked_batches), writes
  a checkpoint there whatever ``mdl.checkpoint_every_s`` says, then raises ``Preempted``.

A packed launcher (hydra_plugins/mdl_packed/) holds one guard over its whole sweep: the runs' guards inside it
share its request, so a SIGTERM during one pack stops the sweep there and no later pack starts.

launch.py (and every packed job, mdl.run.exits) turns ``Preempted`` into a message and exit status
``EXIT_CODE`` (128 + 15, the shell's status for SIGTERM), so Slurm, submitit and a multirun see a failed
job. Re-running the same command resumes from the checkpoint. Slurm's grace period between SIGTERM and SIGKILL (KillWait, often 30 s)
must cover one epoch for nothing to be lost; otherwise the last periodic checkpoint is the fallback.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger(__name__)
EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """The job was asked to stop (SIGTERM) and stopped with its progress saved."""


def interruption(err: BaseException) -> str | None:
    """What stopped a run that the same command resumes, in words, or None for an error: a SIGTERM (``Preempted``),
    a Ctrl-C (``KeyboardInterrupt``, or the ``SystemExit(1)`` that Lightning raises instead of one inside a fit,
    lightning.pytorch.trainer.call._call_and_handle_interrupt). Its finished blocks and checkpoints are kept."""
    if isinstance(err, Preempted):
        return "SIGTERM (preemption or time limit)"
    if isinstance(err, KeyboardInterrupt):
        return "Ctrl-C"
    if isinstance(err, SystemExit) and err.code == 1 and isinstance(err.__context__, KeyboardInterrupt):
        return "Ctrl-C"
    return None


class _State:
    active = False  # inside sigterm_guard (a run launched through run_experiment)
    requested = False  # a SIGTERM arrived during this run
    deferred = False  # inside a checkpointing fit: stop at its next checkpoint, not here
    previous: Any = signal.SIG_DFL  # the handler before the run's (e.g. submitit's, which logs)


_state = _State()


def sigterm_requested() -> bool:
    return _state.requested


def _on_sigterm(signum: int, frame: Any) -> None:
    first = not _state.requested
    _state.requested = True
    if callable(_state.previous):
        _state.previous(signum, frame)
    if _state.deferred:
        if first:
            log.warning("SIGTERM received: checkpointing at the end of this epoch, then stopping")
        return
    if not first:  # the same request again (a process group's kill and a launcher passing it on): already stopping
        return
    raise Preempted("SIGTERM received (preemption or time limit): stopped; finished blocks are saved")


@contextmanager
def sigterm_guard() -> Iterator[None]:
    """Handle SIGTERM as this module says for the duration of a run (main thread only: elsewhere
    Python cannot install signal handlers, and the signal goes to the main thread anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _state.active:  # inside a sweep's guard: one request for the whole sweep, never cleared by a later run
        stop_if_requested("before this run started")
        yield
        return
    _state.requested, _state.deferred, _state.active = False, False, True
    _state.previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _state.previous if _state.previous is not None else signal.SIG_DFL)
        _state.deferred, _state.active = False, False


def defer_until_checkpoint() -> None:
    """Called when a checkpointing fit starts: a SIGTERM from now on waits for its next checkpoint.
    Lightning has just put its own handler in place (which would stop the fit at the next batch with
    exit status 0); ours replaces it for the fit. Lightning's teardown puts the run's handler back."""
    if not _state.active or threading.current_thread() is not threading.main_thread():
        return  # a fit outside a run (a benchmark, a test) keeps Lightning's handling
    if _state.requested:
        raise Preempted("SIGTERM received before this fit started: stopped; finished blocks are saved")
    _state.deferred = True
    signal.signal(signal.SIGTERM, _on_sigterm)


def stop_if_requested(where: str) -> None:
    """Between steps that SIGTERM cannot interrupt usefully (a sweep's jobs, an eraser's iterations): stop here if
    it arrived."""
    if _state.active and _state.requested:
        raise Preempted(f"SIGTERM received (preemption or time limit): stopped {where}; finished blocks are saved")


def end_deferral() -> None:
    _state.deferred = False


def stop_after_checkpoint(where: str) -> None:
    """Called right after a checkpoint is written: stop there if SIGTERM arrived."""
    if _state.active and _state.requested:
        _state.deferred = False
        raise Preempted(f"SIGTERM received (preemption or time limit): checkpointed at {where} and stopped")
