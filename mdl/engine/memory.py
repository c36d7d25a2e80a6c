"""``mdl.members_per_fit=auto``: how many members one stacked fit can hold in the device's memory.

On a GPU it is measured, not guessed: one optimizer step of a stack of one member and of two, each on
a real training batch, gives the memory of the fixed part and of each further member (peak allocated
bytes, parameters, gradients, optimizer state and activations included); the count is what the free
memory holds with a margin. On a CPU the host's memory is the limit and a stack of these models is
small beside it: every member goes in one fit. A fit that still runs out of memory is split in halves
by the driver (mdl/engine/driver.py), with a warning.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)
MEMORY_MARGIN = 0.8  # our choice: use at most this share of the free memory (fragmentation, the allocator's cache)


def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """The error a full device raises (torch.OutOfMemoryError; older torch: torch.cuda.OutOfMemoryError)."""
    errors = {getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)}
    return tuple(e for e in errors if e is not None)


def halved_after_out_of_memory(left: list[Any], fit_size: int, auto: bool, err: BaseException) -> list[list[Any]]:
    """What a fit of ``fit_size`` members that ran out of memory has left to train, in fits of half as many
    (``mdl.members_per_fit=auto``, with a warning); with a count the user chose, an error saying what to set."""
    if not auto:
        raise RuntimeError(
            f"out of memory training {fit_size} members in one fit ({err}); set a smaller "
            f"mdl.members_per_fit (e.g. {max(fit_size // 2, 1)}), or mdl.members_per_fit=auto to have it chosen "
            f"and halved when needed"
        ) from err
    half = max(1, (len(left) + 1) // 2)
    log.warning("out of memory with %d members in one fit: going on with fits of %d (mdl.members_per_fit=auto)",
                fit_size, half)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [left[i:i + half] for i in range(0, len(left), half)]


def members_that_fit(device: torch.device, num_members: int, step_peak: Callable[[int], int]) -> int | None:
    """The members (at most ``num_members``) one fit holds on ``device``; None: all (a CPU).
    ``step_peak(m)``: the peak bytes one training step of a stack of m members allocates (measured)."""
    if device.type != "cuda":
        return None
    one, two = step_peak(1), step_peak(2)
    per_member = max(two - one, 1)
    fixed = max(one - per_member, 0)
    free, _ = torch.cuda.mem_get_info(device)
    fit = int(math.floor((free * MEMORY_MARGIN - fixed) / per_member))
    chosen = max(1, min(fit, num_members))
    log.info("members_per_fit=auto: %.1f MiB per member, %.1f MiB fixed, %.1f MiB free: %d of %d members per fit",
             per_member / 2**20, fixed / 2**20, free / 2**20, chosen, num_members)
    return None if chosen >= num_members else chosen


def measured_step_peak(device: torch.device, one_step: Callable[[int], Any]) -> Callable[[int], int]:
    """``step_peak`` for ``members_that_fit``: runs ``one_step(m)`` (build a stack of m members and take one
    optimizer step) and returns the peak bytes allocated during it, releasing everything afterwards."""
    def peak(members: int) -> int:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        one_step(members)
        gc.collect()
        return torch.cuda.max_memory_allocated(device) - start
    return peak


def stacked_trial_step(dm: Any, recipe: Any, seeds: list[int], members: int) -> None:
    """One optimizer step of a stack of ``members`` members on a training batch of the run's data (what the
    stacked fit's first step allocates: weights, gradients, optimizer state, activations)."""
    from mdl.engine.stacked_fit import build_members
    from models.module import set_optimizer_mode
    from models.stacked_module import StackedClassifier

    module = StackedClassifier(build_members(recipe.make_model, seeds[:members], dm.device), recipe.optimizer,
                               recipe.lr, recipe.precision, loss=recipe.loss)
    module.train_sums = module.train_sums.to(dm.device)
    optimizer = recipe.optimizer(module.stack.param_groups(recipe.lr))
    set_optimizer_mode(optimizer, train=True)
    batch = dm.stacked_train_loader([dm.num_train] * members, 1).next(1)
    module.train_group(batch, optimizer)
    del module, optimizer, batch


def memory_bytes(device: torch.device) -> int:
    """The memory a run on ``device`` has: the GPU's total; on a CPU the host's total, or less where Slurm (its
    allocation: SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE, in MiB) or the cgroup limit the
    process. Totals, not what is free now, so a relaunch on the same kind of machine splits a pack the same way."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    env = {k: os.environ.get(k, "") for k in ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_CPUS_ON_NODE")}
    if env["SLURM_MEM_PER_NODE"].isdigit():
        limits.append(int(env["SLURM_MEM_PER_NODE"]) * 2**20)
    elif env["SLURM_MEM_PER_CPU"].isdigit() and env["SLURM_CPUS_ON_NODE"].isdigit():
        limits.append(int(env["SLURM_MEM_PER_CPU"]) * int(env["SLURM_CPUS_ON_NODE"]) * 2**20)
    for cgroup in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):  # v2, v1
        value = cgroup.read_text().strip() if cgroup.exists() else ""
        if value.isdigit():
            limits.append(int(value))
    return min(limit for limit in limits if limit > 0)


def check_pack_data_fraction(fraction: Any) -> float:
    """``mdl.pack_data_fraction``, a share of the memory in (0, 1]; checked for every run before its data load
    (mdl/run/config_checks.py), so what a packed sweep would refuse after hours is refused at once everywhere."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:  # nan too
        raise ValueError(f"mdl.pack_data_fraction={fraction!r}: give a share of the memory in (0, 1] "
                         f"(the most a pack of hydra/launcher=packed fills with data at once), e.g. mdl.pack_data_fraction=0.5")
    return float(fraction)


def data_modules_at_once(per_module: int, device: torch.device, fraction: float) -> int:
    """How many data modules of ``per_module`` bytes a pack holds at once within ``fraction`` of the memory."""
    fraction = check_pack_data_fraction(fraction)
    return max(1, int(memory_bytes(device) * fraction) // max(per_module, 1))
