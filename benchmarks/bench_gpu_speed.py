"""Training throughput of the speed settings (trainer.precision / matmul_precision / channels_last /
compile), each as a ratio to plain fp32 measured in the same process.

    python benchmarks/bench_gpu_speed.py [--model convnext --width 128 --depth 1 --batch 128 --steps 60]

One training step = the framework's own StackedClassifier.step_loss of a stack of one (a fit of one member: its
plain model) + backward + schedule-free AdamW step, on CIFAR-10-shaped random data already on the device (as the
data module serves it). Compile is timed after its warm-up; the warm-up (compile) time is printed separately, and
again for a second, freshly initialised stack of one (what every later fit of one member pays).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedulefree  # noqa: E402
import torch  # noqa: E402

from models import create_model  # noqa: E402
from models.precision import set_float32_precision  # noqa: E402
from models.stacked_module import StackedClassifier  # noqa: E402
from models.stacking import StackedModel  # noqa: E402

SETTINGS = {
    "fp32 (highest)": dict(precision="fp32", matmul="highest", channels_last=False, compile=False),
    "tf32": dict(precision="fp32", matmul="high", channels_last=False, compile=False),
    "bf16": dict(precision="bf16", matmul="high", channels_last=False, compile=False),
    "bf16 + channels_last": dict(precision="bf16", matmul="high", channels_last=True, compile=False),
    "bf16 + channels_last + compile (trainer=gpu)": dict(
        precision="bf16", matmul="high", channels_last=True, compile=True
    ),
}


def build(args: argparse.Namespace, setting: dict) -> tuple[StackedClassifier, torch.optim.Optimizer]:
    model = create_model(args.model, args.width, args.depth, 10, (3, 32, 32), base_width=args.base_width)
    module = StackedClassifier(
        StackedModel([model], channels_last=setting["channels_last"]),
        lambda g: schedulefree.AdamWScheduleFree(g, warmup_steps=0),
        1e-3,
        precision=setting["precision"],
    ).cuda()
    if setting["compile"]:
        module.stack.compile("inductor")
    optimizer = module.configure_optimizers()
    optimizer.train()
    return module, optimizer


def run_steps(module: StackedClassifier, optimizer: torch.optim.Optimizer, batches: list, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = module.step_loss(x[None], y[None], torch.ones(1, y.shape[0], device=y.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnext")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--base-width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (
            torch.rand(args.batch, 3, 32, 32, device="cuda", generator=gen),
            torch.randint(0, 10, (args.batch,), device="cuda", generator=gen),
        )
        for _ in range(8)
    ]
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}; {args.model} width {args.width} depth {args.depth} batch {args.batch}"
    )
    reference = None
    for name, setting in SETTINGS.items():
        set_float32_precision(setting["matmul"])
        module, optimizer = build(args, setting)
        warm = run_steps(module, optimizer, batches, 5)
        seconds = run_steps(module, optimizer, batches, args.steps)
        rate = args.steps * args.batch / seconds
        reference = reference or rate
        extra = ""
        if setting["compile"]:  # what the next fit of one member pays: a fresh stack of one
            module2, optimizer2 = build(args, setting)
            warm2 = run_steps(module2, optimizer2, batches, 5)
            extra = f"  warm-up (compile) {warm:.1f}s, next block's warm-up {warm2:.2f}s"
        print(f"{name:46s} {rate:10.0f} ex/s  {rate / reference:5.2f}x{extra}", flush=True)


if __name__ == "__main__":
    main()
