"""``debug=profile``'s breakdown of a whole job: where its wall time went, from the process's start to its results.

Lightning's profiler sees only the fits; a digits job spends most of its time before them (start-up, imports, data,
the eraser and its diagnostics). ``profiled_phases`` records the job's phases (datamodules.timing: launch.py's
start-up stamps, then the data, eraser, each fit, the results) and writes them to ``<run dir>/profile/phases.json``
with the time nothing timed (``untimed``), and prints them as a table. Only with a profiler (``trainer.profiler``):
an unprofiled run records nothing.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from datamodules.timing import PhaseClock, recording
from mdl.results import atomic_write_json

PROFILE_DIR = "profile"  # in the run folder: the profilers' reports (Lightning's, and this breakdown)
PHASES_FILE = "phases.json"
# the job's own phases (mdl.run.experiment), in the order they come; the data module's, the eraser's and each fit's
# are named where they are timed (datamodules, mdl.engine.driver)
JOB_PHASE = "run: config checks, run store"
DATA_PHASE = "data: erasing the splits, cache, device"  # the data module's own time, less its load, eraser, diagnostics
PREPARE_PHASE = "run: model, loggers, callbacks"
TRAINING_PHASE = "training: planning, checkpoints, progress"  # the driver's own time, less its fits
RESULTS_PHASE = "results: written and logged"
UNTIMED = "untimed (between the phases above)"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc, in clock ticks since boot); None
    where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), after "pid (name)"
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_clock(startup: dict[str, float] | None) -> PhaseClock:
    """A clock started at the process's start, holding launch.py's start-up phases (``startup``: each phase's name
    and the ``time.perf_counter()`` at its end, in order); without them, or the process's age, started now."""
    if not startup:
        return PhaseClock()
    age = process_age_s()
    first = next(iter(startup.values()))
    started = time.perf_counter() - age if age is not None and time.perf_counter() - age <= first else first
    clock = PhaseClock(started)
    previous = started
    for name, end in startup.items():
        clock.add(name, end - previous)
        previous = end
    return clock


@contextmanager
def profiled_phases(profiler: Any, folder: Path, startup: dict[str, float] | None = None) -> Iterator[None]:
    """With a profiler (``trainer.profiler``), the phases of the work inside timed, then written to ``folder`` and
    printed (not after an error: the run has no results to profile); without one, nothing."""
    if not profiler:
        yield
        return
    clock = startup_clock(startup)
    with recording(clock):
        yield
    breakdown = phases_breakdown(clock, "process start" if startup else "job start")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / PHASES_FILE, breakdown)
    print(phases_table(breakdown, folder / PHASES_FILE), flush=True)


def phases_breakdown(clock: PhaseClock, origin: str) -> dict[str, Any]:
    """The clock's phases as seconds and shares of the wall time since it started (``origin`` says when that was),
    with the time none covered."""
    wall = time.perf_counter() - clock.started
    phases = {**clock.seconds, UNTIMED: wall - sum(clock.seconds.values())}
    return {
        "wall_s": round(wall, 4),
        "from": origin,
        "phases": [
            {"phase": name, "seconds": round(s, 4), "share": round(s / wall, 4) if wall > 0 else 0.0}
            for name, s in phases.items()
        ],
    }


def phases_table(breakdown: dict[str, Any], path: Path) -> str:
    """The breakdown as lines of seconds, share and phase, under a line that names its file."""
    lines = [f"where the job's {breakdown['wall_s']:.2f} s went (from its {breakdown['from']}; {path}):"]
    lines += [f"  {p['seconds']:8.2f} s {100 * p['share']:5.1f}%  {p['phase']}" for p in breakdown["phases"]]
    return "\n".join(lines)
