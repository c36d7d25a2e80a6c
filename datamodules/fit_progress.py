"""A resumable eraser fit's partial state on disk, next to its erasure cache entry, so a preemption costs at most the
work since the last save (erasure.resumable says what a fit offers and when).

At CIFAR-10's size a QLEACE fit is minutes of moment statistics and then tens of minutes of barycenter iterations on a
busy CPU (docs/slurm.md). ``PartialFit`` writes the state it is offered when ``eraser.checkpoint_every_s`` has passed
since its last write, and, when a SIGTERM abandons the fit (datamodules.interrupts), the last finished step in the main
thread before the run exits: a state the fit no longer changes (its moments once the pass is done, a barycenter
iterate). A stop inside the moments pass keeps its last periodic save (the running sums change in place). The file is
``<eraser key>.partial.safetensors`` (checksummed and written atomically as every cache file, datamodules.cache), read
by the next fit of the same key and removed by the cache once the eraser is stored. A damaged file is reported and the
fit starts over.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from datamodules.cache import CorruptCacheFile, read_checked, write_checked
from datamodules.interrupts import abandoned
from erasure.resumable import State

log = logging.getLogger(__name__)


class PartialFit:
    """The ``erasure.resumable.FitProgress`` of one eraser fit, kept in ``path``; writes at most every ``every_s``
    seconds (``clock``'s), and a stable state on ``save_latest`` (a SIGTERM)."""

    def __init__(self, path: Path, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.every_s, self.clock = path, every_s, clock
        self._lock = threading.Lock()  # one writer at a time: the fit's thread, or the main thread on a signal
        self._last_write = clock()
        self._step = 0  # boundaries offered so far
        self._written = 0  # the step of the state on disk (0: none written by this fit)
        self._latest: tuple[int, Callable[[], State]] | None = None  # the last stable state offered, and its step
        self.writes = 0

    def restore(self) -> State | None:
        """The state a stopped fit of the same key left, or None (no file, or a damaged one: reported)."""
        if not self.path.exists():
            return None
        try:
            state, meta = read_checked(self.path)
        except CorruptCacheFile as err:
            warnings.warn(f"partial eraser fit: {err}; fitting from the start", RuntimeWarning, stacklevel=2)
            return None
        self._step = self._written = int(meta.get("step", 0))  # the steps go on counting from the saved one
        log.info("resuming the eraser fit after its step %d, saved in %s", self._step, self.path)
        return state

    def offer(self, state: Callable[[], State], stable: bool) -> None:
        """Write ``state()`` when ``every_s`` has passed or the fit was abandoned; keep it for ``save_latest`` when it
        is ``stable``. An abandoned fit stops here (``FitAbandoned``), its state saved."""
        with self._lock:
            self._step += 1
            self._latest = (self._step, state) if stable else None
            if abandoned() or self.clock() - self._last_write >= self.every_s:
                self._write(self._step, state)
        if abandoned():
            raise FitAbandoned(f"the eraser fit was stopped; its state is saved in {self.path}")

    def save_latest(self) -> None:
        """Write the last stable state offered unless it is on disk already (the main thread, when a signal stops the
        fit: the fit's thread may be inside a minutes-long step)."""
        with self._lock:
            if self._latest is not None and self._latest[0] > self._written:
                self._write(*self._latest)

    def _write(self, step: int, state: Callable[[], State]) -> None:
        started = time.monotonic()
        write_checked(self.path, state(), {"kind": "partial eraser fit", "step": str(step)})
        self._written, self._last_write = step, self.clock()
        self.writes += 1
        log.info("saved the partial eraser fit (step %d) in %.1f s: %s", step, time.monotonic() - started, self.path)


class FitAbandoned(Exception):
    """A signal stopped the run while this fit ran in a worker thread; the fit stops at its next step."""
