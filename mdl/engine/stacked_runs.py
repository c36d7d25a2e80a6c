"""One stacked fit of the members of one run or of several (a pack).

Every member keeps what it would have alone: its initial weights (its run's seed rule), its batch
order (its run's seed), its prefix, its protocol state, its scoring batches; its outcome goes to its
own run's ledger (mdl.engine.ledger). Runs in one fit share the trainer settings; each run has its data
module (runs differing only in their seed share one), its members trained, validated and scored on it. A
member's id in the stack is ``r x S + block``, r the run's place in the fit: a run alone's ids are its blocks.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from datamodules.datamodule import ErasedDataModule
from mdl.engine.checkpoints import resumable
from mdl.engine.trainer import SaveLastCheckpoint, make_trainer
from mdl.engine.ledger import Ledger
from mdl.engine.preemption import sigterm_requested
from mdl.engine.progress_display import MemberProgress
from mdl.engine.protocol import MemberOutcome, scoring_ranges
from mdl.engine.fitting import Fitting
from mdl.engine.stacked_fit import FitMembers, StackedProtocol, build_members
from models.stacked_module import StackedClassifier

log = logging.getLogger(__name__)


def fit_stack(
    parts: Sequence[tuple[Ledger, list[int]]], fitting: Fitting, checkpoint: Path, keep_checkpoint: bool
) -> list[dict[int, MemberOutcome]]:
    """Train these runs' members (each run's ledger and its blocks in this fit) in one fit of their stack; each
    run's outcomes by block. The stacked state is checkpointed at the end of a pass (whole epochs of the longest prefix), at
    most every ``fitting.checkpoint_every_s``."""
    ledgers = [ledger for ledger, _ in parts]
    runs = [ledger.run for ledger in ledgers]
    first = runs[0]
    size = first.size
    num_blocks = size - 1
    members = [r * size + m for r, (_, blocks) in enumerate(parts) for m in blocks]

    def where(g: int) -> tuple[int, int]:  # stack id -> (run in this fit, block)
        return divmod(g, size)

    datas = list({id(run.data): run.data for run in runs}.values())  # each data module once, in order of first use
    source = [next(i for i, d in enumerate(datas) if d is run.data) for run in runs]  # each run's data, by position
    dm = datas[0]

    def data(g: int) -> ErasedDataModule:
        return datas[source[where(g)[0]]]

    prefixes = [
        first.boundaries[m] if m < num_blocks else data(g).num_train for g, m in ((g, where(g)[1]) for g in members)
    ]
    loader = dm.stacked_train_loader(
        prefixes,
        fitting.pacing,
        member_ids=members,
        seeds=[runs[where(g)[0]].seed for g in members],
        others=datas[1:],
        source_of=[source[where(g)[0]] for g in members],
        reshuffle=fitting.rules.reshuffle,
        augment_per_batch=fitting.rules.augment_per_batch,
    )
    loader.end_pass_early = sigterm_requested  # the checkpoint it asks for comes at an epoch end (preemption)
    seeds = [run.seeds() for run in runs]
    recipe = first.model
    module = StackedClassifier(
        build_members(
            recipe.make_model, [seeds[r][m] for r, m in map(where, members)], dm.device, fitting.channels_last
        ),
        recipe.optimizer,
        recipe.lr,
        fitting.precision,
        loss=recipe.loss,
        member_ids=members,
        run_of={g: where(g)[0] for g in members} if len(runs) > 1 else None,
    )
    if fitting.compile_backend is not None:
        module.stack.compile(fitting.compile_backend)
    logged: set[int] = set()  # stack ids whose outcome this process recorded

    def on_finish(outcome: MemberOutcome) -> None:
        r, m = where(outcome.member)
        ledgers[r].record(replace(outcome, member=m))
        logged.add(outcome.member)

    def batches(g: int, which: int):
        ranges = scoring_ranges(first.boundaries, where(g)[1])
        if ranges[which] is None:
            return data(g).test_dataloader() if which == 0 else None
        return data(g).eval_loader(*ranges[which])

    def on_epoch(g: int, *values: Any) -> None:
        r, m = where(g)
        if runs[r].on_epoch is not None:
            runs[r].on_epoch(m, *values)

    finals = {
        r * size + num_blocks: run.final_curves
        for r, (run, (_, blocks)) in enumerate(zip(runs, parts))
        if num_blocks in blocks
    }
    curves = {g: c for g, c in finals.items() if c is not None}
    labels = {
        g: f"{runs[r].label} {'final' if m == num_blocks else f'block {m + 1}'}"
        for g, (r, m) in ((g, where(g)) for g in members)
        if runs[r].label
    }
    hooks = FitMembers(
        heldout_batches=partial(batches, which=1),
        data_of=lambda g: source[where(g)[0]],
        on_finish=on_finish,
        on_member_epoch=curves,
        on_epoch=on_epoch if any(run.on_epoch is not None for run in runs) else None,
        final_members=sorted(finals),
        labels=labels,
    )
    val_batch_size = dm.options.batch_size if fitting.rules.batch_mean_validation else None  # as the original
    protocol = StackedProtocol(
        loader,
        lambda g: data(g).val_dataloader(val_batch_size),
        partial(batches, which=0),
        fitting.patience,
        fitting.max_epochs,
        recipe.lr,
        hooks,
        fitting.untrained_candidate,
        fitting.rules,
    )
    callbacks = [
        protocol,
        MemberProgress(protocol),
        *fitting.callbacks,
        SaveLastCheckpoint(checkpoint, fitting.checkpoint_every_s),
    ]
    for c in curves.values():  # in the Trainer only for their state in the checkpoints
        callbacks.insert(2, c)
    kwargs = {**fitting.trainer_kwargs, "max_epochs": -1}  # the protocol stops each member and then the fit
    trainer = make_trainer(kwargs, dm.device, callbacks, checkpointing=True, stamp=fitting.stamp)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resumable(checkpoint, fitting.stamp))
    outcomes: list[dict[int, MemberOutcome]] = [{} for _ in runs]
    for g, outcome in protocol.outcomes.items():
        r, m = where(g)
        outcomes[r][m] = replace(outcome, member=m)
        if m < num_blocks and g not in logged and runs[r].on_block is not None:
            # finished before an interruption: this process's logger lacks it (its epochs, if it takes them, were
            # handed on at the fit's start, with their accuracy)
            log.info("%sresumed: logging block %d of a fit finished before the interruption", ledgers[r].prefix, m + 1)
            ledgers[r].log_block(m, outcomes[r][m].block(), runs[r].on_epoch is None)  # restored: with its curves
    if not keep_checkpoint:  # every member is recorded; the fit holding the final member keeps its checkpoint
        checkpoint.unlink(missing_ok=True)  # until the results are written (experiment.discard_resume_state)
    return outcomes
