"""The stacked fit's progress: a live table on a terminal, plain periodic lines in a log."""

from __future__ import annotations

import io
import logging
import math
import time

import torch
from rich.console import Console

from datamodules.stacked_batches import Pacing, StackedBatches, TrainSource
from mdl.engine.stacked_fit import StackedProtocol
from mdl.engine.progress_display import MemberProgress


def _protocol(patience: int = 5) -> StackedProtocol:
    loader = StackedBatches(
        [TrainSource(torch.zeros(100, 4), torch.zeros(100, dtype=torch.long))], [20, 50, 100], batch_size=10
    )
    protocol = StackedProtocol(loader, lambda m: [], lambda m: [], patience=patience, max_epochs=None, lr=1e-3)
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
    with caplog.at_level(logging.INFO, logger="mdl.engine.progress_display"):
        display.on_train_batch_end(None, None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        "2/3 members training" in line
        and "block 2 e7 best 0.4321" in line
        and "block 1 " not in line
        and "final e0" in line
    )


def test_live_table_shows_members_epochs_and_best_losses() -> None:
    display = MemberProgress(_protocol(), live=True)
    out = io.StringIO()
    Console(file=out, width=120).print(display._table())
    text = out.getvalue()
    assert "0.4321" in text and "2/5" in text and "3 of 3 training" in text


def test_speed_counts_every_optimizer_step_of_a_group() -> None:
    loader = StackedBatches(
        [TrainSource(torch.zeros(100, 4), torch.zeros(100, dtype=torch.long))],
        [20, 50, 100],
        batch_size=10,
        pacing=Pacing(4),
    )
    display = MemberProgress(_protocol(), interval=1e9, live=False)
    display.on_train_start(None, None)
    for group in loader:  # one pass: 10 steps, in groups cut short at the 2- and 5-step epoch ends
        display.on_train_batch_end(None, None, None, group, 0)
    assert display.steps == 10 and display.steps > len(list(loader)) > 0


import pytest  # noqa: E402

from conftest import FITS, FAST, compose_config  # noqa: E402


@pytest.mark.parametrize("engine", ["sequential", "stacked"])
def test_every_epoch_is_handed_on_live_and_equals_the_results(engine: str, tmp_path, monkeypatch) -> None:
    """Both engines call the per-epoch hook at each epoch's end of every member (blocks and final fit),
    before that block is reported finished: what W&B shows live equals results.json's curves."""
    from mdl.run import experiment

    events: list[tuple] = []
    accuracies: list[float] = []
    real_live, real_block = experiment.live_epochs, experiment.log_block

    def recording_live(logger, num_blocks):
        hook = real_live(logger, num_blocks)
        return lambda m, e, tr, va, acc: (
            events.append(("epoch", m, e, tr, va)),
            accuracies.append(acc),
            hook(m, e, tr, va, acc),
        )

    monkeypatch.setattr(experiment, "live_epochs", recording_live)
    monkeypatch.setattr(
        experiment,
        "log_block",
        lambda logger, i, b, curves=False: (events.append(("block", i)), real_block(logger, i, b, curves)),
    )
    results = experiment.run_experiment(compose_config([*FAST, FITS[engine]], tmp_path), tmp_path / "run")
    num_blocks = len(results["blocks"])
    for m in range(num_blocks + 1):
        block = results["blocks"][m] if m < num_blocks else results
        got = [(tr, va) for kind, mm, *rest in events if kind == "epoch" and mm == m for _, tr, va in [rest]]
        assert got == list(zip(block["train_loss_curve"], block["val_loss_curve"])), m
        if m < num_blocks:  # live: the block's epochs came before its end
            last_epoch = max(i for i, ev in enumerate(events) if ev[0] == "epoch" and ev[1] == m)
            assert last_epoch < events.index(("block", m))
    assert len(accuracies) == sum(e[0] == "epoch" for e in events) and all(0.0 <= a <= 1.0 for a in accuracies)


def test_validation_accuracy_is_the_fraction_the_argmax_gets_right() -> None:
    """A known answer for the accuracy: logits that always favour class 0, on labels of which 3 in 10 are 0, are
    right 30% of the time (every member of a stack)."""
    import torch
    from torch import nn

    from models.stacked_module import StackedClassifier
    from models.stacking import StackedModel

    y = torch.tensor([0, 0, 0, 1, 2, 3, 1, 2, 3, 4])
    x = torch.zeros(10, 3)

    def favours_zero() -> nn.Module:
        model = nn.Linear(3, 5)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.copy_(torch.tensor([1.0, 0, 0, 0, 0]))
        return model

    stacked = StackedClassifier(
        StackedModel([favours_zero(), favours_zero()]), lambda p: torch.optim.SGD(p, lr=0.1), lr=0.1
    )
    _, count, correct = stacked.loss_sums(
        stacked.eval_weights([0, 1]), [(x[:4], y[:4]), (x[4:], y[4:])], with_correct=True
    )
    assert count == 10 and (correct / count).tolist() == [0.3, 0.3]
