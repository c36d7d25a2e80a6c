"""Wall time by phase, for ``debug=profile``'s breakdown of a job (mdl.run.phases): start-up, data, eraser, fits.

``timed(name)`` around a step adds its seconds to the ``PhaseClock`` recording in this context (``recording``),
and does nothing otherwise: an unprofiled run pays one context-variable read per step. A phase's seconds leave out
those of the phases timed inside it, so the phases of a breakdown add up to the time they span. The data work runs
in a worker thread (datamodules.interrupts) in a copy of the caller's context: its phases are recorded too.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import wraps
from typing import Any, Callable, ContextManager, Iterator, TypeVar

_clock: ContextVar[PhaseClock | None] = ContextVar("mdl_phase_clock", default=None)
_UNTIMED = nullcontext()
F = TypeVar("F", bound=Callable[..., Any])


class PhaseClock:
    """Seconds by phase name, in the order first seen; ``started``: ``time.perf_counter()`` at the breakdown's
    start (for a launch, when its process started)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # for each phase open now, the seconds of the phases timed inside it

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.add(name, spent - self._inner.pop())
            if self._inner:
                self._inner[-1] += spent


@contextmanager
def recording(clock: PhaseClock | None) -> Iterator[None]:
    """The phases timed inside (this thread, and the data work it hands to a worker) go to ``clock`` (None: none)."""
    token = _clock.set(clock)
    try:
        yield
    finally:
        _clock.reset(token)


def timed(name: str) -> ContextManager[None]:
    """The step inside, timed as phase ``name`` when a clock is recording (see above)."""
    clock = _clock.get()
    return _UNTIMED if clock is None else clock.phase(name)


def timed_calls(name: str) -> Callable[[F], F]:
    """A function whose every call is timed as phase ``name`` (see ``timed``)."""

    def wrap(fn: F) -> F:
        @wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with timed(name):
                return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
