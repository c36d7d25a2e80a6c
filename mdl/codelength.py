"""Code lengths from per-block losses: pure functions, both MDL definitions of DESIGN.md."""

from __future__ import annotations

import math
from typing import Sequence


def uniform_codelength(n: int, num_classes: int) -> float:
    """Bits to send n labels with a uniform code: n log2 K."""
    return n * math.log2(num_classes)


def online_codelength(boundaries: Sequence[int], num_classes: int, block_bits: Sequence[float]) -> float:
    """Voita & Titov's online code: t_1 log2 K + sum_i bits of block i+1 under the model fit on t_i.

    ``block_bits[i]`` is -sum log2 p(y) over examples t_{i+1}..t_{i+2} (0-based) of the model
    trained on the first ``boundaries[i]`` examples; there are len(boundaries) - 1 of them.
    """
    if len(block_bits) != len(boundaries) - 1:
        raise ValueError(f"need {len(boundaries) - 1} block code lengths, got {len(block_bits)}")
    return uniform_codelength(boundaries[0], num_classes) + float(sum(block_bits))


def paper_mdl(boundaries: Sequence[int], val_bits_per_example: Sequence[float]) -> float:
    """The paper's table number (bits per sample): (1/N') sum_i c_{i+1} * L(c_i).

    L(c_i) is the held-out mean cross-entropy in bits of the model trained on the first c_i
    examples, c_S = N'. A chance-level model scores log2 K * sum_{i>=2} c_i / N' (3.444 log2 10 =
    11.44 for CIFAR-10's schedule).
    """
    if len(val_bits_per_example) != len(boundaries) - 1:
        raise ValueError(f"need {len(boundaries) - 1} validation losses, got {len(val_bits_per_example)}")
    total = boundaries[-1]
    return sum(c_next * loss for c_next, loss in zip(boundaries[1:], val_bits_per_example)) / total
