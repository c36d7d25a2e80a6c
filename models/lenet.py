"""LeNet, parameter-matched to the MLP of the same width and depth.

Architecture: Conv(C, c1, 5x5)-act-MaxPool(2), Conv(c1, c2, 5x5)-act-MaxPool(2), then ``depth``
dense layers of ``width`` units (Linear(c2 * s^2, width)-act, (depth - 1) x [Linear(width,
width)-act]) and a MuReadout. At depth 2 that is the classic "two convolutions, two dense layers,
readout". Depth means the same as for the MLP: the number of dense hidden layers, each of
``width`` units, so LeNet and MLP differ only in how the input reaches the first hidden layer.

Padding: ``auto`` = 0 (the classic LeNet geometry: 32 -> 28 -> 14 -> 10 -> 5) when the input is
at least 16 pixels on each side, else 2 ('same': 8 -> 8 -> 4 -> 4 -> 2), so the 5x5 kernels fit
digits' 8x8 images; an int sets it.

Parameter matching (``lenet_channels``): the dense layers after the first are identical to the
MLP's, so the convolutions plus the first dense layer must cost what the MLP's input layer costs,
(d + 1) * width. The search scans c2 = 1, 2, ... with c1 within one channel of
channel_ratio * c2 (classic LeNet: 6 / 16) and keeps the pair whose total count is nearest the
MLP's; only if that is more than 1% off does it drop the ratio and try every c1 <= c2. A step of
c2 changes the count by about s^2 * width, a fraction s^2 / d of the input layer (1/123 on
CIFAR-10, 1/16 on digits), and c1 refines it, so over the paper's grid (widths 64..2048, depths
1..8) the match is within 0.3% on 32x32, 0.6% on 64x64 and 0.9% on 8x8 inputs
(``parameter_match_table``; ``python -m models.lenet`` prints it). It can fail only at tiny
widths on tiny inputs (e.g. width 1 on 8x8), where the convolutions' own weights outweigh the
MLP's whole input layer; the builder then warns with the numbers. The channels are fixed at the requested width
(``register_model(..., resolve=...)``), so muP treats them as finite: the convolutions and the
first dense layer are input layers (lr unscaled, O(1) init), the dense layers after it hidden.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable, Sequence

from mup import MuReadout
from torch import Tensor, nn

from models.mlp import mlp_param_count
from models.registry import check_image_shape, register_model

KERNEL = 5
MATCH_TOLERANCE = 0.05  # warn beyond this
CLOSE = 0.01  # search: keep LeNet's channel ratio when that gets this close


def resolve_padding(padding: int | str, height: int, width: int) -> int:
    if padding == "auto":
        return 0 if min(height, width) >= 16 else 2
    if not isinstance(padding, int) or padding < 0:
        raise ValueError(f"lenet padding must be 'auto' or a non-negative integer, got {padding!r}")
    return padding


def feature_side(side: int, padding: int) -> int:
    """Side after two [5x5 conv, 2x2 max-pool] stages."""
    for _ in range(2):
        side = (side + 2 * padding - KERNEL + 1) // 2
    return side


def feature_grid(input_shape: Sequence[int], padding: int | str) -> tuple[int, int]:
    _, h, w = check_image_shape(input_shape, "lenet")
    p = resolve_padding(padding, h, w)
    sh, sw = feature_side(h, p), feature_side(w, p)
    if sh < 1 or sw < 1:
        raise ValueError(
            f"lenet: a {h}x{w} input with padding {p} vanishes after two 5x5 convolutions and 2x2 poolings; "
            f"use inputs of at least 4x4 with padding 2 (model.options.padding=2) or at least 16x16 with padding 0"
        )
    return sh, sw


def lenet_param_count(
    input_shape: Sequence[int], channels: Sequence[int], width: int, depth: int, num_classes: int, padding: int | str = "auto"
) -> int:
    in_channels = int(input_shape[0])
    c1, c2 = channels
    sh, sw = feature_grid(input_shape, padding)
    convs = (in_channels * KERNEL**2 + 1) * c1 + (c1 * KERNEL**2 + 1) * c2
    return convs + (c2 * sh * sw + 1) * width + (depth - 1) * (width + 1) * width + (width + 1) * num_classes


def lenet_channels(
    input_shape: Sequence[int],
    width: int,
    depth: int,
    num_classes: int,
    padding: int | str = "auto",
    channel_ratio: float = 6 / 16,
) -> tuple[int, int]:
    """(c1, c2) whose LeNet parameter count matches the MLP's at this width and depth.

    First the nearest count with c1 within one channel of ``channel_ratio * c2`` (LeNet's shape);
    if that is not within ``CLOSE`` (1%) of the MLP's count (tiny widths on tiny inputs, where
    the convolutions are a large share), the nearest count over all c1 <= c2.
    """
    if channel_ratio <= 0:
        raise ValueError(f"lenet channel_ratio must be positive, got {channel_ratio}")
    in_channels = int(input_shape[0])
    sh, sw = feature_grid(input_shape, padding)
    target = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
    rest = width + (depth - 1) * (width + 1) * width + (width + 1) * num_classes  # same as the MLP's

    def count(c1: int, c2: int) -> int:
        return (in_channels * KERNEL**2 + 1) * c1 + (c1 * KERNEL**2 + 1) * c2 + c2 * sh * sw * width + rest

    def nearest(first_channels: Callable[[int], Iterable[int]]) -> tuple[int, int]:
        best: tuple[int, tuple[int, int]] = (abs(count(1, 1) - target), (1, 1))
        c2 = 0
        while count(1, c2 + 1) - target <= best[0]:  # counts grow with c1 and c2: stop when all are worse
            c2 += 1
            for c1 in first_channels(c2):
                best = min(best, (abs(count(c1, c2) - target), (c1, c2)))
        return best[1]

    def classic(c2: int) -> Iterable[int]:
        centre = round(channel_ratio * c2)
        return [c1 for c1 in (centre - 1, centre, centre + 1) if 1 <= c1 <= c2]

    channels = nearest(classic)
    if abs(count(*channels) - target) <= CLOSE * target:
        return channels
    return nearest(lambda c2: range(1, c2 + 1))


def parameter_match(input_shape: Sequence[int], width: int, depth: int, num_classes: int = 10, **options: Any) -> dict[str, Any]:
    """The search's outcome at one grid point: channels, both counts, relative gap."""
    padding = options.get("padding", "auto")
    channels = lenet_channels(input_shape, width, depth, num_classes, padding, options.get("channel_ratio", 6 / 16))
    lenet = lenet_param_count(input_shape, channels, width, depth, num_classes, padding)
    mlp = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
    return {"width": width, "depth": depth, "channels": channels, "lenet": lenet, "mlp": mlp, "rel_gap": lenet / mlp - 1}


def parameter_match_table(
    input_shape: Sequence[int] = (3, 32, 32),
    widths: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    depths: Sequence[int] = tuple(range(1, 9)),
    num_classes: int = 10,
) -> list[dict[str, Any]]:
    return [parameter_match(input_shape, w, d, num_classes) for w in widths for d in depths]


class LeNet(nn.Module):
    def __init__(
        self,
        input_shape: Sequence[int],
        channels: Sequence[int],
        width: int,
        depth: int,
        num_classes: int,
        padding: int | str = "auto",
        activation: str = "relu",
    ) -> None:
        super().__init__()
        in_channels, h, w = check_image_shape(input_shape, "lenet")
        if len(channels) != 2 or min(channels) < 1:
            raise ValueError(f"lenet channels must be two positive integers [c1, c2], got {channels!r}")
        if activation not in ("relu", "gelu"):
            raise ValueError(f"lenet activation must be relu or gelu, got {activation!r}")
        act = nn.ReLU if activation == "relu" else nn.GELU
        p = resolve_padding(padding, h, w)
        sh, sw = feature_grid(input_shape, p)
        c1, c2 = (int(c) for c in channels)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, KERNEL, padding=p), act(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, KERNEL, padding=p), act(), nn.MaxPool2d(2),
        )
        dims = [c2 * sh * sw] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), act()]
        self.dense = nn.Sequential(*layers)
        self.head = MuReadout(width, num_classes, readout_zero_init=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dense(self.features(x).flatten(1)))


def resolve_lenet(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    channels: Sequence[int] | None = None,
    padding: int | str = "auto",
    channel_ratio: float = 6 / 16,
    **options: Any,
) -> dict[str, Any]:
    """Choose the channels at the requested width (once, before the muP base models are built)."""
    if channels is None:
        channels = lenet_channels(input_shape, width, depth, num_classes, padding, channel_ratio)
        lenet = lenet_param_count(input_shape, channels, width, depth, num_classes, padding)
        mlp = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
        if abs(lenet / mlp - 1) > MATCH_TOLERANCE:
            warnings.warn(
                f"lenet at width {width}, depth {depth} on {tuple(input_shape)}: the nearest parameter count is "
                f"{lenet} (channels {channels}) against the MLP's {mlp} ({lenet / mlp - 1:+.1%}); even the smallest "
                f"convolutions cost more than the MLP's input layer here",
                stacklevel=2,
            )
    return {"channels": list(channels), "padding": padding, **options}


@register_model("lenet", resolve=resolve_lenet)
def build_lenet(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    channels: Sequence[int] | None = None,
    padding: int | str = "auto",
    activation: str = "relu",
    channel_ratio: float = 6 / 16,
    **options: Any,
) -> LeNet:
    if options:
        raise ValueError(f"unknown lenet options {sorted(options)}; it takes channels, padding, activation, channel_ratio")
    if channels is None:
        channels = lenet_channels(input_shape, width, depth, num_classes, padding, channel_ratio)
    return LeNet(input_shape, channels, width, depth, num_classes, padding, activation)


def main() -> None:
    """Print the LeNet vs MLP parameter-count table for the paper's grid."""
    for shape in ((3, 32, 32), (3, 64, 64), (1, 8, 8)):
        rows = parameter_match_table(shape)
        print(f"input {shape}: LeNet / MLP - 1 (channels c1,c2), widths x depths 1..8")
        for w in sorted({r["width"] for r in rows}):
            cells = [f"{r['rel_gap']:+.2%} ({r['channels'][0]},{r['channels'][1]})" for r in rows if r["width"] == w]
            print(f"  width {w:5d}: " + "  ".join(cells))
        worst = max(rows, key=lambda r: abs(r["rel_gap"]))
        print(f"  worst: width {worst['width']} depth {worst['depth']}: {worst['rel_gap']:+.3%}")


if __name__ == "__main__":
    main()
