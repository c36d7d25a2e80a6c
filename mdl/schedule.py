"""Block schedules for prequential coding: geometric chunks that sum exactly to N."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Literal

Rounding = Literal["cumulative", "oric"]
ROUNDINGS: tuple[str, ...] = ("cumulative", "oric")


def _growth_ratio(n: int, num_blocks: int, first: int) -> float:
    """The r >= 1 with first * (1 + r + ... + r^(S-1)) = n, by bisection."""

    def total(r: float) -> float:
        return first * num_blocks if r == 1.0 else first * (r**num_blocks - 1) / (r - 1)

    lo, hi = 1.0, 2.0
    while total(hi) < n:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < n else (lo, mid)
    return (lo + hi) / 2


def oric_chunks(n: int, num_blocks: int, first: int) -> list[int]:
    """The original code's chunk sizes: the geometric series first * r^k solved by Brent's method on the
    same bracket (original: mdl/math.py@72865a4:63-72), each chunk rounded down and the shortfall given
    to the chunks with the largest fractional parts, ties in order (ORIC, original: mdl/math.py@72865a4:4-33,
    called by partition_logspace, mdl/math.py@72865a4:36-60). The chunks, not their sums, are rounded,
    so the cumulative sizes can differ by one from ``cumulative`` rounding."""
    from scipy.optimize import brentq  # as the original: the same root to the last bit

    ratio = brentq(
        lambda r: first * (1 - r**num_blocks) / (1 - r) - n,
        1 + 2.220446049250313e-16,
        num_blocks * n ** (1 / num_blocks),
    )
    exact = [first * ratio**k for k in range(num_blocks)]
    rounded = [int(v) for v in exact]
    shortfall = [v - int(v) for v in exact]
    order = sorted(range(num_blocks), key=lambda k: shortfall[k], reverse=True)
    for k in order[: round(sum(shortfall))]:
        rounded[k] += 1
    return rounded


def block_boundaries(n: int, num_blocks: int = 10, first: int = 1024, rounding: Rounding = "cumulative") -> list[int]:
    """Cumulative prefix sizes t_1 < ... < t_S = n whose chunks grow geometrically from ``first``.

    Chunk sizes first * r^k (k = 0..S-1) sum to n. ``cumulative`` (protocol=sound) rounds the
    cumulative sums, so t_1 = first and t_S = n exactly; ``oric`` (protocol=original) rounds the
    chunks as the original code did (``oric_chunks``). For n = 47952 (CIFAR-10's 50000 minus a 2048
    validation split) ``oric`` gives 1024, 2375, 4157, 6507, 9606, 13694, 19086, 26198, 35579, 47952;
    ``cumulative`` is one lower at 4156, 6506, 9605, 13693, 19085.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"block rounding {rounding!r}: use one of {', '.join(ROUNDINGS)}")
    if num_blocks < 2:
        raise ValueError(
            f"mdl.num_blocks={num_blocks}: prequential MDL needs at least 2 blocks (the first is sent with a "
            f"uniform code and each later one is scored by a model trained on the blocks before it, so with one "
            f"block neither the online code length nor the paper MDL is defined); use mdl.num_blocks=2 or more"
        )
    if first < 1 or first * num_blocks > n:
        raise ValueError(
            f"cannot cut {n} examples into {num_blocks} growing blocks starting at {first}: "
            f"need first * num_blocks <= n; lower mdl.first_block or mdl.num_blocks"
        )
    if rounding == "oric":
        bounds = list(accumulate(oric_chunks(n, num_blocks, first)))
        _check_increasing(bounds)
        return bounds
    r = _growth_ratio(n, num_blocks, first)
    bounds, acc = [], 0.0
    for k in range(num_blocks):
        acc += first * r**k
        bounds.append(int(round(acc)))
    bounds[-1] = n
    _check_increasing(bounds)
    return bounds


def _check_increasing(bounds: list[int]) -> None:
    if bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"block schedule {bounds} is not strictly increasing; use fewer blocks")


def protocol_rounding(cfg: Any) -> Rounding:
    """The block rounding a run's ``protocol`` group names (a config without one: ``cumulative``)."""
    protocol = cfg.get("protocol") if hasattr(cfg, "get") else None
    return (protocol or {}).get("block_rounding", "cumulative")
