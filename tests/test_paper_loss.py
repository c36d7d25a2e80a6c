"""The paper MDL's L(c_i), measured as the original code measured it (mdl.paper_loss=last_block):
the best-validation weights scored on a chunk no prefix model trains on or selects with, the
untrained model a candidate; and the earlier estimate, the minimum validation loss, kept as val_min."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import FITS, compose_config
from mdl.codelength import check_paper_loss, heldout_block, paper_mdl
from mdl.run.console import summary
from mdl.run.experiment import run_experiment

# Blocks long enough for the untrained model to win somewhere: digits' first block of 64 examples.
SCHEDULE = ["trainer.kwargs.max_epochs=12", "trainer.patience=4", "mdl.num_blocks=4", "width=32", "model.base_width=32"]


def run(tmp_path: Path, tag: str, *overrides: str) -> dict:
    cfg = compose_config([*SCHEDULE, "skip_if_done=false", *overrides], output_root=tmp_path / tag)
    return run_experiment(cfg, tmp_path / tag / "run")


def test_heldout_block_is_the_last_block_no_prefix_model_trains_on() -> None:
    bounds = [64, 137, 219, 1197]
    start, stop = heldout_block(bounds)
    assert (start, stop) == (219, 1197)
    assert max(bounds[:-1]) <= start  # every prefix model's training data ends before it


def test_unknown_paper_loss_is_named() -> None:
    with pytest.raises(ValueError, match="mdl.paper_loss='min'.*last_block.*val_min"):
        check_paper_loss("min")


@pytest.mark.parametrize("engine", ["stacked", "sequential"])
def test_paper_mdl_weights_each_models_loss_on_the_last_block(tmp_path: Path, engine: str) -> None:
    res = run(tmp_path, engine, FITS[engine])
    bounds, blocks = res["boundaries"], res["blocks"]
    assert res["paper_loss"] == "last_block"
    assert (
        res["paper_mdl"]
        == res["paper_mdl_last_block"]
        == paper_mdl(bounds, [b["heldout_bits_per_example"] for b in blocks])
    )
    assert res["paper_mdl_val_min"] == paper_mdl(bounds, [b["val_bits_per_example"] for b in blocks])
    # the last prefix model's next block is the held-out chunk: its two scores are one measurement
    assert blocks[-1]["heldout_bits_per_example"] == blocks[-1]["eval_bits"] / blocks[-1]["n_eval"]
    assert "paper MDL: " in summary(res, Path("r.json")) and "(last_block, mdl.paper_loss; val_min: " in summary(
        res, Path("r.json")
    )


@pytest.mark.parametrize("engine", ["stacked", "sequential"])
def test_no_block_ends_worse_on_validation_than_the_untrained_model(tmp_path: Path, engine: str) -> None:
    """A zero-initialised muP readout predicts uniformly: the untrained model's validation loss is
    log2 K bits. With it as a candidate no block's kept weights can be worse; a block whose fits
    never beat it keeps it and pays exactly log2 K on the held-out chunk."""
    res = run(tmp_path, engine, FITS[engine], "optimizer.lr=1e-9")  # too small to move the weights
    chance = math.log2(res["num_classes"])
    for block in res["blocks"]:
        assert block["val_bits_per_example"] <= chance + 1e-6
        assert block["best_after_epochs"] == 0
        assert block["heldout_bits_per_example"] == pytest.approx(chance, abs=1e-12)
        assert block["eval_bits"] == pytest.approx(block["n_eval"] * chance, abs=1e-9)
    assert res["paper_mdl"] == pytest.approx(chance * sum(res["boundaries"][1:]) / res["boundaries"][-1], abs=1e-9)


def test_val_min_keeps_only_trained_epochs_as_candidates(tmp_path: Path) -> None:
    """The earlier estimate, kept under its own name: only trained epochs are candidates, so a
    model that trains away from the uniform prediction can end above chance (what last_block fixes)."""
    res = run(tmp_path, "val_min", "mdl.paper_loss=val_min", "optimizer.lr=1e-9", "trainer.kwargs.max_epochs=2")
    assert res["paper_loss"] == "val_min" and res["paper_mdl"] == res["paper_mdl_val_min"]
    assert all(b["best_after_epochs"] >= 1 for b in res["blocks"])
