"""How many members train at once: the fits of the runs trained together (a pack's, or a run's alone).

Each run's members go in the fits it has alone (``mdl.members_per_fit``: all, k, or ``auto``), the j-th fit of every
run trained together (``plan_fits``). With ``auto`` the count is measured, not guessed: on a GPU one optimizer step
of a stack of one member and of two, each on a real training batch, gives the memory of the fixed part and of each
further member (peak allocated bytes: parameters, gradients, optimizer state, activations), measured with the runs'
data already resident, so the count is what the memory left beside the data holds, with a margin; on a CPU
the host's memory is the limit and a stack of these models is small beside it: every member goes in one fit. A
fit that still runs out of memory goes on as two of half as many (``halved``), with a warning. Neither changes
a number: every run's members train as they do alone, whatever fit they are in. How much data a pack holds is
decided before, when its sweep is launched (mdl.run.pack.plan_packs).
"""

from __future__ import annotations

import gc
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from mdl.engine.members import AUTO
from mdl.engine.protocol import LoopRules, fits_of

if TYPE_CHECKING:
    from mdl.engine.fitting import Fitting, Run

log = logging.getLogger(__name__)
Member = tuple[int, int]  # (run, block) in the runs trained together
MEMORY_MARGIN = 0.8  # our choice: use at most this share of the free memory (fragmentation, the allocator's cache)


def plan_fits(runs: Sequence[Run], fitting: Fitting) -> list[list[Member]]:
    """The (run, block) members of every fit, in order: each run's members in the fits it has alone, the j-th fit
    of every run (or, with ``auto``, of as many runs as the memory holds) together, so each member keeps the
    companions it has alone. A loop that backtracks trains one member per fit (a stack shares one optimizer step
    count, which a member cannot take back alone)."""
    size, count = runs[0].size, one_per_fit_if_backtracking(fitting.members_per_fit, fitting.rules)
    runs_per_fit = None
    if count == AUTO:
        run = runs[0]
        device = run.data.device
        trial = measured_step_peak(
            device, lambda m: stacked_trial_step(run.data, run.model, run.seeds(), m, fitting.precision)
        )
        count = members_that_fit(device, size, trial)
        held = members_that_fit(device, size * len(runs), trial) if len(runs) > 1 else None
        runs_per_fit = None if held is None else max(1, held // (count or size))
    fits = pack_fits(len(runs), size, count, runs_per_fit)
    kept = [[(r, m) for r, m in fit if m < size - 1 or runs[r].final_fit] for fit in fits]  # protocol.final_fit
    return [fit for fit in kept if fit]


def one_per_fit_if_backtracking(members_per_fit: int | str | None, rules: LoopRules) -> int | str | None:
    """Members per fit: one when the loop backtracks (a stack shares one optimizer step count, which a member
    cannot take back alone), validates per batch as the original (``batch_mean_validation``: a fit of one member
    validates that way; a stack adds its losses up its own way) or redraws the pool per block (``redraw_per_block``:
    a stack trains its members on one layout), else as asked (``LoopRules.one_member_per_fit``)."""
    if rules.one_member_per_fit and members_per_fit != 1:
        log.info(
            "protocol with backtracking, the original's validation sums or its per-block redraw: one member per fit "
            "(mdl.members_per_fit=%s not used)",
            members_per_fit or "all",
        )
        return 1
    return members_per_fit


def pack_fits(
    num_runs: int, size: int, members_per_fit: int | None, runs_per_fit: int | None = None
) -> list[list[Member]]:
    """The (run, block) members of ``num_runs`` runs of ``size`` members: each run's members in the fits it has alone
    (``fits_of``), the j-th fit of every run (or of ``runs_per_fit`` runs at a time) together."""
    step = runs_per_fit or num_runs
    return [
        [(r, m) for r in range(a, min(a + step, num_runs)) for m in fit]
        for fit in fits_of(size, members_per_fit)
        for a in range(0, num_runs, step)
    ]


def halved(left: list[Member], fit_size: int, auto: bool, err: BaseException) -> list[list[Member]]:
    """What a fit of ``fit_size`` members that ran out of memory has left to train (``left``), in fits of half as many
    (``mdl.members_per_fit=auto``, with a warning): its runs in two halves, each run keeping its fit, or one run's fit
    halved; with a count the user chose, an error saying what to set."""
    if not auto:
        raise RuntimeError(
            f"out of memory training {fit_size} members in one fit ({err}); set a smaller "
            f"mdl.members_per_fit (e.g. {max(fit_size // 2, 1)}), or mdl.members_per_fit=auto to have it chosen "
            f"and halved when needed"
        ) from err
    in_fit = sorted({r for r, _ in left})
    parts: list[Any] = left if len(in_fit) == 1 else in_fit  # one run's members, or the runs
    half = max(1, (len(parts) + 1) // 2)
    log.warning(
        "out of memory with %d members in one fit: going on with fits of %d (mdl.members_per_fit=auto)", fit_size, half
    )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    halves = [parts[i : i + half] for i in range(0, len(parts), half)]
    return halves if len(in_fit) == 1 else [[(r, m) for r, m in left if r in h] for h in halves]


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
    log.info(
        "members_per_fit=auto: %.1f MiB per member, %.1f MiB fixed, %.1f MiB free: %d of %d members per fit",
        per_member / 2**20,
        fixed / 2**20,
        free / 2**20,
        chosen,
        num_members,
    )
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


def stacked_trial_step(dm: Any, recipe: Any, seeds: list[int], members: int, precision: str = "fp32") -> None:
    """One optimizer step of a stack of ``members`` members on a training batch of the run's data (what the
    stacked fit's first step allocates: weights, gradients, optimizer state, activations); ``recipe``: the run's
    ``ModelRecipe`` (mdl.engine.fitting)."""
    from mdl.engine.stacked_fit import build_members
    from models.module import set_optimizer_mode
    from models.stacked_module import StackedClassifier

    module = StackedClassifier(
        build_members(recipe.make_model, seeds[:members], dm.device),
        recipe.optimizer,
        recipe.lr,
        precision,
        loss=recipe.loss,
    )
    module.train_sums = module.train_sums.to(dm.device)
    optimizer = recipe.optimizer(module.stack.param_groups(recipe.lr))
    set_optimizer_mode(optimizer, train=True)
    batch = dm.stacked_train_loader([dm.num_train] * members).next(1)
    module.train_group(batch, optimizer)
    del module, optimizer, batch
