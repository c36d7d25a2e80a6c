"""CIFAR-10 from the pickled batches of cifar-10-python.tar.gz, file by file.

torchvision supplies the file list, the URL, the download and the MD5 sums; the batches are read
here, one file at a time, exactly as torchvision's reader does (a latin-1 pickle whose ``data``
holds rows of 3072 bytes, channel-major RGB, and whose ``labels`` are 0..9), so that every error
names the file it comes from: an unreadable, truncated or re-shaped batch, or a label out of range
(which would otherwise pass unseen into the validation or test split).

``verify_checksums=False`` skips the MD5 sums and only checks that each file exists; that is how
tests load small files written in the real format, and how a user loads a copy re-packed in the
same format.
"""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from datamodules.data_root import ChecksumError, bad_data, data_root, downloading, missing_data, reading
from datamodules.sources import ImageSet, ImageSource, check_labels, register_source, uint8_images

PIXELS = 3 * 32 * 32


@functools.cache
def torchvision_cifar10() -> type:
    """torchvision's CIFAR10 (file list, URL, MD5 sums, download). Imported on first use:
    torchvision takes seconds to import."""
    from torchvision.datasets import CIFAR10

    return CIFAR10


def cifar10_files() -> list[str]:
    official = torchvision_cifar10()
    return [name for name, _ in official.train_list + official.test_list] + [official.meta["filename"]]


def refetch(folder: Path) -> str:
    """How to replace a damaged copy."""
    return (
        f"delete {folder} and run once with data.options.download=true, or extract cifar-10-python.tar.gz "
        f"into {folder.parent} again"
    )


def check_cifar10_files(folder: Path, verify_checksums: bool) -> None:
    """Raise a message that names the folder and the fix, before torchvision's generic one."""
    from torchvision.datasets.utils import check_integrity

    official = torchvision_cifar10()
    files = cifar10_files()
    with reading("cifar10", folder, refetch(folder)):
        missing = [name for name in files if not (folder / name).exists()]
        if missing:
            raise missing_data(
                "cifar10",
                folder,
                ", ".join(files),
                f"run once with data.options.download=true on a machine with network access (fetches {official.url}), "
                f"or download that archive elsewhere and extract it into {folder.parent} "
                f"(it unpacks to {official.base_folder}/). Missing: {', '.join(missing)}",
            )
        for name in files:
            if not (folder / name).is_file():
                raise bad_data("cifar10", folder / name, "is not a regular file (a folder?)", refetch(folder))
        if verify_checksums:
            sums = {name: md5 for name, md5 in official.train_list + official.test_list}
            sums[official.meta["filename"]] = official.meta["md5"]
            bad = [name for name, md5 in sums.items() if not check_integrity(os.path.join(folder, name), md5)]
            if bad:
                raise ChecksumError(
                    f"cifar10: files in {folder} do not match the official MD5 sums: {', '.join(bad)}. "
                    f"Delete them and run with data.options.download=true, or set data.options.verify_checksums=false "
                    f"to load them anyway (e.g. a re-packed copy)."
                )


def _unpickle(path: Path) -> Any:
    """torchvision's read of one file (latin-1 pickle); a damaged file names itself."""
    with reading("cifar10", path, refetch(path.parent)):
        with open(path, "rb") as f:
            try:
                return pickle.load(f, encoding="latin1")
            except OSError:
                raise
            except Exception as err:  # truncated or garbled pickles raise many types (EOFError, UnpicklingError, ...)
                raise bad_data(
                    "cifar10",
                    path,
                    f"is not a readable CIFAR-10 pickle (truncated or damaged: {type(err).__name__}: {err})",
                    refetch(path.parent),
                ) from err


def read_batch(path: Path, num_classes: int) -> tuple[np.ndarray, Tensor]:
    """One batch file as (n, 3, 32, 32) uint8 pixels and int64 labels, every field checked."""
    entry = _unpickle(path)
    fix = refetch(path.parent)
    if not isinstance(entry, dict) or "data" not in entry or not ({"labels", "fine_labels"} & set(entry)):
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise bad_data(
            "cifar10", path, f"is not a CIFAR-10 batch (expected a dict with 'data' and 'labels', found {found})", fix
        )
    data = np.asarray(entry["data"])
    labels = entry["labels"] if "labels" in entry else entry["fine_labels"]
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS or data.shape[0] != len(labels):
        raise bad_data(
            "cifar10",
            path,
            f"holds 'data' of shape {data.shape} and dtype {data.dtype} with {len(labels)} labels; a batch holds "
            f"uint8 rows of {PIXELS} pixels (3 x 32 x 32), one per label",
            fix,
        )
    try:
        y = torch.as_tensor(np.asarray(labels))
    except (TypeError, ValueError) as err:
        raise bad_data("cifar10", path, f"holds labels that are not integers ({err})", fix) from err
    check_labels(y, num_classes, f"cifar10: {path}", fix)
    return data.reshape(-1, 3, 32, 32), y.to(torch.int64)


def read_classes(path: Path) -> list[str]:
    """The class names of batches.meta (``label_names``)."""
    meta = _unpickle(path)
    names = meta.get("label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or not names:
        raise bad_data("cifar10", path, "holds no list of 'label_names'", refetch(path.parent))
    return [str(n) for n in names]


def _read_split(folder: Path, names: list[str], num_classes: int) -> ImageSet:
    batches = [read_batch(folder / name, num_classes) for name in names]
    x = uint8_images(np.concatenate([b[0] for b in batches]))
    return ImageSet(x.contiguous(), torch.cat([b[1] for b in batches]))


@register_source("cifar10", size=lambda **_: (60_000, (3, 32, 32)))
def load_cifar10(
    root: str | os.PathLike | None = None, download: bool = False, verify_checksums: bool = True, **_: Any
) -> ImageSource:
    """50000 train / 10000 test RGB 32x32 images, 10 classes, pixels as published (row-major, RGB)."""
    base = data_root(root, "cifar10")
    official = torchvision_cifar10()
    folder = base / official.base_folder
    if download:
        base.mkdir(parents=True, exist_ok=True)
        by_hand = f"download {official.url} on a machine with network access and extract it into {base}"
        with downloading("cifar10", official.url, by_hand):
            official(str(base), train=True, download=True)
    check_cifar10_files(folder, verify_checksums)
    classes = read_classes(folder / official.meta["filename"])
    train = _read_split(folder, [name for name, _ in official.train_list], len(classes))
    test = _read_split(folder, [name for name, _ in official.test_list], len(classes))
    return ImageSource(name="cifar10", train=train, test=test, classes=classes)
