"""bf16 autocast and torch.compile as model options (``model.options.autocast`` / ``.compile``).

Both are settings of the model, not of its shapes, so ``create_model`` takes them out of the
builder options and applies them here:

- ``autocast``: ``false`` (off), ``bf16`` (bf16 autocast wherever the input lives) or ``auto``
  (bf16 autocast only when the input is on a CUDA device: off on CPU, where bf16 matmuls are
  slow and the embedded runs should stay exact). The choice is stored on the model
  (``autocast_dtype``) and applied by ``autocast_context`` around every forward of
  ``models.module.Classifier``; logits are returned in float32.
- ``compile``: ``false``, ``true`` (torch.compile with the inductor backend) or a backend name.
  Compiles in place (``nn.Module.compile``), so parameter names, state dicts and checkpoints are
  unchanged. Off by default: each prequential block builds a fresh model, and compiling costs
  tens of seconds per build, more than small models gain.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

AUTOCAST_CHOICES = (False, "bf16", "auto")
PRECISION_OPTIONS = ("autocast", "compile")


def split_precision_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(builder options, precision options)."""
    builder = {k: v for k, v in options.items() if k not in PRECISION_OPTIONS}
    precision = {k: v for k, v in options.items() if k in PRECISION_OPTIONS}
    return builder, precision


def configure_precision(model: nn.Module, autocast: Any = False, compile: Any = False) -> nn.Module:
    """Record the autocast choice on ``model`` and compile it in place if asked."""
    if autocast is None:
        autocast = False
    if autocast not in AUTOCAST_CHOICES:
        raise ValueError(f"model.options.autocast must be one of {AUTOCAST_CHOICES}, got {autocast!r}")
    model.autocast_mode = autocast  # type: ignore[assignment]
    if compile:
        backend = compile if isinstance(compile, str) else "inductor"
        model.compile(backend=backend)
    elif compile not in (False, None):
        raise ValueError(f"model.options.compile must be false, true or a torch.compile backend name, got {compile!r}")
    return model


def autocast_context(model: nn.Module, x: torch.Tensor) -> ContextManager[Any]:
    """The autocast context the model asked for, for an input on ``x.device``."""
    mode = getattr(model, "autocast_mode", False)
    device_type = x.device.type
    if mode == "bf16" or (mode == "auto" and device_type == "cuda"):
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_with_precision(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model(x) under the model's autocast choice; float32 logits whatever the compute dtype."""
    with autocast_context(model, x):
        out = model(x)
    return out.float()
