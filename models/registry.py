"""One registry of model builders and one entry point, ``create_model``, that makes them muP.

A builder is a plain function ``(width, depth, num_classes, input_shape, **options) -> nn.Module``
whose classifier head is a ``mup.MuReadout``. ``create_model`` builds the requested model, a base
model at ``base_width`` and a delta model at twice that (both on the meta device, so they cost
nothing, and cached), calls ``mup.set_base_shapes`` and re-initialises every weight with muP variances.

A builder may register a ``resolve`` function that turns width-dependent choices into explicit
options once, at the requested width (LeNet's channel counts, chosen to match the MLP's parameter
count). The base and delta models are then built with the same explicit options, so those
dimensions are finite for muP instead of being mistaken for width dimensions.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any, Callable, Sequence

import torch
from mup.shape import get_shapes
from torch import nn

from models.mup_setup import INITS, apply_mup, apply_mup_over_builder_init, apply_standard

ModelBuilder = Callable[..., nn.Module]
OptionResolver = Callable[..., dict[str, Any]]
_MODELS: dict[str, ModelBuilder] = {}
_RESOLVERS: dict[str, OptionResolver] = {}
# The shipped models' modules, each imported (registering its model) when its name is first asked for: a run imports
# only its own model's code (ConvNeXt's and Swin's import timm: about 0.7 s, and W&B through it).
_ON_DEMAND = {"convnext": "models.convnext", "lenet": "models.lenet", "mlp": "models.mlp", "swin": "models.swin"}


def register_model(name: str, resolve: OptionResolver | None = None) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator: ``@register_model("lenet", resolve=fn)``; ``fn(width, depth, num_classes,
    input_shape, **options) -> options`` fills in width-dependent options at the target width."""

    def wrap(fn: ModelBuilder) -> ModelBuilder:
        if name in _MODELS and not _same_code(_MODELS[name], fn):
            raise ValueError(f"model name {name!r} is registered twice")
        _MODELS[name] = fn
        if resolve is not None:
            _RESOLVERS[name] = resolve
        return fn

    return wrap


def _same_code(a: ModelBuilder, b: ModelBuilder) -> bool:
    """The same function defined again (a module reloaded, or run as ``python -m``)."""
    return a.__qualname__ == b.__qualname__ and a.__code__.co_filename == b.__code__.co_filename


def check_image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    """(channels, height, width), or an error naming the model that needs an image."""
    if len(input_shape) != 3:
        raise ValueError(f"{model} needs images shaped (channels, height, width), got input shape {tuple(input_shape)}")
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def available_models() -> list[str]:
    return sorted({*_MODELS, *_ON_DEMAND})


def _register_on_demand(name: str) -> None:
    """Import the module of a model registered on demand (``_ON_DEMAND``), which registers it."""
    if name not in _MODELS and name in _ON_DEMAND:
        importlib.import_module(_ON_DEMAND[name])


def model_builder(name: str) -> ModelBuilder:
    _register_on_demand(name)
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {available_models()} (e.g. `model=mlp`)")
    return _MODELS[name]


def resolve_options(
    name: str, width: int, depth: int, num_classes: int, input_shape: tuple[int, ...], **options: Any
) -> dict[str, Any]:
    """The builder options with width-dependent choices made explicit at ``width``."""
    _register_on_demand(name)
    resolve = _RESOLVERS.get(name)
    if resolve is None:
        return dict(options)
    return resolve(width=width, depth=depth, num_classes=num_classes, input_shape=input_shape, **options)


def create_model(
    name: str,
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    base_width: int | None = 128,
    init: str = "mup",
    **options: Any,
) -> nn.Module:
    """Build model ``name`` at (width, depth).

    With ``base_width`` set it is muP (base shapes from models at base_width and 2 * base_width);
    with ``base_width=None`` it is the standard parametrisation with the builder's own init.
    ``init`` (muP only): ``mup`` re-initialises every layer with muP's variances; ``original`` keeps the
    builder's own initialisation (``models.mup_setup.apply_mup_over_builder_init``). ``options`` go to the builder.
    """
    if init not in INITS:
        raise ValueError(f"model.init={init!r}: use one of {', '.join(INITS)}")
    build = model_builder(name)
    for key, value in (("width", width), ("depth", depth), ("num_classes", num_classes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if base_width is not None and (not isinstance(base_width, int) or base_width < 1):
        raise ValueError(
            f"model.base_width must be a positive integer or null (standard parametrisation), got {base_width!r}"
        )
    input_shape = tuple(int(s) for s in input_shape)
    builder_options = resolve_options(name, width, depth, num_classes, input_shape, **options)

    def make(at_width: int) -> nn.Module:
        return build(width=at_width, depth=depth, num_classes=num_classes, input_shape=input_shape, **builder_options)

    model = make(width)
    if base_width is None:
        apply_standard(model)
    else:
        base, delta = reference_shapes(name, base_width, depth, num_classes, input_shape, _freeze(builder_options))
        (apply_mup if init == "mup" else apply_mup_over_builder_init)(model, base, delta)
    return model


def _freeze(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=str)


@functools.lru_cache(maxsize=64)
def reference_shapes(
    name: str, base_width: int, depth: int, num_classes: int, input_shape: tuple[int, ...], frozen_options: str
) -> tuple[dict[str, torch.Size], dict[str, torch.Size]]:
    """Parameter shapes of the muP base (base_width) and delta (2 x base_width) models.

    Built on the meta device (no memory, no init cost beyond Python overhead) and cached: the
    prequential driver builds one model per block with the same arguments.
    """
    options = json.loads(frozen_options)

    def make(at_width: int) -> nn.Module:
        return model_builder(name)(
            width=at_width, depth=depth, num_classes=num_classes, input_shape=input_shape, **options
        )

    with torch.device("meta"):
        base = _build_reference(make, base_width, "base", name)
        delta = _build_reference(make, 2 * base_width, "delta (2 x base)", name)
    return get_shapes(base), get_shapes(delta)


def _build_reference(make: Callable[[int], nn.Module], at_width: int, role: str, name: str) -> nn.Module:
    """A muP reference model; its errors name the base width, which is what the user must change."""
    try:
        return make(at_width)
    except ValueError as err:
        raise ValueError(
            f"cannot build the muP {role} {name} model at width {at_width}: {err} "
            f"(the base width is model.base_width; choose one that satisfies this constraint, "
            f"or null for the standard parametrisation)"
        ) from err
