"""Per-step training and per-batch validation times on this CPU, for the sweep cost table.

    python benchmarks/bench_epoch_times.py [--threads 1]

Prints the `points:` rows of conf/cost/epoch_times.yaml's `cpu` section. Each row trains the
framework's own module (the composed config's model, muP and schedule-free AdamW, through a
Lightning Trainer, as a prequential fit does) on random data of the given shape served by the
device-resident loader (crops and flips on), for 3 epochs, and times every training step and every
validation pass with a callback. The minimum over steps is reported: on a shared machine the other
processes only ever make a step slower, so the fastest one is the best estimate of an unloaded core.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from datamodules.loader import DeviceBatches  # noqa: E402
from mdl.run.components import make_module_factory# noqa: E402
from mdl.run.experiment import quiet_lightning# noqa: E402
from mdl.sweeps.cost import forward_flops  # noqa: E402

# (model, input shape, width, depth, batches per epoch): small and larger sizes per architecture,
# on digits' and CIFAR-10's shapes; the large ones are few steps because one CPU thread is slow.
POINTS = [
    ("mlp", (1, 8, 8), 128, 2, 8), ("mlp", (3, 32, 32), 128, 2, 8), ("mlp", (3, 32, 32), 1024, 2, 4),
    ("mlp", (3, 32, 32), 512, 6, 4),
    ("lenet", (1, 8, 8), 128, 2, 8), ("lenet", (3, 32, 32), 128, 2, 4), ("lenet", (3, 32, 32), 1024, 2, 2),
    ("convnext", (1, 8, 8), 16, 1, 4), ("convnext", (3, 32, 32), 16, 1, 2), ("convnext", (3, 32, 32), 40, 2, 1),
    ("swin", (1, 8, 8), 16, 1, 4), ("swin", (3, 32, 32), 16, 1, 2), ("swin", (3, 32, 32), 32, 2, 1),
]
VAL_EXAMPLES = 1024
EPOCHS = 3


class StepTimes(L.Callback):
    """Wall time of every training step, every validation pass and the whole fit."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.vals: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.steps.append(time.perf_counter() - self._t)

    def on_validation_epoch_start(self, *args) -> None:
        self._v = time.perf_counter()

    def on_validation_epoch_end(self, *args) -> None:
        self.vals.append(time.perf_counter() - self._v)


def measure(model: str, shape: tuple[int, ...], width: int, depth: int, steps: int) -> dict[str, float]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"width={width}", f"depth={depth}", "device=cpu"])
    make = make_module_factory(cfg, 10, shape)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(steps * 128, *shape, generator=gen), torch.randint(0, 10, (steps * 128,), generator=gen)
    train = DeviceBatches(x, y, 128, shuffle=True, augment=True)
    val = DeviceBatches(torch.rand(VAL_EXAMPLES, *shape, generator=gen), torch.randint(0, 10, (VAL_EXAMPLES,)), 1024)
    times = StepTimes()
    start = time.perf_counter()  # the Trainer included: a prequential fit builds one per block
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[times])
    trainer.fit(make(), train_dataloaders=train, val_dataloaders=val)
    total = time.perf_counter() - start
    step, val_s = min(times.steps[1:] or times.steps), min(times.vals)
    return {"fwd_flops": forward_flops(model, width, depth, shape, cfg.model.options), "step_s": step,
            "val_batch_s": val_s, "fit_overhead_s": max(total - sum(times.steps) - sum(times.vals), 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the default trainer uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_lightning()
    warnings.filterwarnings("ignore")
    print(f"# torch {torch.__version__}, {args.threads} thread(s), batch 128, validation batch 1024")
    for model, shape, width, depth, steps in POINTS:
        r = measure(model, shape, width, depth, steps)
        print(f"    - {{model: {model}, shape: {list(shape)}, width: {width}, depth: {depth}, fwd_flops: {r['fwd_flops']:.4g}, "
              f"step_s: {r['step_s']:.4g}, val_batch_s: {r['val_batch_s']:.4g}, fit_overhead_s: {r['fit_overhead_s']:.2f}}}",
              flush=True)


if __name__ == "__main__":
    main()
