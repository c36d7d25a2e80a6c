"""Training throughput of a fit of M members against a fit of one member, per speed setting, in one
process: what `mdl.members_per_fit` buys (issue 25's GPU criteria: the MLP w1024 stacked at least 4x
one member; ConvNeXt w64, 10 members, bf16 + compile at least 2x one member with bf16 + compile).

    python benchmarks/bench_stacked_speed.py --model convnext --width 64 --members 10
    python benchmarks/bench_stacked_speed.py --model mlp --width 1024 --members 10 --settings fp32

A step is the framework's own: Classifier.train_group (one member, channels-last for conv nets as
trainer=gpu sets it) or StackedClassifier.train_group (M members, each its own batch), backward and
schedule-free AdamW, on CIFAR-10-shaped random data already on the device. Throughput counts every
member's examples. Compiled steps are timed after their warm-up, whose time is printed. Runs on a
CPU too (--device cpu), where the ratio says little about a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedulefree  # noqa: E402
import torch  # noqa: E402

from datamodules.loader import BatchGroup  # noqa: E402
from datamodules.stacked_batches import StackedBatch  # noqa: E402
from models import Classifier, create_model  # noqa: E402
from models.stacked_module import StackedClassifier  # noqa: E402
from models.stacking import StackedModel  # noqa: E402

SETTINGS = {"fp32": ("fp32", False), "bf16": ("bf16", False), "bf16+compile": ("bf16", True), "fp32+compile": ("fp32", True)}
SHAPE = (3, 32, 32)


def optimizer(groups):
    return schedulefree.AdamWScheduleFree(groups, warmup_steps=0)


def one_member(args: argparse.Namespace, precision: str, compiled: bool, device: torch.device):
    model = create_model(args.model, args.width, args.depth, 10, SHAPE, base_width=args.base_width)
    module = Classifier(model, optimizer, lr=1e-3, precision=precision, channels_last=args.model != "mlp").to(device)
    if compiled:
        module.model.compile(backend=args.backend)
    x = torch.rand(args.batch, *SHAPE, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    return module, BatchGroup([(x, y)]), 1


def stacked(args: argparse.Namespace, precision: str, compiled: bool, device: torch.device):
    models = [create_model(args.model, args.width, args.depth, 10, SHAPE, base_width=args.base_width).to(device)
              for _ in range(args.members)]
    module = StackedClassifier(StackedModel(models), optimizer, 1e-3, precision=precision).to(device)
    if compiled:
        module.stack.compile(args.backend)
    m = args.members
    batch = StackedBatch(torch.rand(1, m, args.batch, *SHAPE, device=device), torch.randint(0, 10, (1, m, args.batch), device=device),
                         torch.ones(1, m, args.batch, device=device), list(range(m)))
    return module, batch, m


def examples_per_second(build, args: argparse.Namespace, precision: str, compiled: bool, device: torch.device) -> tuple[float, float]:
    module, group, members = build(args, precision, compiled, device)
    opt = module.configure_optimizers()
    opt.train()

    def steps(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            module.train_group(group, opt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    warm = steps(3)
    return args.steps * members * args.batch / steps(args.steps), warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnext")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--base-width", type=int, default=16)
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settings", default="fp32,bf16,bf16+compile", help=f"comma list of {sorted(SETTINGS)}")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: no code generation)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}, torch {torch.__version__}; {args.model} width {args.width} depth {args.depth}, batch {args.batch} per member")
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            raise SystemExit(f"error: unknown setting {setting!r}; choose from {sorted(SETTINGS)}")
        precision, compiled = SETTINGS[setting]
        one, warm_one = examples_per_second(one_member, args, precision, compiled, device)
        many, warm_many = examples_per_second(stacked, args, precision, compiled, device)
        warm = f"  (warm-up {warm_one:.1f} s / {warm_many:.1f} s)" if compiled else ""
        print(f"{setting:14s} one member {one:10.0f} ex/s | {args.members} members stacked {many:10.0f} ex/s | "
              f"stacked/one = {many / one:5.2f}x{warm}", flush=True)


if __name__ == "__main__":
    main()
