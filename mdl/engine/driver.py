"""The prequential driver: S members, trained in fits of ``members_per_fit``, one protocol.

For boundaries t_1 < ... < t_S = N, member i < S - 1 is a fresh model fit on train[:t_i] (early
stopping on the validation split, best weights kept) and scored on train[t_i:t_{i+1}]; the last
member is the final fit on all N examples. Members are trained in order, ``members_per_fit`` at a
time: a fit of one member trains the plain model (mdl/engine/single_fit.py), a fit of several
trains their stacked form (mdl/engine/stacked_fit.py); either way each member follows the same
protocol (mdl/engine/protocol.py) from the same seed. ``members_per_fit`` None (``all``) is the
former stacked engine, 1 the former sequential one, with the same numbers to the bit.

Finished blocks are recorded in ``progress.json`` as they finish; a re-launched job skips the fits
whose blocks are all recorded and resumes a fit in progress from its checkpoint.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning as L
import torch
from torch import nn

from datamodules.datamodule import ErasedDataModule
from mdl.engine.checkpoints import run_identity
from mdl.codelength import check_paper_loss, online_codelength, paper_mdl, uniform_codelength
from mdl.engine.memory import (halved_after_out_of_memory, measured_step_peak, members_that_fit, out_of_memory_errors,
                               stacked_trial_step)
from mdl.engine.progress import finished_blocks, write_progress
from mdl.engine.protocol import LoopRules, MemberOutcome, fits_of, member_seeds
from mdl.engine.single_fit import fit_one_member, fit_prefix
from mdl.engine.stacked_runs import RunMembers, fit_stack
from mdl.engine.progress_display import EpochHook, FitProgress
from mdl.results import PROGRESS_FILE, BlockResult
from mdl.engine.members import AUTO
from mdl.engine.trainer_settings import refuse_for_sequential, refuse_for_stacked, settings_needing_single_steps
from models.losses import SpectralDecoupling
from models.module import Classifier, OptimizerFactory

log = logging.getLogger(__name__)
BlockHook = Callable[..., None]  # (block index, result[, restored]): a finished block, for the loggers


@dataclass
class ModelRecipe:
    """How to build a member: as a LightningModule of its own (a fit of one member; compile and
    channels_last applied there) or as a bare model to stack, with the optimizer, lr, precision
    and training loss the stacked module then needs."""

    make_module: Callable[[], Classifier]
    make_model: Callable[[], nn.Module]
    optimizer: OptimizerFactory
    lr: float
    precision: str = "fp32"
    loss: SpectralDecoupling | None = None
    compile_backend: str | None = None  # trainer.compile for a stacked fit (a single fit's module compiles itself)


@dataclass
class FitSettings:
    """What every fit of a run shares."""

    trainer_kwargs: dict[str, Any]
    patience: int
    checkpoint_every_s: float = 0.0
    steps_per_group: int = 1
    untrained_candidate: bool = True
    callbacks: Sequence[L.Callback] = ()  # join every fit (e.g. models/preconditioning.py)
    final_curves: Any = None  # a callback of the final member only (mdl/engine/final_fit_curves.py)
    on_epoch: EpochHook | None = None
    identity: str = ""
    rules: LoopRules = LoopRules()  # the protocol's loop (conf/protocol/)


def run_prequential(
    dm: ErasedDataModule,
    boundaries: Sequence[int],
    recipe: ModelRecipe,
    trainer_kwargs: dict[str, Any],
    patience: int,
    seed: int,
    run_dir: str | Path,
    members_per_fit: int | str | None = None,
    on_block: BlockHook | None = None,
    checkpoint_every_s: float = 0.0,
    final_curves: Any = None,
    callbacks: Sequence[L.Callback] = (),
    steps_per_group: int = 1,
    paper_loss: str = "last_block",
    on_epoch: EpochHook | None = None,
    label: str = "",
    rules: LoopRules = LoopRules(),
) -> dict[str, Any]:
    """Train every member (resuming from ``run_dir``) and return the results.json fields; ``label`` names the run in
    its log lines (a run of a packed sweep).
    ``members_per_fit``: None = all in one fit; ``auto`` = as many as the device's memory holds (measured), and a
    fit that runs out of memory is split in halves with a warning. ``paper_loss`` (mdl/codelength.py PAPER_LOSSES) picks the
    paper MDL's L(c_i); with ``last_block`` every member also has its untrained weights as a candidate."""
    run_dir = Path(run_dir)
    if boundaries[-1] != dm.num_train:
        raise ValueError(f"block schedule ends at {boundaries[-1]} but there are {dm.num_train} training examples")
    auto = members_per_fit == AUTO
    seeds = member_seeds(seed, len(boundaries))
    if auto:
        trial = measured_step_peak(dm.device, lambda m: stacked_trial_step(dm, recipe, seeds, m))
        members_per_fit = members_that_fit(dm.device, len(boundaries), trial)
    fits = fits_of(len(boundaries), one_per_fit_if_backtracking(members_per_fit, rules))
    check_trainer_settings(trainer_kwargs, fits, steps_per_group)
    settings = FitSettings(trainer_kwargs, patience, checkpoint_every_s, steps_per_group,
                           check_paper_loss(paper_loss) == "last_block", callbacks, final_curves, on_epoch,
                           run_identity(run_dir), rules)
    progress_path = run_dir / PROGRESS_FILE
    recorded = finished_blocks(progress_path, boundaries)  # a stale attempt (other schedule or code) is discarded here
    if not progress_path.exists():  # from the start, so a later attempt by other code knows not to resume this one
        write_progress(progress_path, boundaries, {})
    final = len(boundaries) - 1
    skipped = [f for f in fits if final not in f and all(m in recorded for m in f)]
    if skipped and on_block is not None:  # a resumed run's logger is new: give it the series of the blocks done before
        log.info("resuming: logging the %d block(s) finished before the interruption again", sum(map(len, skipped)))
        for m in sorted(m for f in skipped for m in f):
            on_block(m, BlockResult(**recorded[m]), True)  # restored: with its curves

    record = block_recorder(progress_path, boundaries, recorded, on_block, label)
    outcomes: dict[int, MemberOutcome] = {}
    pending = deque(f for f in fits if f not in skipped)
    while pending:
        members = pending.popleft()
        if len(members) == 1:
            outcomes |= run_single_fit(dm, boundaries, members[0], seeds[members[0]], recipe, settings, run_dir, record)
        else:
            try:
                outcomes |= run_stacked_fit(dm, boundaries, members, seeds, recipe, settings, run_dir, record, on_block,
                                            keep_checkpoint=final in members)
            except out_of_memory_errors() as err:
                pending.extendleft(reversed(split_after_out_of_memory(members, recorded, final, auto, run_dir, err)))
                continue
        record_restored(progress_path, boundaries, recorded, outcomes, members)
    blocks = [BlockResult(**recorded[m]) for m in range(final)]
    return prequential_results(boundaries, dm.num_classes, blocks, outcomes[final], paper_loss)


def one_per_fit_if_backtracking(members_per_fit: int | None, rules: LoopRules) -> int | None:
    """Members per fit: one when the loop backtracks (a stack shares one optimizer step count, which a member
    cannot take back alone), else as asked."""
    if rules.backtrack and members_per_fit != 1:
        log.info("protocol with backtracking: one member per fit (mdl.members_per_fit=%s not used)", members_per_fit or "all")
        return 1
    return members_per_fit


def block_recorder(progress_path: Path, boundaries: Sequence[int], recorded: dict[int, Any],
                   on_block: BlockHook | None, label: str = "") -> Callable[..., None]:
    """What happens when a member finishes in this process: its block into ``recorded`` and progress.json, a log
    line (named by the run's ``label`` where several runs train together), the loggers (the final member: the log
    line only; results.json holds it)."""
    final = len(boundaries) - 1

    def record(outcome: MemberOutcome, seconds: float | None = None) -> None:
        log_member(outcome, final, seconds, label)
        if outcome.member == final:
            return
        block = outcome.block()
        recorded[outcome.member] = block.to_dict()
        write_progress(progress_path, boundaries, recorded)
        if on_block is not None:
            on_block(outcome.member, block)

    return record


def record_restored(progress_path: Path, boundaries: Sequence[int], recorded: dict[int, Any],
                    outcomes: dict[int, MemberOutcome], members: Sequence[int]) -> None:
    """Blocks a fit restored from its checkpoint as finished before an interruption, into progress.json."""
    missing = [m for m in members if m != len(boundaries) - 1 and m not in recorded]
    if missing:
        recorded |= {m: outcomes[m].block().to_dict() for m in missing}
        write_progress(progress_path, boundaries, recorded)


def split_after_out_of_memory(members: list[int], recorded: dict[int, Any], final: int, auto: bool, run_dir: Path,
                              err: BaseException) -> list[list[int]]:
    """The members of a fit that ran out of memory and are not done, in two fits of half as many (members_per_fit
    auto); with a count the user chose, an error that says what to set instead."""
    left = [m for m in members if m == final or m not in recorded]
    fits = halved_after_out_of_memory(left, len(members), auto, err)
    stacked_checkpoint(run_dir, members, final + 1).unlink(missing_ok=True)  # its state is of the larger stack
    return fits


def stacked_checkpoint(run_dir: Path, members: list[int], num_members: int) -> Path:
    name = "stacked.ckpt" if len(members) == num_members else f"members{members[0]:02d}-{members[-1]:02d}.ckpt"
    return run_dir / "checkpoints" / name


def check_trainer_settings(trainer_kwargs: dict[str, Any], fits: list[list[int]], steps_per_group: int) -> None:
    """Refuse what a fit of several members cannot honour; say when single fits take one step per Lightning step."""
    if any(len(f) > 1 for f in fits):
        refuse_for_stacked(trainer_kwargs)
    else:
        refuse_for_sequential(trainer_kwargs)
    single_steps = settings_needing_single_steps(trainer_kwargs)
    if single_steps and steps_per_group > 1:
        log.info("trainer.kwargs.%s set: one optimizer step per Lightning step (mdl.steps_per_group=%d not used)",
                 single_steps[0], steps_per_group)


def log_member(outcome: MemberOutcome, num_blocks: int, seconds: float | None = None, label: str = "") -> None:
    run = f"{label}: " if label else ""
    if outcome.member == num_blocks:
        log.info("%sfinal fit on %d examples: %d epochs, best val loss %.4f nats", run, outcome.n_train, outcome.epochs,
                 outcome.best_val_loss)
        return
    block = outcome.block()
    took = f", {seconds:.1f}s" if seconds is not None else ""
    log.info(
        "%sblock %d/%d: trained on %d, %d epochs (best after %d)%s | next %d examples: %.3f bits/example, "
        "val %.3f bits, last block %.3f bits", run, outcome.member + 1, num_blocks, block.n_train, block.epochs,
        block.best_after_epochs, took, block.n_eval, block.eval_bits / block.n_eval, block.val_bits_per_example,
        block.heldout_bits_per_example,
    )


def run_single_fit(
    dm: ErasedDataModule, boundaries: Sequence[int], member: int, seed: int, recipe: ModelRecipe,
    settings: FitSettings, run_dir: Path, record: Callable[..., None],
) -> dict[int, MemberOutcome]:
    """One member in a fit of its own (checkpoint ``block<i>.ckpt`` / ``final.ckpt``, removed once recorded)."""
    num_blocks = len(boundaries) - 1
    is_final = member == num_blocks
    name = "final fit" if is_final else f"block {member + 1}/{num_blocks}"
    ckpt = run_dir / "checkpoints" / ("final.ckpt" if is_final else f"block{member:02d}.ckpt")
    progress = FitProgress(member, name, settings.patience, settings.trainer_kwargs.get("max_epochs"), settings.on_epoch)
    extra = [*settings.callbacks, *([settings.final_curves] if is_final and settings.final_curves is not None else []),
             progress]
    fit = partial(fit_prefix, dm, make_module=recipe.make_module, trainer_kwargs=settings.trainer_kwargs,
                  patience=settings.patience, checkpoint=ckpt, checkpoint_every_s=settings.checkpoint_every_s,
                  extra_callbacks=extra, steps_per_group=settings.steps_per_group,
                  untrained_candidate=settings.untrained_candidate, identity=settings.identity, member=member,
                  rules=settings.rules)
    outcome, seconds = fit_one_member(dm, boundaries, member, seed, fit)
    record(outcome, seconds)
    if not is_final:  # the final fit's checkpoint stays until the results are written (experiment.discard_resume_state)
        ckpt.unlink(missing_ok=True)
    return {member: outcome}


def run_stacked_fit(
    dm: ErasedDataModule, boundaries: Sequence[int], members: list[int], seeds: Sequence[int], recipe: ModelRecipe,
    settings: FitSettings, run_dir: Path, record: Callable[..., None], on_block: BlockHook | None, keep_checkpoint: bool,
) -> dict[int, MemberOutcome]:
    """Several members of this run in one fit of their stack (mdl/engine/stacked_runs.py)."""
    run = RunMembers(dm.seed, seeds, members, record, on_block, settings.on_epoch,
                     settings.final_curves if len(boundaries) - 1 in members else None)
    checkpoint = stacked_checkpoint(run_dir, members, len(boundaries))
    return fit_stack(dm, boundaries, [run], recipe, settings, checkpoint, keep_checkpoint)[0]


def prequential_results(
    boundaries: Sequence[int], k: int, blocks: list[BlockResult], final: MemberOutcome, paper_loss: str,
) -> dict[str, Any]:
    """The results.json fields of a prequential run. Both estimates of the paper MDL are recorded;
    ``paper_mdl`` is the one ``paper_loss`` names."""
    n_total = boundaries[-1]
    online = online_codelength(boundaries, k, [b.eval_bits for b in blocks])
    estimates = {
        "last_block": paper_mdl(boundaries, [b.heldout_bits_per_example for b in blocks]),
        "val_min": paper_mdl(boundaries, [b.val_bits_per_example for b in blocks]),
    }
    return {
        "num_classes": k,
        "n_train": n_total,
        "boundaries": list(boundaries),
        "blocks": [b.to_dict() for b in blocks],
        "online_codelength_bits": online,
        "online_bits_per_example": online / n_total,
        "uniform_codelength_bits": uniform_codelength(n_total, k),
        "paper_mdl": estimates[check_paper_loss(paper_loss)],
        "paper_loss": paper_loss,
        "paper_mdl_last_block": estimates["last_block"],
        "paper_mdl_val_min": estimates["val_min"],
        "final_val_loss": final.best_val_loss,
        "final_epochs": final.epochs,
        "final_test_bits_per_example": final.scored_bits / final.scored_count if final.scored_count else None,  # None without a test split
        "val_loss_curve": final.val_loss_curve,
        "train_loss_curve": final.train_loss_curve,
    }
