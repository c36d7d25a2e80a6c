"""Several runs trained as members of one fit: a pack (``hydra/launcher=packed``, mdl/run/pack.py).

Runs of equal models (differing in seed, eraser or data seed) can share one stack: R x S members, one
fit (or, with ``mdl.members_per_fit`` k, each run's members in the fits of k it has alone, the j-th fit of every run
trained together), one step per batch for all of them; a run with its own data (``PackedRun.data``) has its members'
batches, validation and scoring drawn from it. Each member is exactly what it is in a fit of its own
run (its initial weights, batch order, prefix, protocol state and scoring; mdl/engine/stacked_runs.py),
so each run's numbers are those of the run alone: each run's members compute as a stack of their own (one
forward per run; the MLP's, whose bits do not depend on the stack's size, as one; models/stacking.py) with the
companions they have alone (BLAS picks its batched kernel by the stack's size, and a fit of one member trains the
plain model), and tests/test_pack.py finds packs of any members_per_fit equal to the runs alone to the bit. Each run
records its finished blocks in its own progress.json; the pack's checkpoints live in the pack's folder, named by its
runs, so a killed pack resumes every run in it.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from datamodules.datamodule import ErasedDataModule
from erasure.files import sha256_hex
from mdl.engine.checkpoints import run_identity
from mdl.engine.driver import (FitSettings, ModelRecipe, block_recorder, check_trainer_settings, prequential_results,
                               record_restored, run_single_fit)
from mdl.engine.memory import (halved_after_out_of_memory, measured_step_peak, members_that_fit, out_of_memory_errors,
                               stacked_trial_step)
from mdl.engine.progress import finished_blocks, write_progress
from mdl.engine.progress_display import EpochHook
from mdl.engine.protocol import fits_of, member_seeds
from mdl.engine.members import AUTO
from mdl.engine.stacked_runs import RunMembers, fit_stack
from mdl.results import PROGRESS_FILE, BlockResult

log = logging.getLogger(__name__)
PACK_CHECKPOINT = "pack.ckpt"


@dataclass
class PackedRun:
    """One run of a pack: its seed, its store folder (progress.json), its loggers' hooks, its data and its name."""

    seed: int
    store: Path
    on_block: Callable[..., None] | None = None
    on_epoch: EpochHook | None = None
    final_curves: Any = None
    data: ErasedDataModule | None = None  # its own data module; None: the pack's (train_pack's ``dm``)
    label: str = ""  # its name in the progress display and its log lines (default: its seed)
    hooks: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda hook: hook  # wraps the hooks called for this
    # run alone (its finished blocks, its loggers'): e.g. their log lines then go to the run's own log file


def train_pack(dm: ErasedDataModule, boundaries: Sequence[int], recipe: ModelRecipe, settings: FitSettings,
               runs: list[PackedRun], pack_dir: Path, paper_loss: str,
               members_per_fit: int | str | None = None) -> list[dict[str, Any]]:
    """Every member of every run, in stacked fits of ``members_per_fit`` (None: all in one fit; ``auto``: as many as
    the device's memory holds, measured, halved after running out); each run's results.json fields, in order."""
    if boundaries[-1] != dm.num_train:
        raise ValueError(f"block schedule ends at {boundaries[-1]} but there are {dm.num_train} training examples")
    size = len(boundaries)
    final = size - 1
    auto = members_per_fit == AUTO
    runs_per_fit = None
    if auto:  # each run's fits as the run alone chooses them; as many runs' fits at once as the memory holds
        trial = measured_step_peak(dm.device, lambda m: stacked_trial_step(dm, recipe, member_seeds(runs[0].seed, size), m))
        members_per_fit = members_that_fit(dm.device, size, trial)
        held = members_that_fit(dm.device, size * len(runs), trial)
        runs_per_fit = None if held is None else max(1, held // (members_per_fit or size))
    fits = pack_fits(len(runs), size, members_per_fit, runs_per_fit)
    check_trainer_settings(settings.trainer_kwargs, fits, settings.steps_per_group)
    recorded: list[dict[int, Any]] = []
    for run in runs:
        progress = run.store / PROGRESS_FILE
        recorded.append(run.hooks(finished_blocks)(progress, boundaries))  # its lines ("resuming: ...") are the run's
        if not progress.exists():
            write_progress(progress, boundaries, {})
    done: list[dict[int, Any]] = [{} for _ in runs]
    pending = deque(fits)
    while pending:
        members = pending.popleft()  # (run, block) pairs
        if all(m != final and m in recorded[r] for r, m in members):  # finished before an interruption
            for r, m in members:
                if runs[r].on_block is not None:  # a resumed run's logger is new: the series again
                    runs[r].hooks(runs[r].on_block)(m, BlockResult(**recorded[r][m]), True)
            continue
        if len(members) == len({r for r, _ in members}):  # one member of each run: alone, a plain model's fit
            outcomes = _fit_singles(dm, boundaries, recipe, settings, runs, recorded, members)
        else:
            try:
                outcomes = _fit_members(dm, boundaries, recipe, settings, runs, recorded, members, pack_dir)
            except out_of_memory_errors() as err:
                left = [(r, m) for r, m in members if m == final or m not in recorded[r]]
                pending.extendleft(reversed(_halved(left, len(members), auto, err)))
                _checkpoint(pack_dir, members, size * len(runs)).unlink(missing_ok=True)  # its state is of the larger stack
                continue
        for r, outcome in outcomes.items():
            done[r] |= outcome
            record_restored(runs[r].store / PROGRESS_FILE, boundaries, recorded[r], outcome, list(outcome))
    return [prequential_results(boundaries, dm.num_classes, [BlockResult(**blocks[m]) for m in range(final)],
                                outcome[final], paper_loss) for blocks, outcome in zip(recorded, done)]


def pack_fits(num_runs: int, size: int, members_per_fit: int | None,
              runs_per_fit: int | None = None) -> list[list[tuple[int, int]]]:
    """The pack's (run, block) members: each run's members in the fits it has alone (``fits_of``), the j-th fit of
    every run (or of ``runs_per_fit`` runs at a time) together, so each member keeps its companions of the run alone."""
    step = runs_per_fit or num_runs
    return [[(r, m) for r in range(a, min(a + step, num_runs)) for m in fit]
            for fit in fits_of(size, members_per_fit) for a in range(0, num_runs, step)]


def _halved(left: list[tuple[int, int]], fit_size: int, auto: bool, err: BaseException) -> list[list[tuple[int, int]]]:
    """A fit that ran out of memory: its runs in two halves, each run keeping its fit; one run's fit is halved as the
    run alone halves it (``mdl.members_per_fit=auto``; a count the user chose is an error saying what to set)."""
    in_fit = sorted({r for r, _ in left})
    if len(in_fit) == 1:
        return halved_after_out_of_memory(left, fit_size, auto, err)
    return [[(r, m) for r, m in left if r in half] for half in halved_after_out_of_memory(in_fit, fit_size, auto, err)]


def _fit_singles(dm: ErasedDataModule, boundaries: Sequence[int], recipe: ModelRecipe, settings: FitSettings,
                 runs: list[PackedRun], recorded: list[dict[int, Any]], members: list[tuple[int, int]]) -> dict[int, dict[int, Any]]:
    """Fits of one member of each run, each the plain model's fit that the run alone trains (its checkpoint in the
    run's store, as alone); a block finished before an interruption is not trained again."""
    size = len(boundaries)
    outcomes: dict[int, dict[int, Any]] = {}
    for r, m in members:
        run = runs[r]
        if m != size - 1 and m in recorded[r]:
            continue
        own = replace(settings, final_curves=run.final_curves, on_epoch=run.on_epoch, identity=run_identity(run.store))
        record = block_recorder(run.store / PROGRESS_FILE, boundaries, recorded[r], run.on_block)
        data = run.data if run.data is not None else dm
        with _batch_order_of(data, run.seed):
            outcomes[r] = run_single_fit(data, boundaries, m, member_seeds(run.seed, size)[m], recipe, own, run.store, record)
    return outcomes


@contextmanager
def _batch_order_of(dm: ErasedDataModule, seed: int) -> Iterator[None]:
    """A data module shared by runs that differ in their seed, serving one run's plain fit: that run's batch order
    (a single fit draws it from the module's seed; a stacked fit is given each run's)."""
    before, dm.seed = dm.seed, seed
    try:
        yield
    finally:
        dm.seed = before


def _checkpoint(pack_dir: Path, members: list[tuple[int, int]], total: int) -> Path:
    """One fit's checkpoint: ``pack.ckpt`` for a fit of the whole pack, else named by its members (another split
    of the pack, e.g. after running out of memory, is another name)."""
    name = PACK_CHECKPOINT if len(members) == total else f"pack-{sha256_hex(repr(sorted(members)).encode())[:12]}.ckpt"
    return pack_dir / "checkpoints" / name


def _fit_members(dm: ErasedDataModule, boundaries: Sequence[int], recipe: ModelRecipe, settings: FitSettings,
                 runs: list[PackedRun], recorded: list[dict[int, Any]], members: list[tuple[int, int]],
                 pack_dir: Path) -> dict[int, dict[int, Any]]:
    """One stacked fit of these (run, block) members; each run's outcomes by block."""
    size = len(boundaries)
    in_fit = sorted({r for r, _ in members})
    parts = []
    for r in in_fit:
        run = runs[r]
        label = run.label or f"seed {run.seed}"
        record = block_recorder(run.store / PROGRESS_FILE, boundaries, recorded[r], run.on_block, label)
        on_block = run.hooks(run.on_block) if run.on_block is not None else None
        parts.append(RunMembers(run.seed, member_seeds(run.seed, size), sorted(m for q, m in members if q == r),
                                run.hooks(record), on_block, run.on_epoch, run.final_curves, label=label, data=run.data))
    checkpoint = _checkpoint(pack_dir, members, size * len(runs))
    has_final = any(m == size - 1 for _, m in members)  # its checkpoint stays until the results are written
    outcomes = fit_stack(dm, boundaries, parts, recipe, settings, checkpoint, keep_checkpoint=has_final)
    return dict(zip(in_fit, outcomes))
