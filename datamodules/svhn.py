"""SVHN (cropped digits) through torchvision's own reader of ``train_32x32.mat`` / ``test_32x32.mat``.

torchvision maps the published label 10 to digit 0. ``verify_checksums=False`` uses a subclass
whose split table carries no MD5 sums (existence is still checked); the reading code is
torchvision's. ``use_extra=true`` appends the 531131 ``extra`` images to the training set.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from datamodules.data_root import data_root, missing_data
from datamodules.sources import ImageSet, ImageSource, register_source, uint8_images


@functools.cache
def svhn_reader(verify_checksums: bool) -> type:
    """torchvision's SVHN, or a subclass whose split table carries no MD5 sums (existence still
    checked). Imported on first use: torchvision takes seconds to import."""
    from torchvision.datasets import SVHN

    if verify_checksums:
        return SVHN

    class SVHNWithoutChecksums(SVHN):
        split_list = {split: [url, name, None] for split, (url, name, _) in SVHN.split_list.items()}

    return SVHNWithoutChecksums


def check_svhn_file(folder: Path, split: str, verify_checksums: bool) -> None:
    from torchvision.datasets.utils import check_integrity

    url, name, md5 = svhn_reader(True).split_list[split]
    path = folder / name
    if not path.is_file():
        raise missing_data(
            "svhn",
            folder,
            name,
            f"run once with data.options.download=true on a machine with network access (fetches {url}), "
            f"or download it elsewhere and copy it to {path}",
        )
    if verify_checksums and not check_integrity(str(path), md5):
        raise RuntimeError(
            f"svhn: {path} does not match the official MD5 sum. Delete it and run with data.options.download=true, "
            f"or set data.options.verify_checksums=false to load it anyway."
        )


def _read(folder: Path, split: str, download: bool, verify_checksums: bool) -> ImageSet:
    if download:
        folder.mkdir(parents=True, exist_ok=True)
        svhn_reader(True)(str(folder), split=split, download=True)
    check_svhn_file(folder, split, verify_checksums)
    reader = svhn_reader(verify_checksums)
    data = reader(str(folder), split=split, download=False)
    # torchvision returns (n, c, h, w) uint8 and int64 labels in 0..9
    return ImageSet(uint8_images(data.data).contiguous(), torch.as_tensor(data.labels, dtype=torch.int64))


@register_source("svhn")
def load_svhn(
    root: str | os.PathLike | None = None,
    download: bool = False,
    verify_checksums: bool = True,
    use_extra: bool = False,
    **_: Any,
) -> ImageSource:
    """73257 train (+531131 extra) / 26032 test RGB 32x32 house-number digits, labels 0..9."""
    folder = data_root(root, "svhn") / "svhn"
    train = _read(folder, "train", download, verify_checksums)
    if use_extra:
        extra = _read(folder, "extra", download, verify_checksums)
        train = ImageSet(torch.cat([train.x, extra.x]), torch.cat([train.y, extra.y]))
    test = _read(folder, "test", download, verify_checksums)
    return ImageSource(name="svhn", train=train, test=test, classes=[str(d) for d in range(10)])
