"""A preempted eraser fit resumes from its saved state (issue 47, item 10): the moment statistics accumulated in chunks
with a save and load between equal one pass, and a QLEACE fit stopped at any step and resumed from what it saved equals
an uninterrupted fit bit for bit, taking up exactly where the save was (erasure/resumable.py,
datamodules/fit_progress.py; the end-to-end SIGTERM test is test_preemption.py's slow one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import datamodules.interrupts as interrupts
from datamodules.cache import ErasureCache, remove_stale_temporaries
from datamodules.fit_progress import FitAbandoned, PartialFit
from datamodules.options import EraserOptions
from erasure import class_moments, fit_eraser
from erasure.moments import MomentAccumulator

OPTIONS = {"batch_size": 64, "tol": 1e-12, "max_iter": 6}  # 5 batches, then 6 iterations: every kind of step
BATCHES = 5
pytestmark = pytest.mark.filterwarnings("ignore:QLEACE. barycenter fixed point stopped after 6:RuntimeWarning")


def class_data(n: int = 300, d: int = 5, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Classes of their own covariances and offsets; class 2 only in the later rows (its shift is set late)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (n,), generator=g)
    y[n // 2 :: 3] = 2
    scales = torch.rand(k, d, generator=g) + 0.2
    x = torch.randn(n, d, generator=g) * scales[y] + 0.7 + y[:, None]
    return x.float(), y


def same_eraser(a, b) -> bool:
    (ta, ma), (tb, mb) = a.serialized(), b.serialized()
    return ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_moments_accumulated_in_chunks_with_a_save_and_load_between_equal_one_pass(tmp_path: Path, chunks: int) -> None:
    x, y = class_data()
    batch = 40
    starts = list(range(0, len(y), batch))
    one_pass = class_moments(x, y, 3, batch_size=batch)
    accumulator = MomentAccumulator(3, x.shape[1])
    for i, start in enumerate(starts):
        if i and i % chunks == 0:  # stop, save, and go on in a new accumulator from the file
            save_file(accumulator.state_dict(), str(tmp_path / "state.safetensors"))
            accumulator = MomentAccumulator(3, x.shape[1])
            accumulator.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
            assert accumulator.rows == start
        accumulator.add(x[start : start + batch], y[start : start + batch])
    resumed = accumulator.finish()
    for name in ("counts", "means", "scatters"):
        assert torch.equal(getattr(resumed, name), getattr(one_pass, name)), name


def test_a_saved_state_of_other_moments_is_refused() -> None:
    state = MomentAccumulator(3, 5).state_dict()
    with pytest.raises(ValueError, match="saved moments do not fit this accumulator: sums"):
        MomentAccumulator(3, 6).load_state_dict(state)


class Stop(Exception):
    pass


class Recorder:
    """A FitProgress that saves (copies) every state offered and stops the fit at offer ``stop_at``."""

    def __init__(self, restored: dict | None = None, stop_at: int | None = None) -> None:
        self.restored, self.stop_at, self.saved, self.offers = restored, stop_at, None, 0

    def restore(self):
        return self.restored

    def offer(self, state, stable: bool) -> None:
        self.offers += 1
        self.saved = {k: v.clone() for k, v in state().items()}
        if self.offers == self.stop_at:
            raise Stop


@pytest.mark.parametrize("stop_at", [1, 3, BATCHES + 1, BATCHES + 2, BATCHES + 4])
def test_a_stopped_qleace_fit_resumes_at_its_saved_step_and_equals_an_uninterrupted_fit(monkeypatch, stop_at) -> None:
    """Offers: one per batch of the moments (1..5), the finished moments (6), the span (7), then one per barycenter
    iteration: a stop at each kind of step resumes at the step after it, bit for bit."""
    x, y = class_data()
    uninterrupted = fit_eraser("qleace", x, y, **OPTIONS)
    complete = Recorder()
    assert same_eraser(fit_eraser("qleace", x, y, progress=complete, **OPTIONS), uninterrupted)
    assert complete.offers > BATCHES + 3  # some barycenter iterations offered too

    stopped = Recorder(stop_at=stop_at)
    with pytest.raises(Stop):
        fit_eraser("qleace", x, y, progress=stopped, **OPTIONS)
    batches = []
    original_add = MomentAccumulator.add
    monkeypatch.setattr(
        MomentAccumulator, "add", lambda self, xb, yb: (batches.append(self.rows), original_add(self, xb, yb))
    )
    resumed = Recorder(restored=stopped.saved)
    assert same_eraser(fit_eraser("qleace", x, y, progress=resumed, **OPTIONS), uninterrupted)
    assert batches == [64 * b for b in range(min(stop_at, BATCHES), BATCHES)]  # the batches after the saved one only
    # every step after the saved one offered again, none before it (the span's eigh and the iterations done are kept)
    assert resumed.offers == complete.offers - stop_at


def test_options_and_identity_leave_the_fits_progress_out() -> None:
    from datamodules.settings import default_options

    assert "progress" not in default_options("qleace")
    node = {"name": "qleace", "options": {"tol": 1e-6}, "fit_scope": "pool", "checkpoint_every_s": 60}
    options = EraserOptions.from_config(node)
    assert options.checkpoint_every_s == 60 and "checkpoint_every_s" not in options.identity
    with pytest.raises(ValueError, match=r"eraser.checkpoint_every_s=-1: .*\(a number >= 0"):
        EraserOptions.from_config({**node, "checkpoint_every_s": -1})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_partial_fit_writes_when_due_and_its_last_stable_state_when_stopped(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "k.partial.safetensors"
    progress = PartialFit(path, every_s=10, clock=clock)
    assert progress.restore() is None
    progress.offer(lambda: {"a": torch.ones(2)}, stable=False)
    assert not path.exists()  # not due yet
    clock.now = 10
    progress.offer(lambda: {"a": torch.full((2,), 2.0)}, stable=True)
    assert torch.equal(progress.restore()["a"], torch.full((2,), 2.0)) and progress.writes == 1
    clock.now = 15
    progress.offer(lambda: {"a": torch.full((2,), 3.0)}, stable=True)
    progress.offer(lambda: {"a": torch.full((2,), 4.0)}, stable=False)
    progress.save_latest()  # the last state is not stable (changing in place): nothing to add
    assert torch.equal(progress.restore()["a"], torch.full((2,), 2.0))
    progress.offer(lambda: {"a": torch.full((2,), 5.0)}, stable=True)
    progress.save_latest()  # as the main thread does on a SIGTERM
    progress.save_latest()  # once
    assert torch.equal(progress.restore()["a"], torch.full((2,), 5.0)) and progress.writes == 2

    path.write_bytes(path.read_bytes()[:-3])  # damaged: reported, and the fit starts over
    with pytest.warns(RuntimeWarning, match="partial eraser fit: .* fitting from the start"):
        assert PartialFit(path, every_s=10).restore() is None


def test_a_signal_saves_the_fits_last_finished_step_and_the_fit_resumes_from_it(tmp_path: Path, monkeypatch) -> None:
    """The main thread, abandoning the work (datamodules.interrupts), saves the last stable state; the worker stops
    at its next step; a fit from that file equals an uninterrupted one. Periodic saves never come due here."""
    x, y = class_data()
    uninterrupted = fit_eraser("qleace", x, y, **OPTIONS)
    path = tmp_path / "k.partial.safetensors"
    progress = PartialFit(path, every_s=1e9)
    original_offer = PartialFit.offer

    def offer_then_signal(self, state, stable: bool) -> None:  # a SIGTERM during the second barycenter iteration
        original_offer(self, state, stable)
        if self._step == BATCHES + 3:
            interrupts._abandoned.set()
            interrupts._save_before_leaving()

    monkeypatch.setattr(PartialFit, "offer", offer_then_signal)
    try:
        with interrupts.saved_if_abandoned(progress.save_latest), pytest.raises(FitAbandoned):
            fit_eraser("qleace", x, y, progress=progress, **OPTIONS)
    finally:
        interrupts._abandoned.clear()
    assert progress.writes == 2  # the main thread's save, then the worker's at its next step
    monkeypatch.setattr(PartialFit, "offer", original_offer)
    state = PartialFit(path, every_s=1e9).restore()
    assert int(state["barycenter.iteration"]) == 2
    assert same_eraser(fit_eraser("qleace", x, y, progress=PartialFit(path, every_s=1e9), **OPTIONS), uninterrupted)


def test_the_cache_removes_the_partial_fit_once_the_eraser_is_stored(tmp_path: Path) -> None:
    cache, x, y = ErasureCache(tmp_path), *class_data()
    partial = cache.partial_path("0" * 32)

    def fit():
        progress = PartialFit(partial, every_s=0)
        return fit_eraser("qleace", x, y, progress=progress, **OPTIONS)

    cache.eraser("0" * 32, fit)
    assert cache.eraser_path("0" * 32).exists() and not partial.exists()
    # a killed writer's temporary of the partial fit is swept like the cache's own (under the eraser's lock)
    stale = tmp_path / f".{partial.name}.123.abc.tmp"
    stale.write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match="removed 1 temporary file"):
        assert remove_stale_temporaries(tmp_path, stale_after_s=0) == [stale]
