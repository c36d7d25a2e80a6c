"""LeNet, parameter-matched to the MLP of the same width and depth: two variants (``model.options.variant``).

``original`` (the default): the original code's LeNet (EleutherAI/mdl mdl/lenet_probe.py, commit 2a41748,
``LeNet5``): Conv(C, c1, 5x5)-relu-MaxPool(2), Conv(c1, c2, 5x5)-relu-MaxPool(2), Linear(c2 s^2, f1)-relu,
Linear(f1, f2)-relu, and a zero-initialised MuReadout(f2, K): always two convolutions and two dense
layers. Its sizes come from the original's search (experiments/generate_parameter_matched_conv.py
``find_closest_config``): c1, c2 in {32, 40, 48, 64, 128} and f1, f2 in {64, 128, 256, 512, 1024, 2048},
scanned in that order (convolutions outer, dense inner), keeping the first configuration whose parameter
count is nearest the MLP's (``mlp_parameter_count``: input layer, depth - 1 hidden layers, readout,
biases included). So ``width`` and ``depth`` change only that target: at width 128, depth 2 on CIFAR-10
it is conv (128, 40), dense (256, 64). The original counted the MLP at a 3x32x32 input and 10 classes;
here the run's own input shape and classes (the same numbers on CIFAR-10). The original built its muP
base model with these same sizes (cli.py passes one conv/fc configuration to both), so muP changes no
learning rate; here the sizes are fixed at the requested width (``register_model(..., resolve=...)``),
which gives the same. Learning rate depth scaling (lr * (2 / depth) ** 0.5) applies as in cli.py.

``dense_stack`` (ours): the same two convolutions, then ``depth`` dense layers of
``width`` units; channels searched so the count matches the MLP's (``lenet_channels``; within 1% on the
paper's grid). Depth then means what it means for the MLP.

Padding: the original's convolutions have none (32 -> 28 -> 14 -> 10 -> 5). ``auto`` keeps that for
inputs of at least 16 pixels a side and uses 2 ('same': 8 -> 8 -> 4 -> 4 -> 2) below, so the 5x5 kernels
fit digits' 8x8 images (ours); an int sets it. ``python -m models.lenet`` prints the matching tables.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, Callable, Iterable, Sequence

from mup import MuReadout
from torch import Tensor, nn

from models import stacked_ops
from models.mlp import mlp_param_count
from models.registry import check_image_shape, register_model

KERNEL = 5
VARIANTS = ("original", "dense_stack")
ACTIVATIONS = ("relu", "gelu")
CONV_SIZES = (32, 40, 48, 64, 128)  # original: generate_parameter_matched_conv.py find_closest_config
DENSE_SIZES = (64, 128, 256, 512, 1024, 2048)  # original: the same function
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


def param_count(
    input_shape: Sequence[int],
    channels: Sequence[int],
    dense: Sequence[int],
    num_classes: int,
    padding: int | str = "auto",
) -> int:
    """Parameters of a LeNet (two convolutions, dense layers of sizes ``dense``, readout; biases included)."""
    return _count(int(input_shape[0]), feature_grid(input_shape, padding), channels, dense, num_classes)


def _count(
    in_channels: int, grid: tuple[int, int], channels: Sequence[int], dense: Sequence[int], num_classes: int
) -> int:
    (c1, c2), (sh, sw) = channels, grid
    dims = [c2 * sh * sw, *dense, num_classes]
    convs = (in_channels * KERNEL**2 + 1) * c1 + (c1 * KERNEL**2 + 1) * c2
    return convs + sum((a + 1) * b for a, b in zip(dims[:-1], dims[1:]))


def original_sizes(
    input_shape: Sequence[int], width: int, depth: int, num_classes: int, padding: int | str = "auto"
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((c1, c2), (f1, f2)): the original's search (find_closest_config) for the MLP's count at this width
    and depth: convolutions outer, dense inner, each over its grid in order; the first nearest is kept."""
    target = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
    grid = itertools.product(itertools.product(CONV_SIZES, repeat=2), itertools.product(DENSE_SIZES, repeat=2))
    # min keeps the first of equally near configurations, as the original's strict comparison
    return min(grid, key=lambda sizes: abs(param_count(input_shape, *sizes, num_classes, padding) - target))


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
    grid = feature_grid(input_shape, padding)
    target = mlp_param_count(math.prod(input_shape), width, depth, num_classes)

    def count(c1: int, c2: int) -> int:
        return _count(int(input_shape[0]), grid, (c1, c2), [width] * depth, num_classes)

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


def lenet_sizes(
    input_shape: Sequence[int],
    width: int,
    depth: int,
    num_classes: int,
    variant: str = "original",
    channels: Sequence[int] | None = None,
    dense: Sequence[int] | None = None,
    padding: int | str = "auto",
    channel_ratio: float = 6 / 16,
) -> tuple[Sequence[int], Sequence[int]]:
    """(channels, dense sizes) of ``variant`` at this width and depth: the given ones, the search filling in the
    rest (``original_sizes``; dense_stack: ``lenet_channels`` and ``depth`` dense layers of ``width``)."""
    if variant not in VARIANTS:
        raise ValueError(f"model.options.variant={variant!r}: choose one of {list(VARIANTS)}")
    if variant == "dense_stack":
        if channels is None:  # (an empty list is refused when the model is built, not searched)
            channels = lenet_channels(input_shape, width, depth, num_classes, padding, channel_ratio)
        return channels, [width] * depth
    if channels is None or dense is None:
        conv, fc = original_sizes(input_shape, width, depth, num_classes, padding)
        channels, dense = channels or conv, dense or fc
    return channels, dense


def parameter_match(
    input_shape: Sequence[int], width: int, depth: int, num_classes: int = 10, **options: Any
) -> dict[str, Any]:
    """The search's outcome at one grid point: channels (and dense sizes), both counts, relative gap."""
    variant, padding = options.get("variant", "original"), options.get("padding", "auto")
    channels, dense = lenet_sizes(
        input_shape,
        width,
        depth,
        num_classes,
        variant,
        padding=padding,
        channel_ratio=options.get("channel_ratio", 6 / 16),
    )
    lenet = param_count(input_shape, channels, dense, num_classes, padding)
    mlp = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
    dense_sizes = {"dense": dense} if variant == "original" else {}
    return {
        "width": width,
        "depth": depth,
        "channels": channels,
        **dense_sizes,
        "lenet": lenet,
        "mlp": mlp,
        "rel_gap": lenet / mlp - 1,
    }


def parameter_match_table(
    input_shape: Sequence[int] = (3, 32, 32),
    widths: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    depths: Sequence[int] = tuple(range(1, 9)),
    num_classes: int = 10,
    variant: str = "original",
) -> list[dict[str, Any]]:
    return [parameter_match(input_shape, w, d, num_classes, variant=variant) for w in widths for d in depths]


class LeNet(nn.Module):
    """Two [5x5 conv, act, 2x2 max-pool] stages, dense layers of the given sizes, a muP readout."""

    def __init__(
        self,
        input_shape: Sequence[int],
        channels: Sequence[int],
        dense: Sequence[int],
        num_classes: int,
        padding: int | str = "auto",
        activation: str = "relu",
    ) -> None:
        super().__init__()
        in_channels, h, w = check_image_shape(input_shape, "lenet")
        if len(channels) != 2 or min(channels) < 1:
            raise ValueError(f"lenet channels must be two positive integers [c1, c2], got {channels!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"lenet activation must be one of {ACTIVATIONS}, got {activation!r}")
        act = nn.ReLU if activation == "relu" else nn.GELU
        p = resolve_padding(padding, h, w)
        sh, sw = feature_grid(input_shape, p)
        c1, c2 = (int(c) for c in channels)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, KERNEL, padding=p),
            act(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, KERNEL, padding=p),
            act(),
            nn.MaxPool2d(2),
        )
        dims = [c2 * sh * sw] + [int(f) for f in dense]
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), act()]
        self.dense = nn.Sequential(*layers)
        self.head = MuReadout(dims[-1], num_classes, readout_zero_init=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dense(self.features(x).flatten(1)))

    def forward_stacked(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        """M members at once, x (M, B, C, H, W) -> (M, B, K): the members folded into the channel axis, each
        convolution one grouped convolution (models.stacked_ops), the dense layers batched matmuls. vmap's
        form launched 1.68x one model's kernels per step (its moves of the member axis); this 1.26x (67 against 53)."""
        members = x.shape[0]
        h = x.transpose(0, 1).flatten(1, 2).contiguous()  # (B, M*C, H, W): member m owns channels m*C..m*C+C-1
        for i, layer in enumerate(self.features):
            h = (
                stacked_ops.conv2d(layer, params, f"features.{i}", h, members)
                if isinstance(layer, nn.Conv2d)
                else layer(h)
            )
        h = h.unflatten(1, (members, -1)).flatten(2).transpose(0, 1)  # (M, B, c2 x side x side), as forward flattens
        for i, layer in enumerate(self.dense):
            h = stacked_ops.linear(params, f"dense.{i}", h) if isinstance(layer, nn.Linear) else layer(h)
        return stacked_ops.mu_readout(self.head, params, "head", h)


def resolve_lenet(
    width: int,
    depth: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    channels: Sequence[int] | None = None,
    padding: int | str = "auto",
    channel_ratio: float = 6 / 16,
    variant: str = "original",
    dense: Sequence[int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Choose the sizes at the requested width (once, before the muP base models are built)."""
    searched = channels is None or (variant == "original" and dense is None)
    channels, sizes = lenet_sizes(
        input_shape, width, depth, num_classes, variant, channels, dense, padding, channel_ratio
    )
    # counted only where the search chose: given sizes are checked (with their own message) when the model is built
    lenet = param_count(input_shape, channels, sizes, num_classes, padding) if searched else 0
    mlp = mlp_param_count(math.prod(input_shape), width, depth, num_classes)
    if searched and abs(lenet / mlp - 1) > MATCH_TOLERANCE:
        warnings.warn(
            f"lenet (variant original) at width {width}, depth {depth} on {tuple(input_shape)}: the nearest "
            f"configuration on the original's size grid (conv {list(channels)}, dense {list(sizes)}) has {lenet} "
            f"parameters against the MLP's {mlp} ({lenet / mlp - 1:+.1%}), as in the original code; "
            f"model.options.variant=dense_stack matches within 1%"
            if variant == "original"
            else f"lenet at width {width}, depth {depth} on {tuple(input_shape)}: the nearest parameter count is "
            f"{lenet} (channels {channels}) against the MLP's {mlp} ({lenet / mlp - 1:+.1%}); even the smallest "
            f"convolutions cost more than the MLP's input layer here",
            stacklevel=2,
        )
    dense_sizes = {"dense": list(sizes)} if variant == "original" else {}
    return {"variant": variant, "channels": list(channels), **dense_sizes, "padding": padding, **options}


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
    variant: str = "original",
    dense: Sequence[int] | None = None,
    **options: Any,
) -> LeNet:
    """The LeNet of ``variant`` at this width and depth. Its sizes are normally filled in by ``resolve_lenet``
    at the target width (so the muP base models get the same sizes and muP changes no learning rate, as in the
    original); ``channels`` and ``dense`` given in model.options are used as they are."""
    if options:
        raise ValueError(
            f"unknown lenet options {sorted(options)}; it takes variant, channels, dense, padding, "
            f"activation, channel_ratio"
        )
    channels, dense = lenet_sizes(
        input_shape, width, depth, num_classes, variant, channels, dense, padding, channel_ratio
    )
    return LeNet(input_shape, channels, dense, num_classes, padding, activation)


def main() -> None:
    """Print the LeNet vs MLP parameter-count table for the paper's grid."""
    for variant, shape in itertools.product(VARIANTS, ((3, 32, 32), (1, 8, 8))):
        rows = parameter_match_table(shape, variant=variant)
        print(
            f"{variant}, input {shape}: LeNet / MLP - 1 (conv c1,c2{'; dense f1,f2' if variant == 'original' else ''}), "
            f"widths x depths 1..8"
        )
        for w in sorted({r["width"] for r in rows}):
            cells = [
                f"{r['rel_gap']:+.2%} ({r['channels'][0]},{r['channels'][1]}"
                + (f"; {r['dense'][0]},{r['dense'][1]})" if "dense" in r else ")")
                for r in rows
                if r["width"] == w
            ]
            print(f"  width {w:5d}: " + "  ".join(cells))
        worst = max(rows, key=lambda r: abs(r["rel_gap"]))
        print(f"  worst: width {worst['width']} depth {worst['depth']}: {worst['rel_gap']:+.3%}")


if __name__ == "__main__":
    main()
