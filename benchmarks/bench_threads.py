"""Is the default thread setting ever slower than one thread, on a quiet machine and a loaded one?

    python benchmarks/bench_threads.py [hydra overrides...] [--repeats 2] [--load N]

Runs ``python launch.py`` (default: the embedded default run) as a subprocess, as a user would, with
the default thread count (``trainer.torch_threads=null``: Slurm's allocation, else 1; mdl/run/experiment.py
allocated_cpus), with one thread, and with one thread per core, OpenMP's idle threads spinning
(``OMP_WAIT_POLICY=ACTIVE``, torch's default) or sleeping (``PASSIVE``). Then again while N busy
processes (default: one per core) compete for the cores, as on a shared node or in CI.
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
CORES = str(os.cpu_count() or 1)
SETTINGS = {  # name: (trainer.torch_threads, OpenMP environment)
    "default": ("null", {}),
    "1 thread": ("1", {}),
    f"{CORES} threads, spinning": (CORES, {"OMP_WAIT_POLICY": "ACTIVE"}),
    f"{CORES} threads, sleeping": (CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
}
EXTRA = {  # --spincounts: GNU OpenMP's spin before sleeping, between the two (libgomp's GOMP_SPINCOUNT)
    f"{CORES} threads, spin {n}": (CORES, {"GOMP_SPINCOUNT": str(n)}) for n in (1000, 30000, 300000)
}


def run_once(overrides: list[str], threads: str, omp: dict[str, str], root: Path, cache: Path) -> float:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))},
        **omp,
        "PYTHONPATH": str(REPO),
    }
    args = [
        sys.executable,
        str(REPO / "launch.py"),
        *overrides,
        f"trainer.torch_threads={threads}",
        f"paths.output_root={root}",
        f"paths.cache_dir={cache}",
        "skip_if_done=false",
    ]
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"launch.py failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(overrides: list[str], repeats: int, tmp: Path, settings: dict) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(repeats):
        for name, (threads, omp) in settings.items():
            times[name].append(run_once(overrides, threads, omp, tmp / f"out-{r}", tmp / "cache"))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes in the loaded condition")
    parser.add_argument("--spincounts", action="store_true", help="also GOMP_SPINCOUNT 1e3, 3e4, 3e5 (default spin)")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as name:
        tmp = Path(name)
        run_once(overrides, "1", {}, tmp / "warm", tmp / "cache")  # fits and caches the eraser, untimed
        settings = {**SETTINGS, **(EXTRA if args.spincounts else {})}
        conditions = {"quiet": measure(overrides, args.repeats, tmp, settings)}
        load = busy(args.load)
        try:
            conditions[f"loaded ({args.load} busy processes)"] = measure(overrides, args.repeats, tmp, settings)
        finally:
            for p in load:
                p.kill()
                p.wait()
    print(
        f"launch.py {' '.join(overrides) or '(embedded default)'}; {os.cpu_count()} cores; "
        f"median of {args.repeats}; ratio = time / time with 1 thread in the same condition"
    )
    for condition, medians in conditions.items():
        base = medians["1 thread"]  # the default outside Slurm: compare the others with it
        for name, seconds in medians.items():
            print(f"  {condition:28s} {name:18s} {seconds:6.1f} s  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
