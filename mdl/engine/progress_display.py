"""What a fit is doing, for a person watching it: one live table for every fit, or plain periodic lines.

When stdout is a terminal a table redraws in place (``live_region.LiveRegion``): every member
still training in the fit, its prefix, epoch, best
validation loss and patience left, and the time left; it is erased when the fit ends, and the
lines logged meanwhile stay above it. In a log file (Slurm, CI) a redrawn table is noise, so one
line is logged every ``interval`` seconds.

The time left is an estimate: a member stops no earlier than ``patience`` epochs without
improving (or at ``max_epochs``, if sooner), so the fit lasts about as long as the member
furthest from that point needs at the current speed (steps get cheaper as members leave, so
this errs long; new improvements make members run longer, so it also errs short).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L

from mdl.engine.live_region import LiveRegion

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan: nothing measured yet
        return "?"
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


Row = tuple[
    str, int, int, float, int
]  # (member name, prefix, epochs done, best val loss in nats, epochs without improving)


def progress_table(title: str, rows: list[Row], patience: int) -> Any:
    """The one table every fit shows on a terminal: a row per member still training."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("member", "prefix", "epoch", "best val loss (nats)", "epochs without improving"):
        table.add_column(column, justify="right")
    for name, prefix, epoch, best, wait in rows:
        table.add_row(name, str(prefix), str(epoch), f"{best:.4f}", f"{wait}/{patience}")
    return table


class MemberProgress(L.Callback):
    """A stacked fit's members (``StackedProtocol``): the table on a terminal, a line every ``interval`` s in a log."""

    def __init__(self, protocol: Any, interval: float = 30.0, live: bool | None = None) -> None:
        self.protocol = protocol
        self.interval = interval
        self.table = LiveRegion(live)
        self.last = 0.0
        self.started = 0.0
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = self.last = time.monotonic()
        self.table.start(self._table())

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any = None,
        batch: Any = None,
        batch_idx: int = 0,
    ) -> None:
        """Count the steps (a group of steps per batch in a stacked fit) for the time-left estimate; redraw the
        table at most twice a second on a terminal, or log a line every ``interval`` seconds, so the display
        never costs the fit noticeable time."""
        self.steps += getattr(batch, "steps", 1)  # a group of steps (datamodules.stacked_batches)
        now = time.monotonic()
        if self.table.on and now - self.last > 0.5:
            self.table.update(self._table())
            self.last = now
        elif not self.table.on and now - self.last > self.interval:
            log.info(self.line())
            self.last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.table.stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def seconds_left(self) -> float:
        """The slowest member's remaining steps before it may stop, at the speed measured so far."""
        if not self.steps:
            return float("nan")
        per_step = (time.monotonic() - self.started) / self.steps
        p = self.protocol
        steps = []
        for s in map(p.members.get, p.active):
            epochs = max(p.patience - s.wait, 1)
            if p.max_epochs is not None:
                epochs = min(epochs, p.max_epochs - s.epoch)
            steps.append(epochs * s.steps_per_epoch - s.step)
        return per_step * max(steps, default=0)

    def member_name(self, m: int) -> str:
        """1-based block numbers, as the log lines, CSV and W&B series ("block 3"); the last member is the final fit."""
        if m in self.protocol.hooks.labels:
            return self.protocol.hooks.labels[m]
        return "final" if m in self.protocol.final_members else f"block {m + 1}"

    def line(self) -> str:
        p = self.protocol
        parts = [
            f"{self.member_name(m)} e{s.epoch} best {s.best_score:.4f}"
            for m, s in ((m, p.members[m]) for m in p.active)
        ]
        return (
            f"stacked fit: {len(p.active)}/{len(p.members)} members training, {_duration(time.monotonic() - self.started)} "
            f"elapsed, about {_duration(self.seconds_left())} left | " + ", ".join(parts)
        )

    def _table(self) -> Any:
        p = self.protocol
        rows = [
            (self.member_name(m), s.n_train, s.epoch, s.best_score, s.wait)
            for m, s in ((m, p.members[m]) for m in p.active)
        ]
        return progress_table(
            f"prequential members: {len(p.active)} of {len(p.members)} training, "
            f"about {_duration(self.seconds_left())} left",
            rows,
            p.patience,
        )
