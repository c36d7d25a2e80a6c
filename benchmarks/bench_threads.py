"""Is the default thread setting ever slower than one thread, on a quiet machine and a loaded one?

    python benchmarks/bench_threads.py [hydra overrides...] [--repeats 2] [--load N]

Runs ``python launch.py`` (default: the embedded default run) as a subprocess, as a user would, with
``trainer.torch_threads=1`` and with the default (``null``: the CPUs allocated to the process,
mdl/experiment.py allocated_cpus), each with OpenMP's idle threads sleeping (``OMP_WAIT_POLICY=PASSIVE``,
what launch.py sets) and spinning (``ACTIVE``, torch's own default before). Then again while N
busy processes (default: one per core) compete for the cores, as on a shared node or in CI.
Prints each wall time (median of the repeats, the configurations interleaved) and its ratio to the
one-thread run in the same condition. The erased data are cached by an untimed first run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # name: (trainer.torch_threads, OMP_WAIT_POLICY)
    "1 thread": ("1", "PASSIVE"),
    "default, passive": ("null", "PASSIVE"),
    "default, spinning": ("null", "ACTIVE"),
}


def run_once(overrides: list[str], threads: str, policy: str, root: Path, cache: Path) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy, "PYTHONPATH": str(REPO)}
    args = [sys.executable, str(REPO / "launch.py"), *overrides, f"trainer.torch_threads={threads}",
            f"paths.output_root={root}", f"paths.cache_dir={cache}", "skip_if_done=false"]
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"launch.py failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(overrides: list[str], repeats: int, tmp: Path) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(repeats):
        for name, (threads, policy) in SETTINGS.items():
            times[name].append(run_once(overrides, threads, policy, tmp / f"out-{r}", tmp / "cache"))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes in the loaded condition")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as name:
        tmp = Path(name)
        run_once(overrides, "1", "PASSIVE", tmp / "warm", tmp / "cache")  # fits and caches the eraser, untimed
        conditions = {"quiet": measure(overrides, args.repeats, tmp)}
        load = busy(args.load)
        try:
            conditions[f"loaded ({args.load} busy processes)"] = measure(overrides, args.repeats, tmp)
        finally:
            for p in load:
                p.kill()
                p.wait()
    print(f"launch.py {' '.join(overrides) or '(embedded default)'}; {os.cpu_count()} cores; "
          f"median of {args.repeats}; ratio = time / time with 1 thread in the same condition")
    for condition, medians in conditions.items():
        base = medians["1 thread"]
        for name, seconds in medians.items():
            print(f"  {condition:28s} {name:18s} {seconds:6.1f} s  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
