"""Batches per second: the device-resident data path vs a torch DataLoader, same augmentation.

    python benchmarks/bench_datapath.py                 # CPU, and the GPU when there is one
    python benchmarks/bench_datapath.py --n 50000 --workers 0 2

Both paths serve shuffled batches of CIFAR-shaped float32 images with a random crop (padding
round(0.125 * side)) and a horizontal flip per image. The DataLoader path is the usual one:
a TensorDataset on the host, torchvision's RandomCrop + RandomHorizontalFlip per sample, worker
processes, and (for a GPU) pinned memory and a copy of every batch to the device. The device path
is ``datamodules.stacked_batches.StackedBatches`` of one member with the split already on the device. Prints one line per
setting and the ratio (device path / DataLoader); not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from datamodules.augment import Augmentation, crop_padding  # noqa: E402
from datamodules.stacked_batches import StackedBatches, TrainSource  # noqa: E402


class AugmentedTensors(Dataset):
    """Per-sample augmentation, the torchvision way."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, padding: int) -> None:
        from torchvision.transforms import v2

        self.x, self.y = x, y
        self.transform = v2.Compose([v2.RandomCrop(x.shape[-1], padding=padding), v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.x[i]), self.y[i]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pairs:
    """A one-member ``StackedBatches`` pass as (x, y) batches, as often as iterated."""

    def __init__(self, loader: StackedBatches) -> None:
        self.loader = loader

    def __iter__(self):
        return ((group.x, group.y) for group in self.loader)


def rate(batches, device: torch.device, epochs: int, to_device: bool = False) -> float:
    """Batches per second over ``epochs`` full passes (after one warm-up pass)."""

    def one_pass() -> int:
        count = 0
        for xb, yb in batches:
            if to_device:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            count += 1
        return count

    one_pass()
    sync(device)
    start = time.perf_counter()
    count = sum(one_pass() for _ in range(epochs))
    sync(device)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10000, help="images in the split")
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts to try")
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when available")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = args.devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    g = torch.Generator().manual_seed(0)
    x_host = torch.rand(args.n, 3, args.side, args.side, generator=g)
    y_host = torch.randint(0, 10, (args.n,), generator=g)
    padding = crop_padding(args.side, 0.125)
    print(
        f"n={args.n} images 3x{args.side}x{args.side}, batch {args.batch_size}, crop padding {padding} + flip, "
        f"{torch.get_num_threads()} CPU threads"
    )
    for name in devices:
        device = torch.device(name)
        x, y = x_host.to(device), y_host.to(device)
        one = StackedBatches([TrainSource(x, y)], [len(y)], args.batch_size, augment=Augmentation())  # a fit of one
        ours = rate(Pairs(one), device, args.epochs)
        print(f"[{name}] device path (StackedBatches, one member): {ours:10.1f} batches/s")
        for workers in args.workers:
            loader = DataLoader(
                AugmentedTensors(x_host, y_host, padding),
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=workers,
                pin_memory=device.type == "cuda",
                persistent_workers=workers > 0,
            )
            theirs = rate(loader, device, args.epochs, to_device=device.type != "cpu")
            print(f"[{name}] DataLoader, {workers} workers:    {theirs:10.1f} batches/s   ratio {ours / theirs:6.1f}x")


if __name__ == "__main__":
    main()
