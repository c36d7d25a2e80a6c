"""Training throughput of a fit of M members against a fit of one member, per speed setting, in one
process: what `mdl.members_per_fit` buys (issue 25's GPU criteria: the MLP w1024 stacked at least 4x
one member; ConvNeXt w64, 10 members, bf16 + compile at least 2x one member with bf16 + compile).

    python benchmarks/bench_stacked_speed.py --model convnext --width 64 --members 10
    python benchmarks/bench_stacked_speed.py --model mlp --width 1024 --members 10 --settings fp32

A step is the framework's own (benchmarks/step_timing.py): StackedClassifier.train_group (a stack of one, channels-last for
conv nets as trainer=gpu sets it) or StackedClassifier.train_group (M members, each its own batch), backward and
schedule-free AdamW, on CIFAR-10-shaped random data already on the device; the fastest of --steps steps after
three of warm-up. Throughput counts every member's examples. Compiled steps' warm-up time is printed. Runs on a
CPU too (--device cpu), where the ratio says little about a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedulefree  # noqa: E402
import torch  # noqa: E402

from benchmarks.step_timing import SETTINGS, build, seconds_per_step  # noqa: E402
from models import create_model  # noqa: E402

SHAPE = (3, 32, 32)


def optimizer(groups):
    return schedulefree.AdamWScheduleFree(groups, warmup_steps=0)


def examples_per_second(
    args: argparse.Namespace, members: int, setting: str, device: torch.device
) -> tuple[float, float]:
    """Examples per second of every member together, and the warm-up's seconds."""
    make = lambda: create_model(args.model, args.width, args.depth, 10, SHAPE, base_width=args.base_width)  # noqa: E731
    timed = build(
        make,
        optimizer,
        1e-3,
        members,
        SHAPE,
        args.batch,
        setting,
        device,
        channels_last=args.model != "mlp",
        backend=args.backend,
    )
    step, warm = seconds_per_step(timed, args.steps, device)
    return members * args.batch / step, warm


def examples_per_second_and_graphs(
    args: argparse.Namespace, members: int, setting: str, device: torch.device
) -> tuple[float, float, int]:
    """examples_per_second, and how many graphs dynamo compiled for it (a stack should need as few as one member)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    rate, warm = examples_per_second(args, members, setting, device)
    return rate, warm, counters["stats"]["unique_graphs"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnext")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--base-width", type=int, default=16)
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settings", default="fp32_high,bf16,bf16_compile", help=f"comma list of {sorted(SETTINGS)}")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: no code generation)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--sides",
        default="one,stack",
        help="one,stack: both (the ratio); stack: the stack alone (its compile time with a warm inductor cache)",
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="also write each setting's numbers as JSON (scripts/gpu_check.py)"
    )
    args = parser.parse_args()
    if args.sides not in ("one,stack", "stack"):
        parser.error(f"--sides must be one,stack or stack, got {args.sides!r}")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{name}, torch {torch.__version__}; {args.model} width {args.width} depth {args.depth}, batch {args.batch} per member"
    )
    rows: dict[str, dict] = {}
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            raise SystemExit(f"error: unknown setting {setting!r}; choose from {sorted(SETTINGS)}")
        if args.sides == "stack":  # the stack alone, e.g. a second process finding the first one's inductor cache
            many, warm_many, graphs_many = examples_per_second_and_graphs(args, args.members, setting, device)
            print(
                f"{setting:14s} {args.members} members stacked {many:10.0f} ex/s  (warm-up {warm_many:.1f} s)",
                flush=True,
            )
            rows[setting] = {
                "stacked_ex_s": many,
                "warmup_s": [None, warm_many],
                "graphs_compiled": [None, graphs_many],
            }
            continue
        one, warm_one, graphs_one = examples_per_second_and_graphs(args, 1, setting, device)
        # said at once: a caller that cuts the run short (scripts/gpu_check.py's caps) still has one member's numbers
        print(f"{setting:14s} one member {one:10.0f} ex/s  (warm-up {warm_one:.1f} s)", flush=True)
        many, warm_many, graphs_many = examples_per_second_and_graphs(args, args.members, setting, device)
        compiled = SETTINGS[setting][1]
        warm = (
            f"  (warm-up {warm_one:.1f} s / {warm_many:.1f} s, {graphs_one} / {graphs_many} graphs compiled)"
            if compiled
            else ""
        )
        print(
            f"{setting:14s} one member {one:10.0f} ex/s | {args.members} members stacked {many:10.0f} ex/s | "
            f"stacked/one = {many / one:5.2f}x{warm}",
            flush=True,
        )
        rows[setting] = {
            "one_member_ex_s": one,
            "stacked_ex_s": many,
            "ratio": many / one,
            "warmup_s": [warm_one, warm_many],
            "graphs_compiled": [graphs_one, graphs_many] if compiled else None,
        }
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "width": args.width,
                    "members": args.members,
                    "device": name,
                    "torch": torch.__version__,
                    "settings": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
