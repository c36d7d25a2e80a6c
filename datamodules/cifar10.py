"""CIFAR-10 through torchvision's own reader (the pickled batches of cifar-10-python.tar.gz).

``verify_checksums=False`` uses a subclass whose file lists carry no MD5 sums, so torchvision's
``check_integrity`` only checks that each file exists; every other line of the reader is
torchvision's. That is how tests load small files written in the real format, and how a user
loads a copy re-packed in the same format.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from datamodules.data_root import data_root, missing_data
from datamodules.sources import ImageSet, ImageSource, register_source, uint8_images


@functools.cache
def cifar10_reader(verify_checksums: bool) -> type:
    """torchvision's CIFAR10, or a subclass whose file lists carry no MD5 sums (existence still
    checked). Imported on first use: torchvision takes seconds to import."""
    from torchvision.datasets import CIFAR10

    if verify_checksums:
        return CIFAR10

    class CIFAR10WithoutChecksums(CIFAR10):
        train_list = [[name, None] for name, _ in CIFAR10.train_list]
        test_list = [[name, None] for name, _ in CIFAR10.test_list]
        meta = {**CIFAR10.meta, "md5": None}

    return CIFAR10WithoutChecksums


def cifar10_files() -> list[str]:
    official = cifar10_reader(True)
    return [name for name, _ in official.train_list + official.test_list] + [official.meta["filename"]]


def check_cifar10_files(folder: Path, verify_checksums: bool) -> None:
    """Raise a message that names the folder and the fix, before torchvision's generic one."""
    from torchvision.datasets.utils import check_integrity

    official = cifar10_reader(True)
    files = cifar10_files()
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise missing_data(
            "cifar10",
            folder,
            ", ".join(files),
            f"run once with data.options.download=true on a machine with network access (fetches {official.url}), "
            f"or download that archive elsewhere and extract it into {folder.parent} "
            f"(it unpacks to {official.base_folder}/). Missing: {', '.join(missing)}",
        )
    if verify_checksums:
        sums = {name: md5 for name, md5 in official.train_list + official.test_list}
        sums[official.meta["filename"]] = official.meta["md5"]
        bad = [name for name, md5 in sums.items() if not check_integrity(os.path.join(folder, name), md5)]
        if bad:
            raise RuntimeError(
                f"cifar10: files in {folder} do not match the official MD5 sums: {', '.join(bad)}. "
                f"Delete them and run with data.options.download=true, or set data.options.verify_checksums=false to "
                f"load them anyway (e.g. a re-packed copy)."
            )


@register_source("cifar10")
def load_cifar10(
    root: str | os.PathLike | None = None, download: bool = False, verify_checksums: bool = True, **_: Any
) -> ImageSource:
    """50000 train / 10000 test RGB 32x32 images, 10 classes, pixels as published (row-major, RGB)."""
    base = data_root(root, "cifar10")
    official = cifar10_reader(True)
    folder = base / official.base_folder
    reader = cifar10_reader(verify_checksums)
    if download:
        base.mkdir(parents=True, exist_ok=True)
        official(str(base), train=True, download=True)
    check_cifar10_files(folder, verify_checksums)
    train = reader(str(base), train=True, download=False)
    test = reader(str(base), train=False, download=False)
    return ImageSource(
        name="cifar10",
        train=ImageSet(uint8_images(train.data).permute(0, 3, 1, 2).contiguous(), _labels(train.targets)),
        test=ImageSet(uint8_images(test.data).permute(0, 3, 1, 2).contiguous(), _labels(test.targets)),
        classes=list(train.classes),
    )


def _labels(targets: Any) -> Tensor:
    return torch.as_tensor(targets, dtype=torch.int64)
