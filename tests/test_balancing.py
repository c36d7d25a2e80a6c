"""Class balancing of the training split (SUBY, RWY): exact counts, reproducibility per data_seed,
untouched val/test, and end-to-end digits runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FAST, run_in_process
from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions
from datamodules.splits import balance_indices
from datamodules.stacked_batches import StackedBatches, TrainSource


def imbalanced_labels(seed: int = 0) -> torch.Tensor:
    counts = [500, 200, 80, 1200]
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    return y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))]


def test_suby_subsamples_every_class_to_the_smallest_count_in_the_seeded_order() -> None:
    y = imbalanced_labels()
    idx = balance_indices(y, "suby", data_seed=0)
    assert torch.bincount(y[idx]).tolist() == [80, 80, 80, 80]
    assert len(torch.unique(idx)) == len(idx) and bool((idx[1:] > idx[:-1]).all())  # no repeats, order kept
    for c in range(4):  # each class keeps its first 80 examples of the (seeded) split order
        assert torch.equal(idx[y[idx] == c], torch.nonzero(y == c).flatten()[:80])
    assert torch.equal(idx, balance_indices(y, "suby", data_seed=5))  # a subset of the seeded order: no own draw


def test_rwy_stores_the_split_as_it_is() -> None:
    y = imbalanced_labels()
    assert torch.equal(balance_indices(y, "rwy", data_seed=0), torch.arange(len(y)))


def rwy_epochs(y: torch.Tensor, epochs: int, seed: int = 0) -> list[torch.Tensor]:
    x = torch.zeros(len(y), 1)
    loader = StackedBatches([TrainSource(x, y)], [len(y)], len(y), seeds=seed, class_balance=4)
    return [loader.next().y[0, 0] for _ in range(epochs)]  # one batch per epoch


def test_rwy_epochs_are_class_balanced_in_expectation_and_redrawn_each_epoch() -> None:
    y = imbalanced_labels()  # classes of 500, 200, 80, 1200 examples
    epochs = rwy_epochs(y, 40)
    assert all(len(e) == len(y) for e in epochs)  # an epoch is n draws
    mean = sum(torch.bincount(e, minlength=4).double() for e in epochs) / 40
    std_of_mean = (len(y) * 0.25 * 0.75 / 40) ** 0.5  # multinomial, p = 1/4 per class
    assert bool(((mean - len(y) / 4).abs() < 4 * std_of_mean).all()), mean.tolist()
    assert not torch.equal(epochs[0], epochs[1])  # redrawn
    assert all(torch.equal(a, b) for a, b in zip(epochs[:3], rwy_epochs(y, 3)))  # deterministic per (seed, epoch)
    assert not torch.equal(epochs[0], rwy_epochs(y, 1, seed=1)[0])


def test_rwy_draws_each_members_batches_from_its_own_prefix() -> None:
    """A member of a stack draws the class-balanced batches of its prefix that it draws in a stack of one."""
    y = imbalanced_labels()
    x = torch.arange(len(y), dtype=torch.float32)[:, None]
    prefix, batch = 700, 128
    single = StackedBatches([TrainSource(x[:prefix], y[:prefix])], [prefix], batch, seeds=3, class_balance=4)
    stacked = StackedBatches([TrainSource(x, y)], [prefix, len(y)], batch, seeds=3, class_balance=4)
    for _ in range(2 * single.steps_per_pass):
        alone, group = single.next(), stacked.next()
        rows = group.weight[0, 0] > 0
        assert torch.equal(group.x[0, 0][rows], alone.x[0, 0][alone.weight[0, 0] > 0])


def test_unknown_method_is_named() -> None:
    with pytest.raises(ValueError, match="data.balance='bogus'"):
        DataOptions.from_config(dict(source="synthetic", balance="bogus", device="cpu"), {"name": "none"})


def datamodule(balance: str | None, data_seed: int = 0) -> ErasedDataModule:
    data = dict(source="digits", balance=balance, device="cpu", cache_dir=None, diagnostics=False)
    dm = ErasedDataModule(DataOptions.from_config(data, {"name": "none", "options": {}}, data_seed=data_seed))
    dm.setup()
    return dm


@pytest.mark.parametrize("method", ["suby", "rwy"])
def test_only_the_training_split_changes_and_the_counts_are_recorded(method: str) -> None:
    plain, balanced = datamodule(None), datamodule(method)
    for split in ("val_set", "test_set"):
        assert torch.equal(getattr(plain, split).x, getattr(balanced, split).x)
        assert torch.equal(getattr(plain, split).y, getattr(balanced, split).y)
    before = torch.bincount(plain.train_set.y, minlength=10)
    after = torch.bincount(balanced.train_set.y, minlength=10)
    record = balanced.diagnostics["balance"]
    assert record["class_counts_before"] == before.tolist() and record["class_counts_after"] == after.tolist()
    if method == "suby":
        assert after.tolist() == [int(before.min())] * 10
    else:  # rwy: the stored split is the plain one; each epoch's draws are balanced
        assert torch.equal(balanced.train_set.x, plain.train_set.x) and record["sampling"]
    assert torch.equal(datamodule(method).train_set.x, balanced.train_set.x)  # deterministic per data_seed


@pytest.mark.slow
@pytest.mark.parametrize("method", ["suby", "rwy"])
def test_a_run_balances_digits(tmp_path: Path, method: str) -> None:
    """A whole run with data.balance (in process, as launch.py runs it): its record says what it balanced."""
    results = run_in_process([f"data.balance={method}", "eraser=leace", *FAST], tmp_path)
    assert results["config"]["data"]["balance"] == method
    after = results["data_diagnostics"]["balance"]["class_counts_after"]
    assert results["boundaries"][-1] == sum(after)
    if method == "suby":
        assert len(set(after)) == 1


def test_cache_keys_include_the_balancing() -> None:
    keys = {
        b: DataOptions.from_config(dict(source="digits", balance=b, device="cpu"), {"name": "none"}).data_key()
        for b in (None, "suby", "rwy")
    }
    assert len(set(keys.values())) == 3


@pytest.mark.slow
def test_rwy_never_scores_a_copy_of_a_training_example(tmp_path: Path, monkeypatch) -> None:
    """The online code scores block [t_i, t_{i+1}) with the model trained on [0, t_i). Every row of
    the stored split is a distinct image (the old fixed bootstrap stored copies: this failed), and each
    fit's class-balanced batches come from its own prefix only, so no scored example was trained on."""
    from conftest import compose_config
    from mdl.run.experiment import run_experiment

    served: list[tuple[int, torch.Tensor]] = []  # (prefix size, a batch's rows)
    original = StackedBatches.next

    def record(self, steps: int = 1):
        group = original(self, steps)
        for row, m in enumerate(group.members):
            for step in range(group.steps):
                real = group.weight[step, row] > 0
                served.append((self.streams[m].n, group.x[step, row][real].flatten(1).clone()))
        return group

    monkeypatch.setattr(StackedBatches, "next", record)
    cfg = compose_config(
        [*FAST, "data.balance=rwy", "eraser=none", "mdl.members_per_fit=1", "skip_if_done=false"], tmp_path
    )
    results = run_experiment(cfg, tmp_path / "run")
    train = datamodule("rwy").train_set.x.flatten(1)
    position = {tuple(r.tolist()): i for i, r in enumerate(train)}
    assert len(position) == len(train) == results["boundaries"][-1], "the stored training split holds copies"
    prefixes = {n for n, _ in served}
    assert prefixes == set(results["boundaries"])  # every block's fit and the final one drew balanced batches
    for n, batch in served:
        assert all(position[tuple(r.tolist())] < n for r in batch), f"a fit on {n} examples was served a later one"
