"""Per-step training and per-batch validation times on this machine, for the sweep cost table.

    python benchmarks/bench_epoch_times.py [--threads 1] [--members 10]                      # the `cpu` rows
    python benchmarks/bench_epoch_times.py --device cuda [--settings fp32_highest,fp32_high,bf16,bf16_compile]

Prints the `batch`, `eval_batch` and `points:` rows of a section of conf/cost/epoch_times.yaml (`cpu`, or `gpu` with
--device cuda), to paste there. Each point composes the run's own config (model, width, depth: muP, schedule-free AdamW, its learning rate)
and times the framework's own step (benchmarks/step_timing.py: forward, backward, optimizer step, data already on
the device) for one member and for a stack of --members members, each its own batch of 128, and one member's
validation batch of 1024; per speed setting on a GPU. A row of M members times a step of all M
(mdl/sweeps/rates.py prices a member's step in a stack at step_s / M). The minimum over steps is reported: on a
shared machine the other processes only ever make a step slower, so the fastest one is the best estimate of an
unloaded device. A stack whose step would take longer than --stack-budget-s is not timed (its row is left out).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from benchmarks.step_timing import SETTINGS, build, seconds_per_eval_batch, seconds_per_step  # noqa: E402
from mdl.run.components import make_model_factory, make_optimizer, run_lr  # noqa: E402
from mdl.run.experiment import quiet_lightning  # noqa: E402
from mdl.sweeps.cost import forward_flops  # noqa: E402

# (model, input shape, width, depth, steps timed on a CPU; 20 on a GPU): small and larger sizes per architecture,
# on digits' and CIFAR-10's shapes; the large ones are few steps because one CPU thread is slow.
POINTS = [
    ("mlp", (1, 8, 8), 128, 2, 8),
    ("mlp", (3, 32, 32), 128, 2, 8),
    ("mlp", (3, 32, 32), 1024, 2, 4),
    ("mlp", (3, 32, 32), 512, 6, 4),
    ("lenet", (1, 8, 8), 128, 2, 8),
    ("lenet", (3, 32, 32), 128, 2, 4),
    ("lenet", (3, 32, 32), 1024, 2, 2),
    ("convnext", (1, 8, 8), 16, 1, 4),
    ("convnext", (3, 32, 32), 16, 1, 2),
    ("convnext", (3, 32, 32), 40, 2, 1),
    ("swin", (1, 8, 8), 16, 1, 4),
    ("swin", (3, 32, 32), 16, 1, 2),
    ("swin", (3, 32, 32), 32, 2, 1),
]
BATCH, EVAL_BATCH = 128, 1024


def measure(
    model: str,
    shape: tuple[int, ...],
    width: int,
    depth: int,
    steps: int,
    members: int,
    setting: str,
    device: torch.device,
    backend: str,
) -> dict[str, float]:
    """One row: the step of ``members`` members (and, for one member, its validation batch)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config", overrides=[f"model={model}", f"width={width}", f"depth={depth}", f"device={device.type}"]
        )
    timed = build(
        make_model_factory(cfg, 10, shape),
        make_optimizer(cfg),
        run_lr(cfg),
        members,
        shape,
        BATCH,
        setting,
        device,
        channels_last=setting == "bf16_compile" and model != "mlp",
        mup=cfg.model.base_width is not None,
        backend=backend,
    )
    row = {
        "fwd_flops": forward_flops(model, width, depth, shape, cfg.model.options),
        "step_s": seconds_per_step(timed, steps, device, warmup=1 if device.type == "cpu" else 3)[0],
    }
    if members == 1:
        row["val_batch_s"] = seconds_per_eval_batch(timed, EVAL_BATCH, device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda (prints the gpu section's rows)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the default trainer uses 1)")
    parser.add_argument("--members", type=int, default=10, help="members of the stacked rows (1: none)")
    parser.add_argument(
        "--settings",
        default=None,
        help=f"comma list of {sorted(SETTINGS)} (default: fp32 on a CPU, "
        f"fp32_highest,fp32_high,bf16,bf16_compile on a GPU)",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the *_compile settings")
    parser.add_argument(
        "--stack-budget-s", type=float, default=10.0, help="leave out a stack whose step would take longer"
    )
    parser.add_argument("--points", default=None, help="comma list of POINTS indices to measure (default: all)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new point after this many seconds "
        "(the rows measured so far are printed; scripts/gpu_check.py runs it inside a lease)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    settings = (
        args.settings or ("fp32" if device.type == "cpu" else "fp32_highest,fp32_high,bf16,bf16_compile")
    ).split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"error: unknown settings {unknown}; choose from {sorted(SETTINGS)}")
    points = POINTS if args.points is None else [POINTS[int(i)] for i in args.points.split(",")]
    torch.set_num_threads(args.threads)
    quiet_lightning()
    warnings.filterwarnings("ignore")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"  batch: {BATCH}\n  eval_batch: {EVAL_BATCH}")
    print(f"  points:   # torch {torch.__version__}, {where}, by benchmarks/bench_epoch_times.py")
    start = time.perf_counter()
    for setting in settings:
        for model, shape, width, depth, steps in points:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                print(
                    f"  # --budget-s {args.budget_s:g} spent: {setting} {model} {list(shape)} w{width} d{depth} and later "
                    "points not measured",
                    flush=True,
                )
                return
            steps = steps if device.type == "cpu" else 20
            one = measure(model, shape, width, depth, steps, 1, setting, device, args.backend)
            rows = [(1, one)]
            if args.members > 1 and one["step_s"] * args.members <= args.stack_budget_s:
                rows.append(
                    (
                        args.members,
                        measure(model, shape, width, depth, steps, args.members, setting, device, args.backend),
                    )
                )
            for members, r in rows:
                val = f", val_batch_s: {r['val_batch_s']:.4g}" if "val_batch_s" in r else ""
                print(
                    f"    - {{model: {model}, shape: {list(shape)}, width: {width}, depth: {depth}, setting: {setting}, "
                    f"members: {members}, fwd_flops: {r['fwd_flops']:.4g}, step_s: {r['step_s']:.4g}{val}}}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
