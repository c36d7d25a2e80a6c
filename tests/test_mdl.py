"""Block schedules and code lengths: pure functions with known answers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mdl import block_boundaries, online_codelength, paper_mdl, uniform_codelength


def test_paper_schedule_for_cifar10() -> None:
    bounds = block_boundaries(50000 - 2048, num_blocks=10, first=1024)
    assert bounds[0] == 1024 and bounds[-1] == 47952
    assert len(bounds) == 10 and all(b > a for a, b in zip(bounds, bounds[1:]))
    chunks = [bounds[0]] + [b - a for a, b in zip(bounds, bounds[1:])]
    assert sum(chunks) == 47952
    ratios = [b / a for a, b in zip(chunks[:-1], chunks[1:])]
    assert max(ratios) - min(ratios) < 0.01  # geometric chunks
    # the paper's weights: sum_{i>=2} c_i / N' = 3.444, chance MDL 11.44 bits
    assert sum(bounds[1:]) / bounds[-1] == pytest.approx(3.444, abs=1e-3)
    assert paper_mdl(bounds, [math.log2(10)] * 9) == pytest.approx(11.44, abs=0.01)


def test_original_schedule_for_cifar10_is_oric() -> None:
    """protocol=original: the original code's ORIC-rounded chunks (mdl/math.py@72865a4); sound keeps its rounding."""
    oric = [1024, 2375, 4157, 6507, 9606, 13694, 19086, 26198, 35579, 47952]
    assert block_boundaries(47952, 10, 1024, rounding="oric") == oric
    cumulative = block_boundaries(47952, 10, 1024)
    assert [b - a for a, b in zip(cumulative, oric)] == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]


def test_brent_root_takes_scipys_brentq_steps_to_the_last_bit() -> None:
    """The original solved its chunk ratio with scipy.optimize.brentq (mdl/math.py@72865a4:63-72); our own Brent's
    method must give the same float, or a chunk could round the other way."""
    import random

    from scipy.optimize import brentq

    from mdl.schedule import EPS, brent_root

    rng = random.Random(0)
    for _ in range(2000):
        blocks, first = rng.randint(2, 20), rng.randint(1, 4096)
        n = rng.randint(first * blocks + 1, first * blocks * rng.choice([2, 10, 1000]))

        def series(r: float) -> float:
            return first * (1 - r**blocks) / (1 - r) - n

        upper = blocks * n ** (1 / blocks)
        if series(1 + EPS) * series(upper) < 0:  # (n barely above first * blocks can round to no bracket)
            assert brent_root(series, 1 + EPS, upper) == brentq(series, 1 + EPS, upper), (n, blocks, first)
    assert brent_root(lambda x: x**3 - 2, 0, 4) == brentq(lambda x: x**3 - 2, 0, 4)
    with pytest.raises(ValueError, match="does not bracket a root"):
        brent_root(lambda x: x**2 + 1, 0, 4)


def test_protocol_group_picks_the_rounding() -> None:
    from hydra import compose, initialize_config_dir
    from pathlib import Path

    from mdl.schedule import protocol_rounding

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        assert protocol_rounding(compose("config")) == "cumulative"
        assert protocol_rounding(compose("config", overrides=["protocol=original"])) == "oric"


@pytest.mark.parametrize("n,blocks,first", [(1197, 10, 64), (1000, 3, 100), (64, 2, 32)])
def test_schedule_sums_to_n(n: int, blocks: int, first: int) -> None:
    bounds = block_boundaries(n, blocks, first)
    assert bounds[-1] == n and bounds[0] == first and len(bounds) == blocks


def test_schedule_with_one_block_is_refused() -> None:
    """One block leaves both MDL numbers undefined (no model is ever scored)."""
    with pytest.raises(ValueError, match="at least 2 blocks"):
        block_boundaries(500, 1, 500)


def test_schedule_rejects_impossible_request() -> None:
    with pytest.raises(ValueError, match="first_block"):
        block_boundaries(100, 10, 64)


class Uniform(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], self.k)


def test_uniform_predictor_codes_n_log2_k_exactly() -> None:
    k, n = 10, 1197
    x, y = torch.rand(n, 1, 8, 8), torch.randint(0, k, (n,))
    bounds = block_boundaries(n, 10, 64)
    bits = [
        float(torch.nn.functional.cross_entropy(Uniform(k)(x[a:b]).double(), y[a:b], reduction="sum")) / math.log(2)
        for a, b in zip(bounds, bounds[1:])
    ]
    assert online_codelength(bounds, k, bits) == pytest.approx(n * math.log2(k), rel=1e-12)
    assert uniform_codelength(n, k) == n * math.log2(k)


def test_codelength_checks_lengths() -> None:
    with pytest.raises(ValueError):
        online_codelength([10, 20, 30], 10, [1.0])
    with pytest.raises(ValueError):
        paper_mdl([10, 20, 30], [1.0, 2.0, 3.0])
