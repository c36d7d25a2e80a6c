"""Block schedules for prequential coding: geometric chunks that sum exactly to N."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable, Literal

Rounding = Literal["cumulative", "oric"]
ROUNDINGS: tuple[str, ...] = ("cumulative", "oric")
EPS = 2.220446049250313e-16  # float64 machine epsilon


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


def brent_root(f: Callable[[float], float], a: float, b: float, xtol: float = 2e-12, rtol: float = 4 * EPS) -> float:
    """A root of f in [a, b] by Brent's method with scipy.optimize.brentq's defaults, steps and order of float
    operations, so that the original's ratio comes out to the last bit (tests/test_mdl.py checks it against scipy)
    without importing scipy.optimize, about 0.6 CPU-s of every run's start-up.

    The root stays bracketed by the best guess ``x`` and the far end ``x_blk``; a step interpolates (secant through
    two points, inverse quadratic through three) where that moves less than bisecting would, and bisects otherwise."""
    x_prev, x, f_prev, fx = a, b, f(a), f(b)
    if f_prev * fx > 0:
        raise ValueError(f"f({a}) and f({b}) have the same sign: [{a}, {b}] does not bracket a root")
    if f_prev == 0 or fx == 0:
        return a if f_prev == 0 else b
    x_blk = f_blk = s_prev = s_cur = 0.0
    for _ in range(100):
        if f_prev * fx < 0:  # the root lies between x_prev and x: x_prev is the new far end
            x_blk, f_blk = x_prev, f_prev
            s_prev = s_cur = x - x_prev
        if abs(f_blk) < abs(fx):  # the far end is the better guess: swap
            x_prev, x, x_blk = x, x_blk, x
            f_prev, fx, f_blk = fx, f_blk, fx
        delta = (xtol + rtol * abs(x)) / 2
        s_bis = (x_blk - x) / 2
        if fx == 0 or abs(s_bis) < delta:
            return x
        if abs(s_prev) > delta and abs(fx) < abs(f_prev):
            if x_prev == x_blk:
                s_try = -fx * (x - x_prev) / (fx - f_prev)
            else:
                d_prev = (f_prev - fx) / (x_prev - x)
                d_blk = (f_blk - fx) / (x_blk - x)
                s_try = -fx * (f_blk * d_blk - f_prev * d_prev) / (d_blk * d_prev * (f_blk - f_prev))
            short = 2 * abs(s_try) < min(abs(s_prev), 3 * abs(s_bis) - delta)
            s_prev, s_cur = (s_cur, s_try) if short else (s_bis, s_bis)
        else:
            s_prev = s_cur = s_bis
        x_prev, f_prev = x, fx
        x += s_cur if abs(s_cur) > delta else (delta if s_bis > 0 else -delta)
        fx = f(x)
    raise RuntimeError(f"Brent's method did not converge in 100 steps on [{a}, {b}]")


def oric_chunks(n: int, num_blocks: int, first: int) -> list[int]:
    """The original code's chunk sizes: the geometric series first * r^k solved by Brent's method on the
    same bracket (original: mdl/math.py@72865a4:63-72), each chunk rounded down and the shortfall given
    to the chunks with the largest fractional parts, ties in order (ORIC, original: mdl/math.py@72865a4:4-33,
    called by partition_logspace, mdl/math.py@72865a4:36-60). The chunks, not their sums, are rounded,
    so the cumulative sizes can differ by one from ``cumulative`` rounding."""
    ratio = brent_root(lambda r: first * (1 - r**num_blocks) / (1 - r) - n, 1 + EPS, num_blocks * n ** (1 / num_blocks))
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
    else:
        r = _growth_ratio(n, num_blocks, first)
        bounds = [int(round(acc)) for acc in accumulate(first * r**k for k in range(num_blocks))]
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
