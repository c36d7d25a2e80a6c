"""The stacked fit's progress: a live table on a terminal, plain periodic lines in a log."""

from __future__ import annotations

import io
import logging
import math
import time

import torch
from rich.console import Console

from datamodules.stacked_batches import StackedBatches
from mdl.prequential_callback import PrequentialCallback
from mdl.progress_display import MemberProgress


def _protocol(patience: int = 5) -> PrequentialCallback:
    loader = StackedBatches(torch.zeros(100, 4), torch.zeros(100, dtype=torch.long), [20, 50, 100], batch_size=10)
    protocol = PrequentialCallback(loader, lambda: [], lambda m: [], patience=patience, max_epochs=None, lr=1e-3)
    protocol.members[1].epoch, protocol.members[1].best_score, protocol.members[1].wait = 7, 0.4321, 2
    return protocol


def test_time_left_is_the_slowest_members_patience_at_the_measured_speed() -> None:
    display = MemberProgress(_protocol(patience=5), live=False)
    display.started, display.steps = time.monotonic(), 0
    assert math.isnan(display.seconds_left())  # nothing measured yet
    display.started, display.steps = time.monotonic() - 10.0, 10  # 1 s per step
    # members: 2 steps/epoch x 5 patience = 10, 5 x (5 - 2 waited) = 15, 10 x 5 = 50 steps
    assert 50.0 <= display.seconds_left() < 51.0
    assert "about 0m50s left" in display.line()


def test_log_lines_name_every_member_still_training(caplog) -> None:
    protocol = _protocol()
    protocol.outcomes[0] = object()  # member 0 has stopped
    display = MemberProgress(protocol, interval=0.0, live=False)
    display.on_train_start(None, None)
    with caplog.at_level(logging.INFO, logger="mdl.progress_display"):
        display.on_train_batch_end(None, None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "2/3 members training" in line and "block 2 e7 best 0.4321" in line and "block 1 " not in line and "final e0" in line


def test_live_table_shows_members_epochs_and_best_losses() -> None:
    display = MemberProgress(_protocol(), live=True)
    out = io.StringIO()
    Console(file=out, width=120).print(display._table())
    text = out.getvalue()
    assert "0.4321" in text and "2/5" in text and "3 of 3 training" in text


def test_speed_counts_every_optimizer_step_of_a_group() -> None:
    loader = StackedBatches(torch.zeros(100, 4), torch.zeros(100, dtype=torch.long), [20, 50, 100], batch_size=10, steps_per_group=4)
    display = MemberProgress(_protocol(), interval=1e9, live=False)
    display.on_train_start(None, None)
    for group in loader:  # one pass: 10 steps, in groups cut short at the 2- and 5-step epoch ends
        display.on_train_batch_end(None, None, None, group, 0)
    assert display.steps == 10 and display.steps > len(list(loader)) > 0
