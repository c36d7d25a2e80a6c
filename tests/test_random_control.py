"""The random-projection control removes exactly the rank it is given: an explicit int, or the edit
rank of another eraser fitted on the same data (``eraser.options.rank_from``, resolved by the data
module through its eraser cache)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, pixel_classes
from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions, EraserOptions
from datamodules.splits import load_splits
from mdl.run.components import DATA_KEYS_READ_ELSEWHERE
from erasure import fit_eraser


def edit_dimension(x: torch.Tensor, eraser) -> int:
    """Rank of what the eraser removed (x - eraser(x)), measured on the data."""
    return int(torch.linalg.matrix_rank(x - eraser(x), rtol=1e-9))


def test_explicit_rank_is_removed_exactly() -> None:
    x, y = pixel_classes(n_per_class=40, d=12)
    eraser = fit_eraser("random", x, y, rank=7, seed=3)
    assert eraser.rank == 7 and eraser.directions.shape == (12, 7)
    assert edit_dimension(x, eraser) == 7
    assert fit_eraser("random", x, y).rank == 2 * 3 - 1  # the documented fallback, 2k - 1


def datamodule(cache_dir, **options) -> ErasedDataModule:
    """A digits data module composed from the real config, eraser=random with ``options``."""
    overrides = ["eraser=random", "device=cpu", f"data.cache_dir={cache_dir}", "data.diagnostics=false"]
    cfg = compose_config(overrides + [f"eraser.options.{k}={v}" for k, v in options.items()])
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for (
        key
    ) in DATA_KEYS_READ_ELSEWHERE:  # the optimizer's and the block schedule's (mdl/run/experiment.py make_datamodule)
        data.pop(key)
    return ErasedDataModule(DataOptions.from_config(data, OmegaConf.to_container(cfg.eraser, resolve=True)), seed=0)


@pytest.mark.slow
def test_rank_from_matches_the_other_erasers_edit_rank_and_is_cached(tmp_path) -> None:
    dm = datamodule(tmp_path, rank_from="alf_qleace")
    dm.setup()
    splits = load_splits(dm.options)
    train = splits.train
    # fitted as a run of alf_qleace fits it: on the training and validation splits (its fit_scope: pool)
    alf = fit_eraser(
        "alf_qleace", torch.cat([train.x, splits.val.x]), torch.cat([train.y, splits.val.y]), num_classes=10
    )
    assert dm.eraser.rank == alf.edit_rank != 2 * 10 - 1  # 28 on digits, not 19
    assert edit_dimension(train.x.reshape(len(train.x), -1).double(), dm.eraser) == alf.edit_rank

    # a second job (another seed of the control) reuses the cached alf_qleace fit ...
    again = datamodule(tmp_path, rank_from="alf_qleace", seed=1)
    again.setup()
    assert again.cache.stats.builds == 2 and again.cache.stats.hits == 1  # random eraser + data built, alf_qleace hit
    assert again.eraser.rank == alf.edit_rank
    # ... as does a run of alf_qleace itself with its config defaults (same cache key)
    cfg = compose_config(["eraser=alf_qleace"])
    assert dm.options.eraser_key(EraserOptions.from_config(OmegaConf.to_container(cfg.eraser, resolve=True))) in {
        p.name.split(".")[0] for p in tmp_path.glob("*.eraser.safetensors")
    }


def test_rank_from_takes_the_other_erasers_options(tmp_path) -> None:
    dm = datamodule(tmp_path, rank_from="alf_qleace", rank_from_options="{max_rank:3}")
    dm.setup()
    assert dm.eraser.rank == 9 + 3  # LEACE's k - 1 directions plus at most max_rank


@pytest.mark.parametrize(
    "options, match",
    [
        ({"rank_from": "alf_qleace", "rank": 5}, "set one of them"),
        ({"rank_from": "qleace"}, "records no edit rank"),
        ({"rank_from": "random"}, "cannot take its rank from itself"),
    ],
)
def test_bad_rank_from_is_refused(tmp_path, options, match) -> None:
    with pytest.raises(ValueError, match=match):
        datamodule(tmp_path, **options).setup()
