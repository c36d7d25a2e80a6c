"""debug=profile's breakdown (datamodules.timing, mdl.run.phases): phases timed only while a clock records, each
without the phases timed inside it, in the data work's worker thread too."""

from __future__ import annotations

import time

from datamodules.interrupts import interruptible
from datamodules.timing import PhaseClock, recording, timed


def test_phases_are_timed_only_while_recording_each_less_the_phases_inside_it() -> None:
    def data_work() -> None:  # as the eraser's fit runs: in datamodules.interrupts' worker thread
        with timed("worker"):
            time.sleep(0.1)

    with timed("unrecorded"):  # no clock: nothing kept anywhere
        pass
    clock = PhaseClock()
    with recording(clock):
        started = time.perf_counter()
        with timed("outer"):
            time.sleep(0.05)
            with timed("inner"):
                interruptible(data_work)
        spanned = time.perf_counter() - started
    with timed("after"):
        pass
    assert list(clock.seconds) == ["worker", "inner", "outer"]  # the worker's phase too (before: not recorded)
    assert clock.seconds["worker"] >= 0.1 and clock.seconds["outer"] >= 0.05
    assert abs(sum(clock.seconds.values()) - spanned) < 0.01  # each phase less those inside it: no time twice
