"""The prequential driver: every member of the runs given, in the fits the memory planner chooses, one protocol.

For boundaries t_1 < ... < t_S = N, a run's member i < S - 1 is a fresh model fit on train[:t_i] (early
stopping on the validation split, best weights kept) and scored on train[t_i:t_{i+1}]; the last member is
the final fit on all N examples. A run alone and a pack of runs (``hydra/launcher=packed``) take this one
path: a run alone is a pack of one. Members are (run, block) pairs, trained in the fits of
``mdl.engine.memory.plan_fits``: a fit of one member of each run trains each plain model in a fit of its
own (mdl.engine.single_fit), a fit of several trains their stacked form (mdl.engine.stacked_runs);
either way each member follows the same protocol (mdl.engine.protocol) from the same seed, so each run's
numbers are those it has alone.

Each run records its finished blocks in its progress.json as they finish (mdl.engine.ledger); a
re-launched job skips the fits whose blocks are all recorded and resumes a fit in progress from its
checkpoint: a fit of one member's in its run's store (``block<i>.ckpt``, ``final.ckpt``), a stacked fit's
in ``Fitting.folder`` (``stacked.ckpt`` for a fit of every member, else named by its members).
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from datamodules.datamodule import ErasedDataModule
from datamodules.timing import timed
from erasure.files import sha256_hex
from mdl.engine.checkpoints import run_identity
from mdl.engine.ledger import Ledger
from mdl.engine.members import AUTO
from mdl.engine.memory import Member, halved, out_of_memory_errors, plan_fits
from mdl.engine.progress_display import FitProgress
from mdl.engine.protocol import MemberOutcome
from mdl.engine.fitting import Fitting, Run, module_factory
from mdl.engine.single_fit import fit_one_member, fit_prefix
from mdl.engine.stacked_runs import fit_stack
from mdl.engine.trainer_settings import refuse_for_sequential, refuse_for_stacked, settings_needing_single_steps
from models.module import Classifier

log = logging.getLogger(__name__)
STACKED_CHECKPOINT = "stacked.ckpt"  # a stacked fit of every member of the runs trained together


def train_runs(runs: Sequence[Run], fitting: Fitting) -> list[dict[str, Any]]:
    """Train every member of ``runs`` (resuming where their progress and checkpoints say) and return each run's
    results.json fields, in order. Runs trained together share ``fitting`` and have equal models, block
    schedules and input shapes (``check_trainable_together``)."""
    check_trainable_together(runs)
    ledgers = [Ledger.open(run) for run in runs]
    fits = plan_fits(runs, fitting)
    check_trainer_settings(fitting.trainer_kwargs, fits, fitting.steps_per_group)
    finished = [f for f in fits if all(ledgers[r].done(m) for r, m in f)]
    for r, ledger in enumerate(ledgers):
        ledger.relog([m for f in finished for q, m in f if q == r])
    makers: dict[int, Callable[[], Classifier]] = {}  # each run's module factory, made once (it compiles once)
    pending = deque(f for f in fits if f not in finished)
    while pending:
        members = pending.popleft()
        if not is_stacked(members) and needs_plain_fit(fitting):
            for r, m in members:
                if not ledgers[r].done(m):
                    if r not in makers:
                        makers[r] = module_factory(
                            runs[r].model, fitting.precision, fitting.channels_last, fitting.compile_backend
                        )
                    fit_single(ledgers[r], m, makers[r], fitting)
            continue
        if not is_stacked(members) and len(members) > 1:  # one member of each run: each a stack of one, as alone
            pending.extendleft([[(r, m)] for r, m in reversed(members) if not ledgers[r].done(m)])
            continue
        try:
            run_stacked_fit(ledgers, members, fitting)
        except out_of_memory_errors() as err:
            left = [(r, m) for r, m in members if not ledgers[r].done(m)]
            pending.extendleft(reversed(halved(left, len(members), fitting.members_per_fit == AUTO, err)))
            stacked_checkpoint(fitting.folder, members, len(runs) * runs[0].size).unlink(missing_ok=True)  # its
            # state is of the larger stack
    return [ledger.results(fitting.paper_loss) for ledger in ledgers]


def check_trainable_together(runs: Sequence[Run]) -> None:
    """Runs trained together must agree in what their stacked form shares: input shape, classes, block schedule
    (``mdl.run.pack.pack_key`` groups only runs whose configs make them equal)."""
    shapes = sorted({(tuple(r.data.input_shape), r.data.num_classes, tuple(r.boundaries)) for r in runs})
    if len(shapes) > 1:
        raise ValueError(
            "runs trained together differ in input shape, classes or block schedule ("
            + "; ".join(f"input {s}, {k} classes, blocks {list(b)}" for s, k, b in shapes)
            + "): train them apart (their configs should not share a pack key: mdl.run.pack.pack_key)"
        )


def fit_single(ledger: Ledger, member: int, make_module: Callable[[], Classifier], fitting: Fitting) -> None:
    """One member in a fit of its own (checkpoint ``block<i>.ckpt`` / ``final.ckpt`` in its run's store, removed
    once recorded; the final fit's stays until the results are written: experiment.discard_resume_state)."""
    run = ledger.run
    is_final = member == ledger.final
    name = "final fit" if is_final else f"block {member + 1}/{ledger.final}"
    ckpt = run.store / "checkpoints" / ("final.ckpt" if is_final else f"block{member:02d}.ckpt")
    progress = FitProgress(member, name, fitting.patience, fitting.max_epochs, run.on_epoch)
    extra = [*fitting.callbacks, *([run.final_curves] if is_final and run.final_curves is not None else []), progress]
    fit = partial(
        fit_prefix,
        run.data,
        make_module=make_module,
        fitting=fitting,
        checkpoint=ckpt,
        identity=run_identity(run.store),
        extra_callbacks=extra,
        member=member,
    )
    redraw = fitting.rules.redraw_per_block and not is_final  # the final fit trains on the splits as they are
    layout = run.data.redrawn(member) if redraw else nullcontext()
    with batch_order_of(run.data, run.seed), layout, timed(f"fit: {name}"):
        outcome, seconds = fit_one_member(run.data, run.boundaries, member, run.seeds()[member], fit)
    ledger.record(outcome, seconds)
    if not is_final:
        ckpt.unlink(missing_ok=True)
    ledger.keep({member: outcome})


def needs_plain_fit(fitting: Fitting) -> bool:
    """What only the plain model's fit (mdl.engine.single_fit) honours yet: protocol=original's loop rules and
    trainer settings that need one optimizer step per Lightning step."""
    rules = fitting.rules
    return (
        rules.one_member_per_fit
        or rules.evaluate_as_trained
        or not rules.reshuffle
        or rules.augment_per_batch
        or bool(settings_needing_single_steps(fitting.trainer_kwargs))
        or fitting.trainer_kwargs.get("min_epochs") not in (None, 0)
    )


def is_stacked(members: list[Member]) -> bool:
    """Whether a fit trains several members of one run at once (their stacked form), not one plain model each."""
    return len(members) > len({r for r, _ in members})


def run_stacked_fit(ledgers: Sequence[Ledger], members: list[Member], fitting: Fitting) -> None:
    """One stacked fit of these (run, block) members; its checkpoint in ``fitting.folder``, kept while the fit
    holds a final member (until the results are written)."""
    size = ledgers[0].run.size
    in_fit = sorted({r for r, _ in members})
    parts = [(ledgers[r], sorted(m for q, m in members if q == r)) for r in in_fit]
    checkpoint = stacked_checkpoint(fitting.folder, members, size * len(ledgers))
    has_final = any(m == size - 1 for _, m in members)
    with timed(stacked_fit_phase(members, size)):
        outcomes = fit_stack(parts, fitting, checkpoint, keep_checkpoint=has_final)
    for r, outcome in zip(in_fit, outcomes):
        ledgers[r].keep(outcome)


def stacked_fit_phase(members: list[Member], size: int) -> str:
    """A stacked fit's name in debug=profile's breakdown (mdl.run.phases): the blocks it trains."""
    blocks = sorted({m for _, m in members})
    names = [f"block {m + 1}/{size - 1}" if m < size - 1 else "final fit" for m in blocks]
    runs = len({r for r, _ in members})
    return f"fit (stacked{f', {runs} runs' if runs > 1 else ''}): {', '.join(names)}"


def stacked_checkpoint(folder: Path, members: list[Member], total: int) -> Path:
    """A stacked fit's checkpoint: ``stacked.ckpt`` for a fit of every member, else named by its (run, block)
    members (another split, e.g. after running out of memory, is another name)."""
    name = (
        STACKED_CHECKPOINT if len(members) == total else f"fit-{sha256_hex(repr(sorted(members)).encode())[:12]}.ckpt"
    )
    return folder / "checkpoints" / name


@contextmanager
def batch_order_of(dm: ErasedDataModule, seed: int) -> Iterator[None]:
    """A data module shared by runs that differ in their seed, serving one run's plain fit: that run's batch order
    (a single fit draws it from the module's seed; a stacked fit is given each run's)."""
    before, dm.seed = dm.seed, seed
    try:
        yield
    finally:
        dm.seed = before


def check_trainer_settings(trainer_kwargs: dict[str, Any], fits: list[list[Member]], steps_per_group: int) -> None:
    """Refuse what a fit of several members cannot honour; say when single fits take one step per Lightning step."""
    if any(is_stacked(f) for f in fits):
        refuse_for_stacked(trainer_kwargs)
    else:
        refuse_for_sequential(trainer_kwargs)
    single_steps = settings_needing_single_steps(trainer_kwargs)
    if single_steps and steps_per_group > 1:
        log.info(
            "trainer.kwargs.%s set: one optimizer step per Lightning step (mdl.steps_per_group=%d not used)",
            single_steps[0],
            steps_per_group,
        )


__all__ = ["MemberOutcome", "STACKED_CHECKPOINT", "check_trainer_settings", "train_runs"]
