"""Image sources: each returns its images as float32 (n, c, h, w) in [0, 1] with int64 labels.

A source is a function registered by name (``@register_source("cifar10")``) that takes the
options of its ``conf/data/*.yaml`` and returns an ``ImageSource``. Sources with an official
test split return it; the data module splits validation (and, where there is no official test
split, test) off the training set with ``data_seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class ImageSet:
    x: Tensor  # float32 (n, c, h, w) in [0, 1]
    y: Tensor  # int64 (n,)

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"ImageSet wants x (n, c, h, w) and y (n,), got {tuple(self.x.shape)} and {tuple(self.y.shape)}")

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
_SOURCES: dict[str, SourceLoader] = {}


def register_source(name: str) -> Callable[[SourceLoader], SourceLoader]:
    def wrap(fn: SourceLoader) -> SourceLoader:
        _SOURCES[name] = fn
        return fn

    return wrap


def available_sources() -> list[str]:
    return sorted(_SOURCES)


def load_source(name: str, **options: Any) -> ImageSource:
    """Load the data set registered as ``name`` with the options of its conf/data yaml."""
    if name not in _SOURCES:
        raise ValueError(f"unknown data source {name!r}; choose one of {available_sources()} (e.g. `data=digits`)")
    return _SOURCES[name](**options)


def uint8_images(array: Any) -> Tensor:
    """(n, h, w, c) or (n, c, h, w) uint8 pixels -> float32 (n, c, h, w) in [0, 1]."""
    x = torch.as_tensor(array)
    if x.dtype != torch.uint8:
        raise TypeError(f"expected uint8 pixels, got {x.dtype}")
    return x.float().div_(255.0)


@register_source("digits")
def load_digits_source(**_: Any) -> ImageSource:
    """scikit-learn's shipped 8x8 digits (1797 real scans), 16 grey levels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return ImageSource(name="digits", train=ImageSet(x, y), test=None, classes=[str(c) for c in range(10)])
