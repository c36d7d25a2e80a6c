"""SVHN (cropped digits) through torchvision's own reader of ``train_32x32.mat`` / ``test_32x32.mat``.

torchvision maps the published label 10 to digit 0. ``verify_checksums=False`` uses a subclass
whose split table carries no MD5 sums (existence is still checked); the reading code is
torchvision's. ``use_extra=true`` appends the 531131 ``extra`` images to the training set.
Each file is read on its own, so any error (unreadable, truncated, wrong shape, a label outside
1..10) names it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datamodules.data_root import ChecksumError, bad_data, data_root, downloading, missing_data, reading
from datamodules.sources import ImageSet, ImageSource, check_labels, register_source, uint8_images


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


def refetch(path: Path) -> str:
    """How to replace a damaged file."""
    return f"delete {path} and run once with data.options.download=true, or copy an intact {path.name} there"


def check_svhn_file(folder: Path, split: str, verify_checksums: bool) -> None:
    """Refuse a missing file, a folder in its place or (``verify_checksums``) one that is not the official file,
    before torchvision reads it: each error names the file and how to get a good one."""
    from torchvision.datasets.utils import check_integrity

    url, name, md5 = svhn_reader(True).split_list[split]
    path = folder / name
    with reading("svhn", path, refetch(path)):
        if not path.exists():
            raise missing_data(
                "svhn",
                folder,
                name,
                f"run once with data.options.download=true on a machine with network access (fetches {url}), "
                f"or download it elsewhere and copy it to {path}",
            )
        if not path.is_file():
            raise bad_data("svhn", path, "is not a regular file (a folder?)", refetch(path))
        if verify_checksums and not check_integrity(str(path), md5):
            raise ChecksumError(
                f"svhn: {path} does not match the official MD5 sum. Delete it and run with data.options.download=true, "
                f"or set data.options.verify_checksums=false to load it anyway."
            )


def _read_mat(folder: Path, split: str, verify_checksums: bool) -> Any:
    """torchvision's reader on one split; whatever it raises is reported against the file."""
    path = folder / svhn_reader(True).split_list[split][1]
    with reading("svhn", path, refetch(path)):
        try:
            return svhn_reader(verify_checksums)(str(folder), split=split, download=False)
        except OSError:
            raise
        except Exception as err:  # scipy and numpy raise many types for truncated or re-shaped files
            raise bad_data(
                "svhn",
                path,
                f"is not a readable SVHN .mat file with X (32, 32, 3, n) and y (n, 1) ({type(err).__name__}: {err})",
                refetch(path),
            ) from err


def _read(folder: Path, split: str, download: bool, verify_checksums: bool) -> ImageSet:
    if download:
        folder.mkdir(parents=True, exist_ok=True)
        url, name, _ = svhn_reader(True).split_list[split]
        with downloading(
            "svhn", url, f"download {url} on a machine with network access and copy it to {folder / name}"
        ):
            svhn_reader(True)(str(folder), split=split, download=True)
    check_svhn_file(folder, split, verify_checksums)
    data = _read_mat(folder, split, verify_checksums)
    path = folder / data.filename
    # torchvision returns (n, c, h, w) uint8 and int64 labels, 10 mapped to 0
    x, y = np.asarray(data.data), np.atleast_1d(np.asarray(data.labels))
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (3, 32, 32) or y.ndim != 1 or len(y) != len(x):
        raise bad_data(
            "svhn",
            path,
            f"reads as images of shape {x.shape} ({x.dtype}) with {y.size} labels; expected uint8 "
            f"X of shape (32, 32, 3, n) and n labels",
            refetch(path),
        )
    labels = torch.as_tensor(y)
    check_labels(labels, 10, f"svhn: {path} (published labels 1..10, 10 = digit 0)", refetch(path))
    return ImageSet(uint8_images(x).contiguous(), labels.to(torch.int64))


@register_source("svhn", size=lambda use_extra=False, **_: (99_289 + 531_131 * bool(use_extra), (3, 32, 32)))
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
