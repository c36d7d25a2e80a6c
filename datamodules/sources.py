"""Image sources: each returns its images as float32 (n, c, h, w) in [0, 1] with int64 labels.

A source is a function registered by name (``@register_source("cifar10", size=...)``) that takes the
options of its ``conf/data/*.yaml`` and returns an ``ImageSource``; ``size`` declares, from the same options and
without loading anything, how many images of which shape it returns (``declared_bytes``: what a packed sweep sizes
its packs by, mdl.run.pack). Sources with an official
test split return it; the data module splits validation (and, where there is no official test
split, test) off the training set with ``data_seed``.

Every source is checked where it is read (each file-based loader names the file) and once more
by ``load_source`` (integer labels in 0..K-1 in every split, finite pixels, one image shape,
training images not all identical), so a bad label that would land in the validation or test
split, where no eraser looks at it, stops the run at load time.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from datamodules.data_root import BadDataError
from datamodules.settings import refuse_unknown

CHECK_CHUNK = 8192  # rows checked at once (bounds the temporaries on big data sets)


@dataclass(frozen=True)
class ImageSet:
    x: Tensor  # float32 (n, c, h, w) in [0, 1]
    y: Tensor  # int64 (n,)

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(
                f"ImageSet wants x (n, c, h, w) and y (n,), got {tuple(self.x.shape)} and {tuple(self.y.shape)}"
            )

    def __len__(self) -> int:
        return self.x.shape[0]


@dataclass(frozen=True)
class ImageSource:
    name: str
    train: ImageSet
    test: ImageSet | None  # the official test split, when the data set has one
    classes: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.x.shape[1:])  # type: ignore[return-value]


SourceLoader = Callable[..., ImageSource]
SourceSize = Callable[..., tuple[int, tuple[int, ...]]]  # a source's options -> (images in all its splits, their shape)
_SOURCES: dict[str, SourceLoader] = {}
_SIZES: dict[str, SourceSize] = {}
# The shipped sources' modules, imported when their name is first used (a digits run imports none of the CIFAR, SVHN
# or synthetic loaders). Importing a module registers its sources; digits is registered below.
SHIPPED = {
    "cifar10": "datamodules.cifar10",
    "cifarnet": "datamodules.cifarnet",
    "multiscale_linear": "datamodules.teacher_student",
    "single_index": "datamodules.teacher_student",
    "svhn": "datamodules.svhn",
    "synthetic": "datamodules.synthetic",
}


def register_source(name: str, size: SourceSize) -> Callable[[SourceLoader], SourceLoader]:
    def wrap(fn: SourceLoader) -> SourceLoader:
        _SOURCES[name], _SIZES[name] = fn, size
        return fn

    return wrap


def declared_bytes(name: str, options: dict[str, Any]) -> int:
    """The bytes the source's images (float32) and labels (int64) take in memory, every split together, as its
    ``size`` declares them from ``options`` (nothing is loaded): what one data module of it holds, at most."""
    if not is_registered(name):
        load_source(name, **options)  # the error naming the known sources
    images, shape = _SIZES[name](**options)
    return images * (math.prod(shape) * 4 + 8)


def available_sources() -> list[str]:
    return sorted(set(_SOURCES) | set(SHIPPED))


def is_registered(name: str) -> bool:
    """Whether ``name`` is a source, its module imported (registering it) if it is a shipped one."""
    if name not in _SOURCES and name in SHIPPED:
        importlib.import_module(SHIPPED[name])
    return name in _SOURCES


def load_source(name: str, **options: Any) -> ImageSource:
    """Load the data set registered as ``name`` with the options of its conf/data yaml."""
    if not is_registered(name):
        raise ValueError(
            f"unknown data source {name!r} (data.source); choose one of {available_sources()} "
            f"with data=<name>, e.g. `data=digits`"
        )
    check_source_options(name, options)
    source = _SOURCES[name](**options)
    check_source(source)
    return source


def source_options(name: str) -> list[str]:
    """The options a registered source takes (its loader's named parameters)."""
    is_registered(name)
    parameters = inspect.signature(_SOURCES[name]).parameters.values()
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_source_options(name: str, options: dict[str, Any]) -> None:
    """An option the source does not take (``+data.options.n_tset=0``) would be ignored silently: refuse it."""
    refuse_unknown(
        options, source_options(name), "data.options", f"data source {name!r} takes no such option, it would be ignored"
    )


def check_labels(y: Tensor, num_classes: int, where: str, fix: str) -> None:
    """Integer labels in 0..K-1: a label out of range would crash training or, in a held-out
    split, silently score against a class that does not exist."""
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise BadDataError(f"{where}: labels must be integer class indices, found dtype {y.dtype}. To fix it: {fix}.")
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()
        shown = ", ".join(f"#{int(i)}: {int(y[i])}" for i in rows[:5])
        raise BadDataError(
            f"{where}: {rows.numel()} label(s) outside 0..{num_classes - 1} (the {num_classes} classes), "
            f"e.g. {shown}{', ...' if rows.numel() > 5 else ''}. To fix it: {fix}."
        )


def check_pixels(x: Tensor, where: str, fix: str) -> None:
    """Float (n, c, h, w) pixels without NaN or infinity (they would poison every moment)."""
    if x.ndim != 4 or not x.is_floating_point():
        raise BadDataError(
            f"{where}: images must be float (n, c, h, w), got {x.dtype} {tuple(x.shape)}. To fix it: {fix}."
        )
    bad = sum(int((~torch.isfinite(x[i : i + CHECK_CHUNK])).sum()) for i in range(0, x.shape[0], CHECK_CHUNK))
    if bad:
        raise BadDataError(f"{where}: {bad} pixel value(s) are NaN or infinite. To fix it: {fix}.")


def check_source(source: ImageSource) -> None:
    """What every loader must hand over, checked for all splits (see the module docstring)."""
    fix = f"check the files or data.options of data source {source.name!r}"
    splits = {"train": source.train, **({"test": source.test} if source.test is not None else {})}
    for split, images in splits.items():
        where = f"data source {source.name!r}, {split} split"
        check_pixels(images.x, where, fix)
        check_labels(images.y, source.num_classes, where, fix)
    if source.test is not None and source.test.x.shape[1:] != source.train.x.shape[1:]:
        raise BadDataError(
            f"data source {source.name!r}: test images are {tuple(source.test.x.shape[1:])}, training images "
            f"{tuple(source.train.x.shape[1:])}. To fix it: {fix}."
        )
    x = source.train.x
    if len(x) > 1 and bool((x.amax(0) == x.amin(0)).all()):
        raise BadDataError(
            f"data source {source.name!r}: all {len(x)} training images are identical (zero variance in every "
            f"pixel), so there is nothing to learn and nothing to erase. To fix it: {fix} (e.g. a synthetic "
            f"data.options.std below float32 resolution)."
        )


def stream_generator(source: str, seed: int, part: str) -> torch.Generator:
    """A generated source's independent random stream ``part`` of ``seed`` (its parameters, each split), so changing
    one split's size keeps the others."""
    digest = hashlib.sha256(f"{source}/{int(seed)}/{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def uint8_images(array: Any) -> Tensor:
    """(n, h, w, c) or (n, c, h, w) uint8 pixels -> float32 (n, c, h, w) in [0, 1]."""
    x = torch.as_tensor(array)
    if x.dtype != torch.uint8:
        raise TypeError(f"expected uint8 pixels, got {x.dtype}")
    return x.float().div_(255.0)


@register_source("digits", size=lambda **_: (1797, (1, 8, 8)))
def load_digits_source(**_: Any) -> ImageSource:
    """scikit-learn's shipped 8x8 digits (1797 real scans), 16 grey levels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return ImageSource(name="digits", train=ImageSet(x, y), test=None, classes=[str(c) for c in range(10)])
