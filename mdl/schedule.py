"""Block schedules for prequential coding: geometric chunks that sum exactly to N."""

from __future__ import annotations


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


def block_boundaries(n: int, num_blocks: int = 10, first: int = 1024) -> list[int]:
    """Cumulative prefix sizes t_1 < ... < t_S = n whose chunks grow geometrically from ``first``.

    This is the original experiments' schedule: chunk sizes first * r^k (k = 0..S-1) summing to
    n; the cumulative sums are rounded, so t_1 = first and t_S = n exactly. For n = 47952
    (CIFAR-10's 50000 minus a 2048 validation split) it gives 1024, 2375, ..., 47952.
    """
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
    r = _growth_ratio(n, num_blocks, first)
    bounds, acc = [], 0.0
    for k in range(num_blocks):
        acc += first * r**k
        bounds.append(int(round(acc)))
    bounds[-1] = n
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"block schedule {bounds} is not strictly increasing; use fewer blocks")
    return bounds
