"""One stacked fit of the members of one run or of several (a pack: mdl/engine/pack.py).

Every member keeps what it would have alone: its initial weights (its run's seed rule), its batch
order (its run's seed), its prefix, its protocol state, its scoring batches; its outcome goes to its
own run's ``record``. Runs in one fit share the trainer settings; each run has its data module (its
``data``; runs differing only in their seed share one), its members trained, validated and scored on it. A member's id in the stack is its block index for a fit of one run (as
before packs existed: checkpoints keep their layout) and ``run x S + block`` in a pack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from datamodules.datamodule import ErasedDataModule
from mdl.engine.checkpoints import resumable
from mdl.engine.fitting import SaveLastCheckpoint, make_trainer
from mdl.engine.progress_display import EpochHook, MemberProgress
from mdl.engine.protocol import MemberOutcome, scoring_ranges
from mdl.engine.stacked_fit import StackedProtocol, build_members
from models.stacked_module import StackedClassifier

log = logging.getLogger(__name__)


@dataclass
class RunMembers:
    """One run's part of a stacked fit."""

    order_seed: int  # its batch order and augmentation draws (the run's seed)
    init_seeds: Sequence[int]  # every member's initialisation seed (mdl/engine/protocol.py member_seeds)
    members: list[int]  # the blocks of this run trained in this fit (num_blocks = the final fit)
    record: Callable[[MemberOutcome], None]  # a member finished in this process
    on_block: Callable[..., None] | None = None  # (block, result, restored): for a resumed run's new logger
    on_epoch: EpochHook | None = None
    final_curves: Any = None
    label: str = ""  # how the progress display names this run's members in a pack
    data: ErasedDataModule | None = None  # its own data (another eraser or data seed); None: fit_stack's ``dm``


def fit_stack(dm: ErasedDataModule, boundaries: Sequence[int], runs: list[RunMembers], recipe: Any, settings: Any,
              checkpoint: Path, keep_checkpoint: bool) -> list[dict[int, MemberOutcome]]:
    """Train the runs' members in one fit of their stack; each run's outcomes by block. The stacked state is
    checkpointed at the end of a pass over the longest prefix, at most every ``settings.checkpoint_every_s``."""
    num_blocks = len(boundaries) - 1
    size = num_blocks + 1
    ids = [[m if len(runs) == 1 else r * size + m for m in run.members] for r, run in enumerate(runs)]

    def where(g: int) -> tuple[int, int]:  # stack id -> (run, block)
        return (0, g) if len(runs) == 1 else divmod(g, size)

    members = [g for run_ids in ids for g in run_ids]
    prefixes = [boundaries[where(g)[1]] if where(g)[1] < num_blocks else dm.num_train for g in members]
    order_seeds = [runs[where(g)[0]].order_seed for g in members]
    datas = _distinct([dm, *(run.data for run in runs if run.data is not None)])
    source = [datas.index(run.data if run.data is not None else dm) for run in runs]  # each run's data, by position

    def data(g: int) -> ErasedDataModule:
        return datas[source[where(g)[0]]]

    loader = dm.stacked_train_loader(prefixes, settings.steps_per_group, member_ids=members, seeds=order_seeds, others=datas[1:],
                                     source_of=[source[where(g)[0]] for g in members])
    init_seeds = [runs[r].init_seeds[m] for r, m in map(where, members)]
    module = StackedClassifier(build_members(recipe.make_model, init_seeds, dm.device),
                               recipe.optimizer, recipe.lr, recipe.precision, loss=recipe.loss, member_ids=members,
                               run_of={g: where(g)[0] for g in members} if len(runs) > 1 else None)
    if recipe.compile_backend is not None:
        module.stack.compile(recipe.compile_backend)
    logged: set[int] = set()  # stack ids whose outcome this process recorded

    def on_finish(outcome: MemberOutcome) -> None:
        r, m = where(outcome.member)
        runs[r].record(replace(outcome, member=m))
        logged.add(outcome.member)

    def batches(g: int, which: int):
        ranges = scoring_ranges(boundaries, where(g)[1])
        if ranges[which] is None:
            return (data(g).test_dataloader() if which == 0 else None)
        return data(g).eval_loader(*ranges[which])

    def on_epoch(g: int, *values: Any) -> None:
        r, m = where(g)
        if runs[r].on_epoch is not None:
            runs[r].on_epoch(m, *values)

    finals = {r * size + num_blocks if len(runs) > 1 else num_blocks: run.final_curves
              for r, run in enumerate(runs) if num_blocks in run.members}
    curves = {g: c for g, c in finals.items() if c is not None}
    labels = {} if len(runs) == 1 else {
        g: f"{runs[r].label} {'final' if m == num_blocks else f'block {m + 1}'}" for g, (r, m) in ((g, where(g)) for g in members)}
    protocol = StackedProtocol(
        loader, lambda g: data(g).val_dataloader(), partial(batches, which=0), settings.patience,
        settings.trainer_kwargs.get("max_epochs"), recipe.lr, on_finish=on_finish, on_member_epoch=curves,
        heldout_batches=partial(batches, which=1), untrained_candidate=settings.untrained_candidate,
        on_epoch=on_epoch if any(run.on_epoch is not None for run in runs) else None,
        final_member=None, final_members=sorted(finals), labels=labels, data_of=lambda g: source[where(g)[0]],
    )
    callbacks = [protocol, MemberProgress(protocol), *settings.callbacks, SaveLastCheckpoint(checkpoint, settings.checkpoint_every_s)]
    for c in curves.values():  # in the Trainer only for their state in the checkpoints
        callbacks.insert(2, c)
    kwargs = {**settings.trainer_kwargs, "max_epochs": -1}  # the protocol stops each member and then the fit
    trainer = make_trainer(kwargs, dm.device, callbacks, checkpointing=True, identity=settings.identity)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resumable(checkpoint, settings.identity))
    outcomes: list[dict[int, MemberOutcome]] = [{} for _ in runs]
    for g, outcome in protocol.outcomes.items():
        r, m = where(g)
        outcomes[r][m] = replace(outcome, member=m)
        if m < num_blocks and g not in logged and runs[r].on_block is not None:
            # finished before an interruption: this process's logger lacks it (its epochs, if it takes them, were
            # handed on at the fit's start, with their accuracy)
            log.info("%sresumed: logging block %d of a fit finished before the interruption",
                     f"{runs[r].label}: " if runs[r].label else "", m + 1)
            runs[r].on_block(m, outcomes[r][m].block(), runs[r].on_epoch is None)  # restored: with its curves
    if not keep_checkpoint:  # every member is recorded; the fit holding the final member keeps its checkpoint
        checkpoint.unlink(missing_ok=True)  # until the results are written (experiment.discard_resume_state)
    return outcomes


def _distinct(modules: list[ErasedDataModule]) -> list[ErasedDataModule]:
    """Each data module once, in order of first appearance (by identity: runs share an object or have their own)."""
    seen: dict[int, ErasedDataModule] = {}
    for module in modules:
        seen.setdefault(id(module), module)
    return list(seen.values())
