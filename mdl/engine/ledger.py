"""A run's account of its members while it trains: which blocks are done (progress.json), the log line and the
loggers' call when a member finishes, and the results.json fields once all are done.

A run's blocks are recorded as they finish, so a re-launched job skips the fits whose blocks are all recorded
and resumes a fit in progress from its checkpoint; the final member is recorded in results.json only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from mdl.codelength import check_paper_loss, online_codelength, paper_mdl, uniform_codelength
from mdl.engine.progress import finished_blocks, write_progress
from mdl.engine.protocol import MemberOutcome
from mdl.engine.fitting import Run
from mdl.results import PROGRESS_FILE, BlockResult

log = logging.getLogger(__name__)


@dataclass
class Ledger:
    """One run's finished members: ``recorded`` (block -> progress.json record) and ``outcomes`` (member ->
    outcome, for the members trained or resumed in this process)."""

    run: Run
    recorded: dict[int, dict[str, Any]] = field(default_factory=dict)
    outcomes: dict[int, MemberOutcome] = field(default_factory=dict)

    @classmethod
    def open(cls, run: Run) -> Ledger:
        """The run's progress so far (a stale attempt, of another schedule or code, is discarded with a warning);
        progress.json is written at once, so a later attempt by other code knows not to resume this one."""
        if run.boundaries[-1] != run.data.num_train:
            raise ValueError(
                f"block schedule ends at {run.boundaries[-1]} but there are {run.data.num_train} training examples"
            )
        path = run.store / PROGRESS_FILE
        recorded = run.wrap(finished_blocks)(path, run.boundaries)  # its lines ("resuming: ...") are the run's
        if not path.exists():
            write_progress(path, run.boundaries, {})
        return cls(run, recorded)

    @property
    def final(self) -> int:
        return self.run.size - 1

    def done(self, member: int) -> bool:
        """Recorded before this fit (the final member never is: it is trained or resumed to the end)."""
        return member != self.final and member in self.recorded

    def relog(self, blocks: Sequence[int]) -> None:
        """A resumed run's logger is new: give it the series of the blocks finished before the interruption."""
        if self.run.on_block is None or not blocks:
            return
        log.info("%sresuming: logging the %d block(s) finished before the interruption again", self.prefix, len(blocks))
        for m in sorted(blocks):
            self.log_block(m, BlockResult(**self.recorded[m]), True)  # restored: with its curves

    def log_block(self, member: int, block: BlockResult, restored: bool = False) -> None:
        if self.run.on_block is not None:
            self.run.wrap(self.run.on_block)(member, block, restored)

    def record(self, outcome: MemberOutcome) -> None:
        """A member finished in this process: its block into progress.json, a log line, the loggers (the final
        member: the log line only; results.json holds it)."""
        self.run.wrap(self._record)(outcome)

    def _record(self, outcome: MemberOutcome) -> None:
        log_member(outcome, self.final, self.prefix)
        if outcome.member == self.final:
            return
        block = outcome.block()
        self.recorded[outcome.member] = block.to_dict()
        write_progress(self.run.store / PROGRESS_FILE, self.run.boundaries, self.recorded)
        self.log_block(outcome.member, block)

    def keep(self, outcomes: dict[int, MemberOutcome]) -> None:
        """A fit's outcomes; blocks it restored from its checkpoint as finished before an interruption go into
        progress.json."""
        self.outcomes |= outcomes
        missing = [m for m in outcomes if m != self.final and m not in self.recorded]
        if missing:
            self.recorded |= {m: outcomes[m].block().to_dict() for m in missing}
            write_progress(self.run.store / PROGRESS_FILE, self.run.boundaries, self.recorded)

    @property
    def prefix(self) -> str:
        return f"{self.run.label}: " if self.run.label else ""

    def results(self, paper_loss: str) -> dict[str, Any]:
        blocks = [BlockResult(**self.recorded[m]) for m in range(self.final)]
        final = self.outcomes[self.final] if self.run.final_fit else None
        return prequential_results(self.run.boundaries, self.run.data.num_classes, blocks, final, paper_loss)


def log_member(outcome: MemberOutcome, num_blocks: int, run: str = "") -> None:
    """A finished member's log line; ``run`` is the run's label prefix (``Ledger.prefix``) when runs share a log."""
    if outcome.member == num_blocks:
        log.info(
            "%sfinal fit on %d examples: %d epochs, best val loss %.4f nats",
            run,
            outcome.n_train,
            outcome.epochs,
            outcome.best_val_loss,
        )
        return
    block = outcome.block()
    log.info(
        "%sblock %d/%d: trained on %d, %d epochs (best after %d) | next %d examples: %.3f bits/example, "
        "val %.3f bits, last block %.3f bits",
        run,
        outcome.member + 1,
        num_blocks,
        block.n_train,
        block.epochs,
        block.best_after_epochs,
        block.n_eval,
        block.eval_bits / block.n_eval,
        block.val_bits_per_example,
        block.heldout_bits_per_example,
    )


def prequential_results(
    boundaries: Sequence[int], k: int, blocks: list[BlockResult], final: MemberOutcome | None, paper_loss: str
) -> dict[str, Any]:
    """The results.json fields of a prequential run. Both estimates of the paper MDL are recorded;
    ``paper_mdl`` is the one ``paper_loss`` names. Without a final fit (``protocol.final_fit=false``) its fields are
    null and its curves empty."""
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
        "final_val_loss": final.best_val_loss if final else None,
        "final_epochs": final.epochs if final else None,
        "final_test_bits_per_example": final.scored_bits / final.scored_count
        if final and final.scored_count
        else None,  # None without a test split
        "val_loss_curve": final.val_loss_curve if final else [],
        "train_loss_curve": final.train_loss_curve if final else [],
        "val_accuracy_curve": final.val_accuracy_curve if final else [],
    }
