"""Long data work that a signal can stop at once: the source load, eraser fit, diagnostics and cache build.

A run's SIGTERM handler (mdl.engine.preemption) raises in the main thread, but only between two Python
steps: one LAPACK call at CIFAR-10's size (an eigh of a 3072 x 3072 float64 matrix) took 77 s on a busy 2-core
machine, and Slurm kills 30 s after SIGTERM. ``interruptible`` runs the work in a worker thread while the main
thread waits in short joins, so the handler's exception ends the wait at once; the work is abandoned (its
cache writes are renames, so nothing half-written is ever read; a temporary is removed by the next start,
datamodules.cache). The process must then end without waiting for the worker: ``abandoned`` says so
(mdl.run.exits ends it with ``os._exit``). Everything else (results, numbers, warnings, logs) is as if the
work ran in the main thread: torch's and numpy's random state and thread settings are process-wide, and the worker
runs in a copy of the caller's context (its context variables: a pack's line owners, mdl.run.job_logs).

Work that can resume (an eraser fit that keeps its partial state, datamodules.fit_progress) registers a save with
``saved_if_abandoned``: the main thread runs it before the exception goes on, so the stop keeps the last finished
step.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
JOIN_S = 0.1  # how often the main thread lets a signal handler run while it waits

_abandoned = threading.Event()
_saves: list[Callable[[], None]] = []  # what the main thread saves when it abandons the work (saved_if_abandoned)


def interruptible(work: Callable[[], T]) -> T:
    """``work()``, run so that a signal handler's exception in the main thread ends it at once (see above)."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    outcome: dict[str, Any] = {}
    device = _cuda_device()
    context = contextvars.copy_context()  # the caller's context variables (e.g. which job's log a line goes to)

    def run() -> None:
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)  # the current device is per thread
            outcome["value"] = context.run(work)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which raises it
            outcome["error"] = err

    worker = threading.Thread(target=run, name="data-preparation", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(JOIN_S)
    except BaseException:
        _abandoned.set()
        _save_before_leaving()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _save_before_leaving() -> None:
    """Run the registered saves; one that fails (a second signal, a full disk) is logged: the stop goes on."""
    for save in list(_saves):
        try:
            save()
        except Exception as err:  # noqa: BLE001 - the signal's exception is the one to raise
            log.warning("stopping: could not save the work's progress (%s)", err)


@contextmanager
def saved_if_abandoned(save: Callable[[], None]) -> Iterator[None]:
    """While inside (in the worker), a signal that abandons the work first runs ``save()`` in the main thread."""
    _saves.append(save)
    try:
        yield
    finally:
        _saves.remove(save)


def abandoned() -> bool:
    """Whether a signal stopped data work that is still running in a worker thread (the process must not wait)."""
    return _abandoned.is_set()


def _cuda_device() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
