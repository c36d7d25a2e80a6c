"""The prequential driver: every member of the runs given, in the fits the memory planner chooses, one protocol.

For boundaries t_1 < ... < t_S = N, a run's member i < S - 1 is a fresh model fit on train[:t_i] (early
stopping on the validation split, best weights kept) and scored on train[t_i:t_{i+1}]; the last member is
the final fit on all N examples. A run alone and a pack of runs (``hydra/launcher=packed``) take this one
path: a run alone is a pack of one. Members are (run, block) pairs, trained in the fits of
``mdl.engine.memory.plan_fits``, each one stack of k >= 1 members (mdl.engine.stacked_runs; a stack of one runs
its plain model, ``models.stacking.StackedModel``); a fit of one member of each of several runs trains each in a
stack of its own, as alone. Each member follows the same protocol (mdl.engine.protocol) from the same seed, so
each run's numbers are those it has alone.

Each run records its finished blocks in its progress.json as they finish (mdl.engine.ledger); a
re-launched job skips the fits whose blocks are all recorded and resumes a fit in progress from its
checkpoint in ``Fitting.folder`` (``stacked.ckpt`` for a fit of every member, else named by its members).
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch

from datamodules.timing import timed
from erasure.files import sha256_hex
from mdl.engine.ledger import Ledger
from mdl.engine.members import AUTO
from mdl.engine.memory import Member, halved, plan_fits
from mdl.engine.protocol import MemberOutcome
from mdl.engine.fitting import Fitting, Run
from mdl.engine.stacked_runs import fit_stack
from mdl.engine.trainer_settings import refuse_for_stacked

log = logging.getLogger(__name__)
STACKED_CHECKPOINT = "stacked.ckpt"  # a stacked fit of every member of the runs trained together


def train_runs(runs: Sequence[Run], fitting: Fitting) -> list[dict[str, Any]]:
    """Train every member of ``runs`` (resuming where their progress and checkpoints say) and return each run's
    results.json fields, in order. Runs trained together share ``fitting`` and have equal models, block
    schedules and input shapes (``check_trainable_together``)."""
    check_trainable_together(runs)
    ledgers = [Ledger.open(run) for run in runs]
    fits = plan_fits(runs, fitting)
    refuse_for_stacked(fitting.trainer_kwargs)  # what the protocol's own loop cannot honour
    finished = [f for f in fits if all(ledgers[r].done(m) for r, m in f)]
    for r, ledger in enumerate(ledgers):
        ledger.relog([m for f in finished for q, m in f if q == r])
    pending = deque(f for f in fits if f not in finished)
    while pending:
        members = pending.popleft()
        if not is_stacked(members) and len(members) > 1:  # one member of each run: each a stack of one, as alone
            pending.extendleft([[(r, m)] for r, m in reversed(members) if not ledgers[r].done(m)])
            continue
        try:
            run_stacked_fit(ledgers, members, fitting)
        except torch.OutOfMemoryError as err:
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
    redraw = fitting.rules.redraw_per_block and not has_final  # the final fit trains on the splits as they are
    layout = ledgers[members[0][0]].run.data.redrawn(members[0][1]) if redraw else nullcontext()
    with layout, timed(stacked_fit_phase(members, size)):
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


__all__ = ["MemberOutcome", "STACKED_CHECKPOINT", "train_runs"]
