"""The one owner of a run's training device.

A run trains on exactly one device, chosen by the top-level ``device`` setting (auto | cpu |
cuda | cuda:N). The data module keeps every split there, the eraser is fitted and applied there,
the Trainer is told to use it, and the driver puts each model back there before it restores best
weights or scores a block: Lightning's strategy teardown moves the LightningModule to the CPU at
the end of every ``fit``, so nothing after a fit may assume the module is still where it trained.

``data.device`` (defaults to ``${device}``) and ``trainer.kwargs.accelerator`` (absent by
default) may still be given; if either contradicts the resolved device the run is refused with a
message that names both keys, before anything is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from datamodules.settings import resolve_device

LIGHTNING_CPU = ("cpu",)
LIGHTNING_CUDA = ("cuda", "gpu")


def training_device(device: str, data_device: str | None = None, accelerator: str | None = None) -> torch.device:
    """Resolve ``device`` and check that ``data.device`` and ``trainer.kwargs.accelerator`` agree with it."""
    setting = "device"
    if str(device) == "auto" and data_device not in (None, "auto"):
        device, setting = data_device, "data.device"  # data.device given explicitly: the run follows it
    resolved = resolve_device(str(device), setting=setting)
    if data_device not in (None, "auto", str(device)):
        data = resolve_device(str(data_device), setting="data.device")
        if data != resolved:
            raise ValueError(
                f"data.device={data_device} contradicts device={device} (resolved to {resolved}): the data must live "
                f"where the model trains. Set only the top-level `device=...` (data.device follows it)."
            )
    if accelerator not in (None, "auto"):
        kind = "cpu" if accelerator in LIGHTNING_CPU else "cuda" if accelerator in LIGHTNING_CUDA else None
        if kind is None:
            raise ValueError(
                f"trainer.kwargs.accelerator={accelerator!r} is not supported; use device=cpu or device=cuda"
            )
        if kind != resolved.type:
            raise ValueError(
                f"trainer.kwargs.accelerator={accelerator} contradicts data.device/device={data_device or device} "
                f"(resolved to {resolved}); the Trainer must use the device the data lives on. Remove "
                f"trainer.kwargs.accelerator and set the top-level `device=cpu` or `device=cuda`."
            )
    return resolved


def lightning_device_kwargs(device: torch.device) -> dict[str, Any]:
    """Trainer arguments that pin Lightning to ``device`` (one process, one device)."""
    if device.type == "cuda":
        return {
            "accelerator": "cuda",
            "devices": [device.index if device.index is not None else torch.cuda.current_device()],
        }
    return {"accelerator": "cpu", "devices": 1}
