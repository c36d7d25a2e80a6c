"""Random crop (zero padding) and horizontal flip of a whole batch, on the batch's device.

Two gathers do both: every output pixel reads ``padded[b, c, dy_b + i, dx_b + j']`` with
``j' = j`` or ``w - 1 - j`` when image b is flipped (rows first, then columns: cheaper than one
four-index gather, about 2x on a CPU). Offsets and flips come from a
``torch.Generator`` on the same device, so a seed fixes them exactly and nothing crosses to the
host. Per-image parameters are drawn separately (``crop_flip_params``) so tests can check each
image against a plain slice, and so the loaders can draw a whole epoch's at once: a few kernels per
epoch instead of per batch (and per model, in a stacked fit), which a GPU would otherwise
spend launching between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

PAD_MODES = ("constant", "reflect", "replicate")


def crop_padding(side: int, fraction: float) -> int:
    """round(fraction * side), halves rounded up (0.125 * 32 = 4, * 64 = 8, * 8 = 1, * 4 = 1)."""
    return int(math.floor(fraction * side + 0.5))


@dataclass(frozen=True)
class Augmentation:
    """How training batches are augmented (``data.augment``): a random crop of the image padded by
    round(padding_fraction * side) on each side (filled as ``pad_mode`` says) and, with ``flip``, a random
    horizontal flip; ``per_batch``: one crop offset and one flip for a whole batch (protocol=original's
    ``augment_per_batch``), else one per image."""

    flip: bool = True
    padding_fraction: float = 0.125
    pad_mode: str = "constant"
    per_batch: bool = False

    def __post_init__(self) -> None:
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"data.pad_mode must be one of {PAD_MODES}, got {self.pad_mode!r}")

    def pads(self, x: Tensor) -> tuple[int, int]:
        """The crop padding (rows, columns) of images ``x`` (n, c, h, w); (0, 0) for other shapes."""
        if x.ndim != 4:
            return 0, 0
        return crop_padding(x.shape[2], self.padding_fraction), crop_padding(x.shape[3], self.padding_fraction)


@dataclass(frozen=True)
class CropFlip:
    """Per-image crop offsets in the padded image (dy, dx in [0, 2 * pad]) and flip flags."""

    dy: Tensor  # (n,) int64
    dx: Tensor  # (n,) int64
    flip: Tensor  # (n,) bool

    def rows(self, index: slice | int) -> "CropFlip":
        """The draws of some images (views: no kernel), e.g. one batch's slice of an epoch's draws."""
        return CropFlip(self.dy[index], self.dx[index], self.flip[index])


def crop_flip_params(
    n: int, pad_h: int, pad_w: int, flip: bool, generator: torch.Generator, device: torch.device
) -> CropFlip:
    dy = torch.randint(0, 2 * pad_h + 1, (n,), generator=generator, device=device)
    dx = torch.randint(0, 2 * pad_w + 1, (n,), generator=generator, device=device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=device).bool()
    if not flip:
        flips = torch.zeros_like(flips)
    return CropFlip(dy=dy, dx=dx, flip=flips)


def apply_crop_flip(x: Tensor, params: CropFlip, pad_h: int, pad_w: int, pad_mode: str = "constant") -> Tensor:
    """Crop each image of x (n, c, h, w) at its offset in the padded image and flip it if asked."""
    n, c, h, w = x.shape
    padded = F.pad(x, (pad_w, pad_w, pad_h, pad_h), mode=pad_mode) if (pad_h or pad_w) else x
    i = torch.arange(h, device=x.device)
    j = torch.arange(w, device=x.device)
    rows = params.dy[:, None] + i  # (n, h)
    cols = params.dx[:, None] + torch.where(params.flip[:, None], w - 1 - j, j)  # (n, w)
    strip = padded.gather(2, rows[:, None, :, None].expand(n, c, h, padded.shape[3]))
    return strip.gather(3, cols[:, None, None, :].expand(n, c, h, w))
