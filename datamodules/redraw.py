"""The original code's per-block redraw of its pool (``protocol.redraw_per_block``, docs/differences-from-original.md
D10): every block's fit draws a fresh permutation of the pool, and its prefix, validation and scored chunk are cut
from that permutation.

The original (EleutherAI/mdl mdl/sweep.py@3034bc0) seeds one generator with the run's seed (:88) and, at the top of
every block (:109-112), permutes its pool ``x = x[randperm(len(x))]``: the permutations compose, block i's order is
block i-1's order permuted again. It splits the permuted pool into its first ``nonval_size`` rows and the last
``val_size`` (:114-115) and the first part again into ``train_x`` and a scored chunk of the last block's size
(:117-119); the block trains on ``train_x[:n]``, validates on ``val_x`` (:129-133) and is scored on the chunk
(:143-145). In this project's terms the pool is the training split followed by the validation split (the rows the
eraser is fitted on, ``fit_scope=pool``), ``nonval_size`` the training split's size N and the scored chunk the last
block [t_{S-1}, N): block i's training split is its permuted pool's first N rows (prefix [0, t_i), next block
[t_i, t_{i+1}), last block [t_{S-1}, N)) and its validation split the remaining rows. The generator is the CPU's,
seeded by ``data_seed``: the same orders on every device (the original drew on its data's device, a GPU's randperm).
"""

from __future__ import annotations

import torch
from torch import Tensor


def redrawn_orders(pool_size: int, blocks: int, data_seed: int) -> list[Tensor]:
    """Each block's order of the pool, as positions into it: block i's is block i-1's permuted by the generator's
    (i+1)-th ``randperm`` (mdl/sweep.py@3034bc0:88, 111-112: ``x = x[indices]`` every block, one generator)."""
    generator = torch.Generator().manual_seed(data_seed)
    order, orders = torch.arange(pool_size), []
    for _ in range(blocks):
        order = order[torch.randperm(pool_size, generator=generator)]
        orders.append(order)
    return orders


def pool_rows(train: Tensor, val: Tensor, positions: Tensor) -> Tensor:
    """Rows of the pool (``train`` followed by ``val``) at ``positions``, without a copy of the whole pool."""
    positions = positions.to(train.device)
    out = train.new_empty((len(positions), *train.shape[1:]))
    in_train = positions < len(train)
    out[in_train] = train[positions[in_train]]
    out[~in_train] = val[positions[~in_train] - len(train)]
    return out


__all__ = ["pool_rows", "redrawn_orders"]
