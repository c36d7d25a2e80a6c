"""Erasure as a step of its own: ``fit_on_scope`` and ``erase_splits`` on the splits ``load_splits`` makes give the
tensors the data module serves, with no Lightning and no cache; the options are checked once, when made."""

from __future__ import annotations

import pytest
import torch

from datamodules.datamodule import ErasedDataModule
from datamodules.erasing import erase_splits, fit_on_scope
from datamodules.options import DataOptions
from datamodules.splits import load_splits


@pytest.mark.parametrize("eraser", [{"name": "leace", "options": {}, "fit_scope": "pool"}, {"name": "qleace"}])
def test_erase_splits_is_what_the_data_module_serves(eraser: dict) -> None:
    data = {"source": "digits", "device": "cpu", "cache_dir": None, "diagnostics": False}
    options = DataOptions.from_config(data, eraser)
    splits = load_splits(options)
    tensors, info = erase_splits(splits, fit_on_scope(splits, options.eraser, options.device), options)
    dm = ErasedDataModule(options)
    dm.setup()
    for split in ("train", "val", "test"):
        assert torch.equal(tensors[f"{split}_x"], getattr(dm, f"{split}_set").x)
        assert torch.equal(tensors[f"{split}_y"], getattr(dm, f"{split}_set").y)
    assert info["classes"] == dm.classes and len(tensors["train_x"]) == dm.num_train


def test_options_are_frozen_and_checked_when_made() -> None:
    options = DataOptions.from_config({"source": "digits", "device": "cpu"}, {"name": "none"})
    assert options.device == torch.device("cpu") and options.eraser.fit_scope == "split"
    with pytest.raises(AttributeError):
        options.batch_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"data.batch_size=0"):
        DataOptions.from_config({"source": "digits", "batch_size": 0}, {"name": "none"})
    with pytest.raises(ValueError, match="cannot erase augmented batches"):
        DataOptions.from_config({"source": "digits", "augment_order": "augment_then_erase"}, {"name": "gradient"})
