"""Code lengths from per-block losses: pure functions, both MDL definitions (docs/mdl.md)."""

from __future__ import annotations

import math
from typing import Sequence

# How the paper MDL's L(c_i) is measured (mdl.paper_loss). Both use the weights with the lowest
# validation loss (early stopping); they differ in where those weights are then scored.
PAPER_LOSSES = {
    # The original code's estimate (quad-mlp mdl/sweep.py:108-113, 133-140): scored on a chunk the size
    # of the last partition that no model trains on or selects with -- here the last prequential block
    # [t_{S-1}, N), which none of the S-1 prefix models sees -- with the untrained model a candidate.
    "last_block": "best-validation weights scored on the last block (held out from training and selection)",
    # Ours, kept to compare with last_block: the minimum validation loss itself, on the split that chose the
    # epoch (biased low: selected and scored on the same examples).
    "val_min": "minimum validation loss over epochs (selected and scored on the validation split)",
}


def check_paper_loss(name: str) -> str:
    if name not in PAPER_LOSSES:
        raise ValueError(
            f"mdl.paper_loss={name!r}: choose one of {list(PAPER_LOSSES)} "
            f"({'; '.join(f'{k}: {v}' for k, v in PAPER_LOSSES.items())})"
        )
    return name


def heldout_block(boundaries: Sequence[int]) -> tuple[int, int]:
    """[start, stop) of the chunk ``paper_loss=last_block`` scores every prefix model on: the last
    block, which no prefix model trains on (the largest prefix is t_{S-1})."""
    return boundaries[-2], boundaries[-1]


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
    examples (``PAPER_LOSSES`` says where it is measured), c_S = N'. A chance-level model scores log2 K * sum_{i>=2} c_i / N' (3.444 log2 10 =
    11.44 for CIFAR-10's schedule).
    """
    if len(val_bits_per_example) != len(boundaries) - 1:
        raise ValueError(f"need {len(boundaries) - 1} validation losses, got {len(val_bits_per_example)}")
    total = boundaries[-1]
    return sum(c_next * loss for c_next, loss in zip(boundaries[1:], val_bits_per_example)) / total
