"""Packed runs (mdl/run/pack.py, ``hydra/launcher=packed``): runs of a sweep that differ in their seed, eraser
or data seed, trained as members of one fit, each with the numbers, folders and records it has alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, REPO, compose_config
from mdl.run.experiment import Job, run_experiment
from mdl.run.pack import data_key, pack_folder, pack_key, run_pack

BASE = [*FAST, "mdl.num_blocks=4", "trainer.kwargs.max_epochs=6", "trainer.torch_threads=1"]
NUMBERS = (
    "config_hash",
    "paper_mdl",
    "paper_mdl_val_min",
    "online_codelength_bits",
    "blocks",
    "final_val_loss",
    "final_epochs",
    "final_test_bits_per_example",
    "val_loss_curve",
    "train_loss_curve",
)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """``alone(overrides)``: the results of BASE + overrides trained alone, each run once for the tests here (they
    compare packs with the same runs), a copy each call."""
    import copy

    from mdl.run.identity import config_hash

    done: dict[str, dict] = {}

    def run(overrides: list[str]) -> dict:
        cfg = compose_config([*BASE, *overrides])
        key = config_hash(cfg)
        if key not in done:
            root = tmp_path_factory.mktemp("alone")
            cfg.paths.output_root = str(root)
            done[key] = run_experiment(cfg, root / "run")
        return copy.deepcopy(done[key])

    return run


def jobs(root: Path, seeds=(0, 1, 2), extra=()) -> list[Job]:
    return [Job.checked(compose_config([*BASE, *extra, f"seed={s}"], root), root / f"run{s}") for s in seeds]


def test_packed_runs_give_each_run_its_own_numbers_to_the_bit(tmp_path: Path, alone) -> None:
    alone = [alone([f"seed={s}"]) for s in (0, 1, 2)]
    packed = run_pack(jobs(tmp_path / "b"))
    assert len({r["paper_mdl"] for r in alone}) == 3  # the seeds differ, so a mix-up would show
    for one, other in zip(alone, packed):
        for key in NUMBERS:
            assert other[key] == one[key], key
    for s, result in zip((0, 1, 2), packed):  # each run its own folder, results.json and store entry
        assert json.loads((tmp_path / "b" / f"run{s}" / "results.json").read_text())["paper_mdl"] == result["paper_mdl"]
        store = Path(compose_config([*BASE, f"seed={s}"], tmp_path / "b").paths.store_dir) / result["config_hash"]
        assert json.loads((store / "results.json").read_text())["paper_mdl"] == result["paper_mdl"]
    assert not pack_folder(jobs(tmp_path / "b")).exists()  # the pack's checkpoint is gone once every result is written


@pytest.mark.slow
def test_a_finished_run_in_a_pack_is_skipped_and_the_rest_trained(tmp_path: Path) -> None:
    first = run_experiment(compose_config([*BASE, "seed=1"], tmp_path), tmp_path / "alone")
    packed = run_pack(jobs(tmp_path))
    assert packed[1]["skipped"] and packed[1]["paper_mdl"] == first["paper_mdl"]
    assert not packed[0].get("skipped") and not packed[2].get("skipped")


@pytest.mark.slow
def test_a_job_repeating_a_run_in_its_pack_is_skipped_as_the_basic_launcher_skips_it(tmp_path: Path) -> None:
    """Jobs that differ only in bookkeeping keys are one run: the pack trains it once; the repeat, after it, is skipped
    as done with the same numbers and its own folder's results.json (before: the whole pack failed)."""
    listed = [
        Job.checked(compose_config([*BASE, *extra], tmp_path), tmp_path / f"job{i}")
        for i, extra in enumerate([["seed=0"], ["seed=0", "print_config=false"], ["seed=1"]])
    ]
    results = run_pack(listed)
    assert not results[0].get("skipped") and not results[2].get("skipped") and results[1]["skipped"]
    assert results[1]["paper_mdl"] == results[0]["paper_mdl"] != results[2]["paper_mdl"]
    assert json.loads((tmp_path / "job1" / "results.json").read_text())["paper_mdl"] == results[0]["paper_mdl"]


@pytest.mark.slow
def test_runs_that_differ_in_seed_eraser_or_data_seed_share_a_key(tmp_path: Path) -> None:
    key = lambda *o: pack_key(compose_config([*BASE, *o], tmp_path))  # noqa: E731
    assert key("seed=0") == key("seed=5") == key("seed=5", "logger=csv")
    assert key("seed=0") == key("eraser=none") == key("eraser=qleace", "data_seed=1")
    assert key("seed=0") != key("width=64") and key("seed=0") != key("data.zscore=true")  # another model or data set
    assert key("seed=0", "mdl.members_per_fit=1") is None  # one member per fit: packing would change its numbers
    pre = "+optimizer.precondition={p:-1,eps:1.0e-3}"  # a fit-wide callback made from one run's data: seeds only
    assert key(pre, "seed=1") == key(pre) != key(pre, "data_seed=1")
    suby = "data.balance=suby"  # the training split's size follows the data seed: so do the blocks
    assert key(suby, "seed=1") == key(suby, "eraser=leace") == key(suby) != key(suby, "data_seed=1")
    with pytest.raises(ValueError, match="differ in more than their seed"):
        run_pack(jobs(tmp_path, (0,)) + jobs(tmp_path / "x", (1,), extra=["width=64"]))


@pytest.mark.slow
def test_values_interpolated_from_the_seed_or_the_eraser_keep_runs_apart(tmp_path: Path) -> None:
    """A key is made from the resolved config: the paper presets' ``data_seed: ${seed}`` gives each seed its own data,
    and a learning rate looked up by eraser puts runs of other learning rates in other packs."""
    preset = lambda s: compose_config(["+experiment=paper/mlp_width", f"seed={s}"], tmp_path)  # noqa: E731
    assert preset(0).data_seed == 0 and preset(1).data_seed == 1
    assert data_key(preset(0)) != data_key(preset(1)) and pack_key(preset(0)) == pack_key(preset(1))
    lr = [
        "+paper.lr_by_eraser.none=5.0e-4",
        "+paper.lr_by_eraser.leace=5.0e-2",
        "optimizer.lr='${oc.select:paper.lr_by_eraser.${eraser.name},5.0e-4}'",
    ]
    key = lambda *o: pack_key(compose_config([*BASE, *lr, *o], tmp_path))  # noqa: E731
    assert key("eraser=none") != key("eraser=leace") and key("eraser=none") == key("eraser=qleace")  # 5e-4: the default


@pytest.mark.slow
@pytest.mark.parametrize(
    "fits",
    [[], ["mdl.members_per_fit=3"], ["mdl.members_per_fit=2"]],
    ids=["one fit", "fits of 3 and a plain final fit", "fits of 2"],
)
def test_runs_with_other_erasers_and_data_seeds_packed_keep_their_numbers_to_the_bit(
    tmp_path: Path, fits, alone
) -> None:
    """Each run its own erased data (eraser, data seed) or a shared one (seed only): the numbers of the run alone,
    in one fit of the whole pack or in fits of k members: each run's members in the fits they have alone (debug=fast's
    4 members in fits of 3: 3 + the final model alone, a plain model's fit; of 2: 2 + 2), every run's j-th fit together.
    Before, a pack's fits of k mixed the runs' members block by block: other stacks, a stacked final fit where the run
    alone trains a plain one, other final fits (issue 34)."""
    variants = [[*fits, *v] for v in ([], ["eraser=none"], ["seed=1"], ["data_seed=1"], ["eraser=qleace"])]
    alone = [alone(v) for v in variants]
    together = [
        Job.checked(compose_config([*BASE, *v], tmp_path / "b"), tmp_path / "b" / f"run{i}")
        for i, v in enumerate(variants)
    ]
    packed = run_pack(together)
    assert len({r["paper_mdl"] for r in alone}) == len(variants)  # all differ, so a mix-up would show
    for one, other in zip(alone, packed):
        for key in (*NUMBERS, "data_diagnostics"):
            assert other[key] == one[key], key


@pytest.mark.slow
def test_a_sweeps_packs_hold_at_most_pack_data_gb_as_declared_and_a_relaunch_makes_the_same(tmp_path: Path) -> None:
    """Runs with their own data (eraser, data seed) beyond ``mdl.pack_data_gb`` of what their source declares make
    more packs, decided from the configs when the sweep is launched: the sweep relaunched (in another order, or on
    another device) makes the same packs, so a killed pack's folder is found again."""
    from datamodules.sources import declared_bytes
    from mdl.run.pack import plan_packs

    variants = [["eraser=none"], ["eraser=none", "seed=1"], ["data_seed=1"], ["eraser=qleace"], ["width=48"]]
    digits_gb = declared_bytes("digits", {}) / 1e9  # 1797 float32 8x8 images and their labels

    def packs(order: list[int], budget: float) -> list[list[int]]:
        cfgs = [compose_config([*BASE, *variants[i], f"mdl.pack_data_gb={budget}"], tmp_path) for i in order]
        return sorted(sorted(order[i] for i in pack) for pack in plan_packs(cfgs))

    assert packs([0, 1, 2, 3, 4], 40) == [[0, 1, 2, 3], [4]]  # another width: another pack key
    one_each = packs([0, 1, 2, 3, 4], 1.5 * digits_gb)
    assert one_each == [[0, 1], [2], [3], [4]]  # the two seeds of eraser=none share their data
    assert packs([4, 3, 2, 1, 0], 1.5 * digits_gb) == one_each  # relaunched in another order
    two_each = packs([0, 1, 2, 3, 4], 2.5 * digits_gb)
    assert sorted(map(len, two_each)) == [1, 1, 3] or sorted(map(len, two_each)) == [1, 2, 2]
    assert packs([2, 4, 0, 3, 1], 2.5 * digits_gb) == two_each
    assert pack_key(compose_config([*BASE, "mdl.pack_data_gb=1e-9"], tmp_path)) == pack_key(
        compose_config(BASE, tmp_path)
    )  # bookkeeping


@pytest.mark.slow
@pytest.mark.parametrize(
    "model", ["lenet", pytest.param("convnext", marks=pytest.mark.slow), pytest.param("swin", marks=pytest.mark.slow)]
)
def test_conv_nets_packed_keep_their_numbers_to_the_bit(tmp_path: Path, model: str) -> None:
    """Grouped convolutions (LeNet's and ConvNeXt's own stacked forms, Swin's under vmap) give a member other last
    bits in a stack of another size; a pack runs each run's members as a stack of their own (StackedModel.run's
    chunks), so every run keeps its numbers alone. Before: LeNet's paper MDL moved in the 6th digit."""
    base = [*BASE, f"model={model}", "mdl.members_per_fit=all"]
    variants = [["seed=0"], ["seed=1"], ["eraser=none"]]
    alone = [
        run_experiment(compose_config([*base, *v], tmp_path / "a"), tmp_path / "a" / f"run{i}")
        for i, v in enumerate(variants)
    ]
    packed = run_pack(
        [
            Job.checked(compose_config([*base, *v], tmp_path / "b"), tmp_path / "b" / f"run{i}")
            for i, v in enumerate(variants)
        ]
    )
    assert len({r["paper_mdl"] for r in alone}) == len(variants)
    for one, other in zip(alone, packed):
        for key in NUMBERS:
            assert other[key] == one[key], key


@pytest.mark.slow
def test_inductor_compiles_lenets_stacked_fit_alone_and_packed_with_the_same_numbers(
    tmp_path: Path, monkeypatch
) -> None:
    """trainer.compile=true (inductor) on LeNet's grouped form with one-channel images (digits) failed before: one
    compiled function saw the shared evaluation batch (B, C, H, W) and then a batch per member (M, B, C, H, W), so
    dynamo made every axis symbolic, and the one-channel fold was a view whose strides depend on the member count;
    inductor could not order them (ConvNeXt's too: tests/test_conv_stacked.py). Compiled, a pack of two runs gives
    each its compiled numbers alone, to the bit."""
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no shapes remembered from other runs
    base = [*BASE, "model=lenet", "mdl.num_blocks=3", "trainer.kwargs.max_epochs=3", "trainer.compile=true"]
    torch._dynamo.reset()
    alone = [
        run_experiment(compose_config([*base, f"seed={s}"], tmp_path / "a"), tmp_path / "a" / f"run{s}") for s in (0, 1)
    ]
    torch._dynamo.reset()
    packed = run_pack(
        [Job.checked(compose_config([*base, f"seed={s}"], tmp_path / "b"), tmp_path / "b" / f"run{s}") for s in (0, 1)]
    )
    assert alone[0]["paper_mdl"] != alone[1]["paper_mdl"]
    for one, other in zip(alone, packed):
        for key in NUMBERS:
            assert other[key] == one[key], key


def _sweep_results(root: Path) -> dict[tuple[str, str], float]:
    """(eraser, seed) -> paper MDL of every job of the sweeps under ``root``."""
    found = {}
    for path in root.glob("multirun/*/*/*/results.json"):
        r = json.loads(path.read_text())
        found[(r["config"]["eraser"]["name"], str(r["config"]["seed"]))] = r["paper_mdl"]
    return found


@pytest.mark.slow  # two sweeps through launch.py
def test_the_packed_launcher_runs_a_sweep_with_the_basic_launchers_numbers(tmp_path: Path) -> None:
    """`python launch.py -m ... hydra/launcher=packed`: 2 erasers x 2 seeds as one fit, every job its results.json
    with the numbers Hydra's basic launcher gives it, and the sweep's report."""
    from conftest import run_launch

    sweep = ["-m", "seed=0,1", "eraser=none,leace", "debug=fast", "trainer.torch_threads=1"]
    basic = run_launch([*sweep, f"paths.output_root={tmp_path / 'basic'}"], cwd=tmp_path)
    packed = run_launch([*sweep, "hydra/launcher=packed", f"paths.output_root={tmp_path / 'packed'}"], cwd=tmp_path)
    assert basic.returncode == 0, basic.stderr[-2000:]
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert "4 jobs in 1 pack" in packed.stdout + packed.stderr
    expected = _sweep_results(tmp_path / "basic")
    assert len(expected) == 4 and _sweep_results(tmp_path / "packed") == expected
    assert list((tmp_path / "packed").glob("multirun/*/*/report/report.md"))


@pytest.mark.slow  # a reference pack, a killed one and its re-run, twice
@pytest.mark.parametrize("members_per_fit, kill_at", [("all", 2), (2, 10)])
def test_a_killed_pack_resumes_every_run_in_it_exactly(tmp_path: Path, monkeypatch, members_per_fit, kill_at) -> None:
    """Killed after a checkpoint (the 2nd of its one fit; the 10th: in the 2nd of its fits, each run's 2nd fit of 2), the same
    pack launched again, its jobs listed in another order, skips what was finished, resumes from the pack's
    checkpoint and gives every run the numbers of an uninterrupted pack (its members in the checkpoint's order)."""
    from mdl.engine.trainer import SaveLastCheckpoint

    class Killed(Exception):
        pass

    settings = [
        "mdl.checkpoint_every_s=0",
        "mdl.min_steps_per_pass=1",
        "trainer.kwargs.max_epochs=8",
        "trainer.patience=3",
        f"mdl.members_per_fit={members_per_fit}",
    ]
    reference = run_pack(jobs(tmp_path / "ref", extra=settings))
    original, saves = SaveLastCheckpoint.on_train_epoch_end, [0]

    def save_then_die(self, trainer, module) -> None:
        original(self, trainer, module)
        saves[0] += 1
        if saves[0] == kill_at:
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(SaveLastCheckpoint, "on_train_epoch_end", save_then_die)
        with pytest.raises(Killed):
            run_pack(jobs(tmp_path / "run", extra=settings))
    left = [p.name for p in (pack_folder(jobs(tmp_path / "run", extra=settings)) / "checkpoints").iterdir()]
    assert left == ["stacked.ckpt"] if members_per_fit == "all" else len(left) == 1 and left[0].startswith("fit-")
    resumed = run_pack(jobs(tmp_path / "run", extra=settings)[::-1])[::-1]  # the sweep relaunched in another order
    for one, other in zip(reference, resumed):
        for key in NUMBERS:
            assert other[key] == one[key], key


@pytest.mark.slow
def test_the_cost_estimate_counts_the_packs_of_a_packed_sweep(capsys) -> None:
    from mdl.sweeps.cost import main

    main(["-m", "eraser=none,leace", "seed=0,1,2", "data_seed=0,1", "hydra/launcher=packed"])
    assert "12 jobs in 1 pack " in capsys.readouterr().out  # seeds, erasers and data seeds share a fit
    main(["-m", "eraser=none,leace", "seed=0,1", "width=32,64", "hydra/launcher=packed"])
    assert "8 jobs in 2 packs" in capsys.readouterr().out  # widths do not
    main(["-m", "data.balance=suby", "data_seed=0,1", "seed=0,1", "hydra/launcher=packed"])
    assert "4 jobs in 2 packs" in capsys.readouterr().out  # suby: the split's size follows the data seed (pack_key)
    main(["-m", "seed=0,1,2", "model=convnext", "hydra/launcher=packed"])
    assert "3 jobs in 3 packs" in capsys.readouterr().out  # one member per fit (ConvNeXt's default): not packed
    main(["-m", "seed=0,1,2", "model=convnext", "mdl.members_per_fit=auto", "hydra/launcher=packed"])
    assert "3 jobs in 1 pack " in capsys.readouterr().out  # stacked in fits of what the GPU holds: packed
    main(["-m", "seed=0,1,2"])
    assert "jobs in" not in capsys.readouterr().out.replace(str(REPO), "<repo>")  # no packs line


def test_runs_that_cannot_share_a_stack_are_refused_by_the_driver() -> None:
    """The pack key keeps such runs apart; if runs of other shapes, classes or blocks still reach one driver call,
    it names what differs instead of stacking them."""
    from types import SimpleNamespace

    from mdl.engine.driver import check_trainable_together

    def run(shape=(1, 8, 8), classes=10, boundaries=(16, 32, 64)):
        return SimpleNamespace(data=SimpleNamespace(input_shape=shape, num_classes=classes), boundaries=boundaries)

    check_trainable_together([run(), run()])
    for other in (run(shape=(3, 8, 8)), run(classes=9), run(boundaries=(16, 30, 60))):
        with pytest.raises(ValueError, match="differ in input shape, classes or block schedule.*pack_key"):
            check_trainable_together([run(), other])
