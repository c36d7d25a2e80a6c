"""Fit time and peak memory of every eraser on synthetic image-like data (not a test).

    python benchmarks/bench_erasers.py                       # d=3072, k=10, n=50000 (CIFAR-10 size)
    python benchmarks/bench_erasers.py --n 5000 --d 768      # quicker
    python benchmarks/bench_erasers.py --erasers qleace

Data: k Gaussian classes whose covariances share an image-like power-law spectrum
(lambda_j ~ j^-1.2, total variance ~0.05 per pixel) in a random basis, each class mixed by its own
perturbation of the identity, class means differing slightly, clipped to [0, 1] like pixels.
On a shared machine wall time is inflated by other load; cpu_s (CPU seconds of all threads of the
fit) divided by the number of cores is what the fit takes on an idle machine of that size.
Each eraser runs in its own subprocess so that peak RSS (ru_maxrss) belongs to that eraser alone;
the baseline (data generated, nothing fitted) is printed beside it. On a GPU, peak GPU memory too.
For QLEACE the seconds per barycenter iteration are reported, for gradient erasure the seconds per
L-BFGS step (use --gradient-steps to bound its run time on a CPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def synthetic_images(n: int, d: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spectrum = torch.arange(1, d + 1, dtype=torch.float32) ** -1.2
    spectrum *= 0.05 * d / spectrum.sum()
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    y = torch.randint(0, k, (n,), generator=gen)
    x = torch.empty(n, d)
    scaled = basis * spectrum.sqrt()
    for c in range(k):
        rows = torch.nonzero(y == c).squeeze(1)
        mix = scaled @ (torch.eye(d) + 0.3 * torch.randn(d, d, generator=gen) / d**0.5)
        offset = 0.45 + scaled @ (0.3 * torch.randn(d, generator=gen))
        x[rows] = torch.randn(rows.numel(), d, generator=gen) @ mix.T + offset
    return x.clamp_(0, 1), y


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(args: argparse.Namespace) -> None:
    import erasure
    from erasure import qleace

    x, y = synthetic_images(args.n, args.d, args.k, args.seed)
    baseline = peak_rss_gib()
    options: dict = {}
    extra: dict = {}
    if args.child == "gradient":
        options = {"steps": args.gradient_steps}
    if args.child == "qleace":
        timed = qleace.wasserstein_barycenter

        def timing(*a, **kw):
            start = time.perf_counter()
            out = timed(*a, **kw)
            extra["s_per_iteration"] = (time.perf_counter() - start) / out.iterations
            return out

        qleace.wasserstein_barycenter = timing
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    eraser = erasure.fit_eraser(args.child, x, y, **options)
    fit_s = time.perf_counter() - start
    extra["cpu_s"] = time.process_time() - cpu_start  # all threads: wall time on an idle machine ~ cpu_s / cores
    meta = eraser.metadata()
    if args.child == "gradient":
        extra["s_per_step"] = fit_s / args.gradient_steps
        extra["final_gaps"] = meta["final_gaps"]
    for key in ("iterations", "residual", "edit_rank", "rank"):
        if key in meta:
            extra[key] = meta[key]
    row = {
        "eraser": args.child,
        "fit_s": fit_s,
        "peak_rss_gib": peak_rss_gib(),
        "baseline_rss_gib": baseline,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        **extra,
    }
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50000)
    parser.add_argument("--d", type=int, default=3072)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--erasers", default="leace,qleace,alf_qleace,random,gradient")
    parser.add_argument("--gradient-steps", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"n={args.n} d={args.d} k={args.k} on {device}", flush=True)
    rows = []
    for name in args.erasers.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--n",
            str(args.n),
            "--d",
            str(args.d),
            "--k",
            str(args.k),
            "--seed",
            str(args.seed),
            "--gradient-steps",
            str(args.gradient_steps),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            print(f"{name}: failed\n{out.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(lines[-1][len("RESULT ") :])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| eraser | fit s | peak RSS GiB (baseline) | notes |\n|---|---|---|---|")
    for row in rows:
        notes = {k: v for k, v in row.items() if k not in ("eraser", "fit_s", "peak_rss_gib", "baseline_rss_gib")}
        notes = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in notes.items() if v is not None
        )
        print(
            f"| {row['eraser']} | {row['fit_s']:.1f} | {row['peak_rss_gib']:.2f} ({row['baseline_rss_gib']:.2f}) | {notes} |"
        )


if __name__ == "__main__":
    main()
