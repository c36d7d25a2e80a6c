"""Several runs trained as members of one fit: a pack (``hydra/launcher=packed``, mdl/run/pack.py).

Runs of equal models (differing in seed, eraser or data seed) can share one stack: R x S members, one
fit, one step per batch for all of them; a run with its own data (``PackedRun.data``) has its members'
batches, validation and scoring drawn from it. Each member is exactly what it is in a
fit of all members of its own run (its initial weights, batch order, prefix, protocol state and
scoring; mdl/engine/stacked_runs.py), so each run's numbers are those of the run alone whenever a
member's arithmetic does not depend on its neighbours in the stack (the MLP's batched matmuls:
tests/test_pack.py checks it to the bit). Each run records its finished blocks in its own
progress.json; the pack's checkpoint lives in the pack's folder, named by its runs, so a killed pack
resumes every run in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from datamodules.datamodule import ErasedDataModule
from mdl.engine.driver import (FitSettings, ModelRecipe, block_recorder, check_trainer_settings, prequential_results,
                               record_restored)
from mdl.engine.progress import finished_blocks, write_progress
from mdl.engine.progress_display import EpochHook
from mdl.engine.protocol import member_seeds
from mdl.engine.stacked_runs import RunMembers, fit_stack
from mdl.results import PROGRESS_FILE, BlockResult

log = logging.getLogger(__name__)
PACK_CHECKPOINT = "pack.ckpt"


@dataclass
class PackedRun:
    """One run of a pack: its seed, its store folder (progress.json), its loggers' hooks and its data."""

    seed: int
    store: Path
    on_block: Callable[..., None] | None = None
    on_epoch: EpochHook | None = None
    final_curves: Any = None
    data: ErasedDataModule | None = None  # its own data module; None: the pack's (train_pack's ``dm``)
    label: str = ""  # its name in the progress display (default: its seed)


def train_pack(dm: ErasedDataModule, boundaries: Sequence[int], recipe: ModelRecipe, settings: FitSettings,
               runs: list[PackedRun], pack_dir: Path, paper_loss: str) -> list[dict[str, Any]]:
    """Every member of every run in one stacked fit; each run's results.json fields, in the order of ``runs``."""
    if boundaries[-1] != dm.num_train:
        raise ValueError(f"block schedule ends at {boundaries[-1]} but there are {dm.num_train} training examples")
    size = len(boundaries)
    final = size - 1
    check_trainer_settings(settings.trainer_kwargs, [list(range(size * len(runs)))], settings.steps_per_group)
    recorded: list[dict[int, Any]] = []
    parts = []
    for run in runs:
        progress = run.store / PROGRESS_FILE
        blocks = finished_blocks(progress, boundaries)
        if not progress.exists():
            write_progress(progress, boundaries, {})
        recorded.append(blocks)
        parts.append(RunMembers(run.seed, member_seeds(run.seed, size), list(range(size)),
                                block_recorder(run.store / PROGRESS_FILE, boundaries, blocks, run.on_block), run.on_block, run.on_epoch, run.final_curves,
                                label=run.label or f"seed {run.seed}", data=run.data))
    outcomes = fit_stack(dm, boundaries, parts, recipe, settings, pack_dir / "checkpoints" / PACK_CHECKPOINT,
                         keep_checkpoint=True)
    results = []
    for run, blocks, done in zip(runs, recorded, outcomes):
        record_restored(run.store / PROGRESS_FILE, boundaries, blocks, done, range(size))
        results.append(prequential_results(boundaries, dm.num_classes, [BlockResult(**blocks[m]) for m in range(final)],
                                           done[final], paper_loss))
    return results
