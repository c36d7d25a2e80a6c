"""One registry of model builders and one entry point, ``create_model``, that makes them muP.

A builder is a plain function ``(width, depth, num_classes, input_shape, **options) -> nn.Module``
whose classifier head is a ``mup.MuReadout``. ``create_model`` builds the requested model, a base
model at ``base_width`` and a delta model at twice that (both on the meta device, so they cost
nothing), calls ``mup.set_base_shapes`` and re-initialises the hidden weights with muP variances.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from models.mup_setup import apply_mup

ModelBuilder = Callable[..., nn.Module]
_MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def wrap(fn: ModelBuilder) -> ModelBuilder:
        if name in _MODELS:
            raise ValueError(f"model name {name!r} is registered twice")
        _MODELS[name] = fn
        return fn

    return wrap


def available_models() -> list[str]:
    return sorted(_MODELS)


def model_builder(name: str) -> ModelBuilder:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {available_models()} (e.g. `model=mlp`)")
    return _MODELS[name]


def create_model(
    name: str,
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    base_width: int | None = 128,
    **options: Any,
) -> nn.Module:
    """Build model ``name`` at (width, depth); with ``base_width`` set, parametrise it in muP."""
    build = model_builder(name)
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1, got width={width}, depth={depth}")
    model = build(width=width, depth=depth, num_classes=num_classes, input_shape=tuple(input_shape), **options)
    if base_width is None:
        return model
    with torch.device("meta"):
        base = build(width=base_width, depth=depth, num_classes=num_classes, input_shape=tuple(input_shape), **options)
        delta = build(width=2 * base_width, depth=depth, num_classes=num_classes, input_shape=tuple(input_shape), **options)
    apply_mup(model, base, delta)
    return model
