"""Wall time of one sweep run job by job (Hydra's basic launcher, today's default) and packed
(``hydra/launcher=packed``: runs that differ only in seed, eraser or data seed as members of one fit), measured in
the same command, alternating, after one untimed sweep that fits and caches the erasers.

    python benchmarks/bench_packed.py [--erasers none,leace,qleace,alf_qleace,random] [--seeds 0,1,2,3,4]
        [--rounds 1] [hydra overrides...]

Prints each sweep's seconds, the ratio, and whether every job's paper MDL is the same in both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sweep(
    root: Path, cache: Path, erasers: str, seeds: str, launcher: list[str], overrides: list[str]
) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "-m",
            f"eraser={erasers}",
            f"seed={seeds}",
            *launcher,
            f"paths.output_root={root}",
            f"paths.cache_dir={cache}",
            "report=none",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"sweep failed:\n{done.stderr[-3000:]}")
    found = {}
    for path in root.glob("multirun/*/*/*/results.json"):
        r = json.loads(path.read_text())
        found[(r["config"]["eraser"]["name"], r["config"]["seed"])] = r["paper_mdl"]
    return seconds, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--erasers", default="none,leace,qleace,alf_qleace,random")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--rounds", type=int, default=1)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sweep(
            tmp / "warm",
            tmp / "cache",
            args.erasers,
            "0",
            [],
            [*overrides, "mdl.num_blocks=2", "trainer.kwargs.max_epochs=1"],
        )
        jobs = len(args.erasers.split(",")) * len(args.seeds.split(","))
        print(f"{jobs} jobs: erasers {args.erasers}, seeds {args.seeds}; overrides {overrides or '(none)'}", flush=True)
        for r in range(args.rounds):
            basic, basic_mdl = sweep(tmp / f"basic{r}", tmp / "cache", args.erasers, args.seeds, [], overrides)
            packed, packed_mdl = sweep(
                tmp / f"packed{r}", tmp / "cache", args.erasers, args.seeds, ["hydra/launcher=packed"], overrides
            )
            if len(basic_mdl) != jobs or basic_mdl.keys() != packed_mdl.keys():
                same = f"NOT comparable: {len(basic_mdl)} and {len(packed_mdl)} of {jobs} jobs have results"
            elif basic_mdl == packed_mdl:
                same = "the same to the bit"
            else:  # with fits of k other stack sizes than the runs alone have (docs/sweeps.md)
                gap = max(abs(basic_mdl[k] - packed_mdl[k]) for k in basic_mdl)
                same = f"NOT the same: {sum(basic_mdl[k] != packed_mdl[k] for k in basic_mdl)} differ, by at most {gap:.2e} bits"
            print(
                f"[{r}] job by job {basic:.1f} s | packed {packed:.1f} s | job by job / packed = {basic / packed:.2f}x | "
                f"paper MDL of every job {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
