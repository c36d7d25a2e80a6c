"""protocol=original's last two options against the original code (EleutherAI/mdl): the per-block redraw of the pool
(``protocol.redraw_per_block``, mdl/sweep.py@3034bc0, docs/differences-from-original.md D10) and QLEACE / ALF-QLEACE
fitted in float32 (``protocol.eraser_fit_dtype``, experiments/cli.py@0cc7065, D15)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_config, pixel_classes, run_in_process

from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions, EraserOptions
from datamodules.sources import ImageSet
from erasure import fit_eraser
from mdl.schedule import block_boundaries


def original_blocks(x: torch.Tensor, val_size: int, cumsizes: list[int], last_part: int, seed: int) -> list[tuple]:
    """mdl/sweep.py@3034bc0 Sweep.run's split of its pool per block, transcribed (its line numbers in the comments;
    ``nonval_size`` and ``parts[-1]`` as :91, :99 make them). Per block: (train_x[:n], the next chunk of the same
    permutation, val_x, test_x)."""
    nonval_size = len(x) - val_size  # :91
    rng = torch.Generator(device=x.device).manual_seed(seed)  # :88
    blocks = []
    for n, next_n in zip(cumsizes[:-1], cumsizes[1:]):  # :109
        indices = torch.randperm(len(x), device=x.device, generator=rng)  # :111
        x = x[indices]  # :112
        nonval_x, val_x = x.split([nonval_size, val_size])  # :114
        train_size, test_size = nonval_size - last_part, last_part  # :117
        train_x, test_x = nonval_x.split([train_size, test_size])  # :118
        # fit on train_x[:n] validated on val_x (:129-133), scored on test_x (:143-145); the next chunk is this
        # project's online code of the block, from the same permutation
        blocks.append((train_x[:n], nonval_x[n:next_n], val_x, test_x))
    return blocks


def pool_module(train: int, val: int, data_seed: int, tmp_path: Path, **data) -> ErasedDataModule:
    """A data module whose rows are their own pool positions: the training split rows 0..train-1, validation after."""
    options = DataOptions(
        source="digits",
        eraser=EraserOptions.from_config({"name": "none"}),
        data_seed=data_seed,
        device="cpu",
        cache_dir=str(tmp_path),
        **data,
    )
    dm = ErasedDataModule(options)
    ids = torch.arange(train + val, dtype=torch.float32).view(-1, 1, 1, 1)
    labels = torch.arange(train + val) % 3
    dm.train_set, dm.val_set = ImageSet(ids[:train], labels[:train]), ImageSet(ids[train:], labels[train:])
    return dm


@pytest.mark.parametrize("data_seed", [0, 7])
def test_each_block_trains_validates_and_is_scored_on_the_original_draw(tmp_path: Path, data_seed: int) -> None:
    """For a small pool, block i's prefix, next block, validation split and scored last block under
    ``ErasedDataModule.redrawn(i)`` are the rows the original's loop gives its block i (``original_blocks``)."""
    train, val = 120, 30
    bounds = block_boundaries(train, 4, 16, "oric")
    dm = pool_module(train, val, data_seed, tmp_path)
    pool = torch.arange(train + val)
    expected = original_blocks(pool, val, bounds, train - bounds[-2], data_seed)
    for block, (prefix, following, val_rows, scored) in enumerate(expected):
        with dm.redrawn(block):
            rows = dm.train_set.x.flatten().long()
            assert torch.equal(rows[: bounds[block]], prefix)
            assert torch.equal(rows[bounds[block] : bounds[block + 1]], following)
            assert torch.equal(dm.val_set.x.flatten().long(), val_rows)
            assert torch.equal(rows[bounds[-2] :], scored)
            assert torch.equal(dm.train_set.y, rows % 3) and torch.equal(dm.val_set.y, val_rows % 3)
        assert torch.equal(dm.train_set.x.flatten().long(), torch.arange(train))  # the splits as they were afterwards
    first, second = expected[0][2], expected[1][2]
    assert not torch.equal(first, second)  # each block its own validation rows


def test_redraw_refuses_splits_erased_differently(tmp_path: Path) -> None:
    dm = pool_module(20, 5, 0, tmp_path, eval_labels="predicted")
    with pytest.raises(ValueError, match="data.eval_labels=true"):
        with dm.redrawn(0):
            pass


def test_the_redraw_plans_one_member_per_fit() -> None:
    """A stack trains its members on one layout of the data, so a redraw per block fits each member alone."""
    from mdl.engine.memory import one_per_fit_if_backtracking
    from mdl.engine.protocol import LoopRules

    assert one_per_fit_if_backtracking("all", LoopRules(redraw_per_block=True)) == 1
    assert one_per_fit_if_backtracking(4, LoopRules(redraw_per_block=True)) == 1
    assert one_per_fit_if_backtracking("all", LoopRules()) == "all"


def test_protocol_groups_set_the_options() -> None:
    original = compose_config(["protocol=original", "eraser=qleace"])
    assert original.protocol.redraw_per_block and original.eraser.options.fit_dtype == "float32"
    assert compose_config(["protocol=original", "eraser=alf_qleace"]).eraser.options.fit_dtype == "float32"
    sound = compose_config(["eraser=qleace"])
    assert not sound.protocol.redraw_per_block and sound.eraser.options.fit_dtype == "float64"


def test_a_fast_run_with_the_redraw_trains_every_block_on_its_draw(tmp_path: Path, monkeypatch) -> None:
    """protocol=original at debug=fast: each prefix member's fit runs inside its block's draw, the final fit on the
    splits as they are, and the run reports its numbers."""
    drawn: list[int] = []
    redrawn = ErasedDataModule.redrawn

    def recorded(self: ErasedDataModule, block: int):
        drawn.append(block)
        return redrawn(self, block)

    monkeypatch.setattr(ErasedDataModule, "redrawn", recorded)
    results = run_in_process(["protocol=original", "debug=fast", "eraser=none"], tmp_path)
    assert drawn == [0, 1] and len(results["blocks"]) == 2
    assert results["paper_mdl"] > 0 and results["online_codelength_bits"] > 0


# --- QLEACE and ALF-QLEACE in float32 (experiments/cli.py@0cc7065:346, :386) --------------------------------------


def class_gaps(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The largest gap between a class's mean (covariance) and the overall mean (the mean of the class covariances),
    relative to the data's scale, computed in float64."""
    x = x.double()
    scale = float(x.var(0).sum())
    means = torch.stack([x[y == c].mean(0) for c in y.unique()])
    covs = torch.stack([torch.cov(x[y == c].T) for c in y.unique()])
    mean_gap = float((means - x.mean(0)).norm(dim=1).max()) / scale**0.5
    cov_gap = float(torch.linalg.matrix_norm(covs - covs.mean(0)).max()) / scale
    return mean_gap, cov_gap


def test_qleace_in_float32_is_the_fit_run_in_float32() -> None:
    """The float32 fit is the float64 fit's code run in float32 (moments, barycenter, maps; a transcription of the fit
    for full-rank classes without shrinkage), differs from the float64 fit, and still equalises the classes' means and
    covariances to float32 rounding."""
    from erasure.moments import class_moments
    from erasure.qleace import transport_maps, wasserstein_barycenter

    x, y = pixel_classes(n_per_class=200, d=6, k=3)
    x = x.flatten(1).float()  # the data as the original fitted and erased it (experiments/cli.py@0cc7065:330)
    fitted32 = fit_eraser("qleace", x, y, num_classes=3, fit_dtype="float32", device="cpu")
    fitted64 = fit_eraser("qleace", x, y, num_classes=3, device="cpu")
    moments = class_moments(x, y, 3, dtype=torch.float32)
    bary = wasserstein_barycenter(moments.covariances(), moments.weights, tol=1e-6, max_iter=100)
    maps = transport_maps(bary)
    assert fitted32.maps.dtype == torch.float32 and fitted64.maps.dtype == torch.float64
    assert torch.equal(fitted32.maps, (maps + maps.transpose(-1, -2)) / 2)
    assert torch.equal(fitted32.class_means, moments.means) and torch.equal(fitted32.mean, moments.mean)
    assert not torch.equal(fitted32.maps.double(), fitted64.maps)
    torch.testing.assert_close(fitted32.maps.double(), fitted64.maps, rtol=1e-4, atol=1e-5)
    erased32, erased64 = fitted32(x, y), fitted64(x.double(), y)
    assert erased32.dtype == torch.float32
    assert max(class_gaps(erased32, y)) < 1e-5
    assert max(class_gaps(erased64, y)) < 1e-12  # float64: exact to its own rounding


def test_alf_qleace_in_float32_differs_from_float64_and_still_erases_the_means() -> None:
    x, y = pixel_classes(n_per_class=200, d=6, k=3)
    x = x.flatten(1).float()  # the data as the original fitted and erased it (experiments/cli.py@0cc7065:330)
    fitted32 = fit_eraser("alf_qleace", x, y, num_classes=3, fit_dtype="float32", device="cpu")
    fitted64 = fit_eraser("alf_qleace", x, y, num_classes=3, device="cpu")
    assert fitted32.leace_proj.dtype == torch.float32 and fitted64.leace_proj.dtype == torch.float64
    assert not torch.equal(fitted32.leace_proj.double(), fitted64.leace_proj)
    torch.testing.assert_close(fitted32.leace_proj.double(), fitted64.leace_proj, rtol=1e-4, atol=1e-5)
    assert fitted32.rank == fitted64.rank
    assert class_gaps(fitted32(x, y), y)[0] < 1e-5
    before, after = class_gaps(x, y)[1], class_gaps(fitted32(x, y), y)[1]
    assert after < before


def test_an_unknown_fit_dtype_is_refused() -> None:
    x, y = pixel_classes(n_per_class=20, d=3, k=2)
    with pytest.raises(ValueError, match="fit_dtype='float16'"):
        fit_eraser("qleace", x.flatten(1), y, num_classes=2, fit_dtype="float16", device="cpu")


def test_rehash_gives_stored_runs_the_sound_values() -> None:
    """Runs stored before the options existed trained one order of the pool and fitted QLEACE in float64."""
    sys.path.insert(0, str(REPO / "scripts"))
    from rehash_store import current_form

    stored = {"protocol": {"name": "original", "backtrack": True}, "eraser": {"name": "qleace", "options": {}}}
    upgraded = current_form(stored)
    assert upgraded["protocol"]["redraw_per_block"] is False and upgraded["protocol"]["eraser_fit_dtype"] == "float64"
    assert upgraded["eraser"]["options"]["fit_dtype"] == "float64"
