"""Seconds to the first line of output and to the end of the default run, as a user starts it.

    python benchmarks/bench_startup.py [hydra overrides...] [--repeats 3]

Runs ``python launch.py`` as a subprocess (a fresh interpreter: imports included), the first time
with an empty erasure cache (the eraser is fitted) and then with the cache warm, and prints the median
times. Targets (issue "The researcher's cockpit"): first output under 3 s, the default run under 8 s on
2 cores. ``python -X importtime launch.py ...`` shows where the import time goes (torch, lightning).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_run(overrides: list[str], root: Path, cache: Path) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "launch.py"),
            *overrides,
            f"paths.output_root={root}",
            f"paths.cache_dir={cache}",
            "skip_if_done=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    first = None
    for _ in proc.stdout:
        first = first if first is not None else time.perf_counter() - start
    if proc.wait() != 0:
        raise SystemExit("launch.py failed")
    return first or float("nan"), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as name:
        tmp = Path(name)
        cold = timed_run(overrides, tmp / "cold", tmp / "cache")
        warm = [timed_run(overrides, tmp / f"warm{i}", tmp / "cache") for i in range(args.repeats)]
    first, total = (statistics.median(v) for v in zip(*warm))
    print(f"launch.py {' '.join(overrides) or '(embedded default)'}")
    print(f"  cold cache (eraser fitted): first output {cold[0]:.2f} s, run {cold[1]:.2f} s")
    print(
        f"  warm cache, median of {args.repeats}: first output {first:.2f} s ({first / 3:.2f}x the 3 s target), "
        f"run {total:.2f} s ({total / 8:.2f}x the 8 s target)"
    )


if __name__ == "__main__":
    main()
