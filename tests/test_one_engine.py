"""One engine (mdl/engine/): members trained in fits of ``mdl.members_per_fit``, with the numbers of the
two engines it replaced.

tests/reference/default_runs.json holds results.json values of the embedded default with one thread, one record
per environment they were made in (scripts/make_reference.py): ``stacked`` (``members_per_fit=all``) and
``sequential`` (``members_per_fit=1``). The first record is commit cbb5538's (main before the engines were merged).
"""

from __future__ import annotations

import os

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mdl.engine.protocol import fits_of
from mdl.run.environment import environment_differences
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash, identity_hash
from mdl.run.identity import grouping, members_per_fit
from conftest import FAST, REPO, compose_config, run_launch
from mdl.run.config_checks import check_before_imports
from mdl.sweeps.cost import main as cost_main

sys.path.insert(0, str(REPO / "scripts"))
from make_reference import MODES, REFERENCE, matching_record, overrides  # noqa: E402

STORED = json.loads(REFERENCE.read_text())
# Across environments (torch builds, CPU kernels) the default's paper MDL moved by 0.025 bits/example (torch 2.15.0
# -> 2.14.1, the same 2-core image); a tenth of a bit is far below what any eraser or model changes (our choice).
ACROSS_ENVIRONMENTS_BITS = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(MODES))
def test_each_mode_gives_the_stored_numbers_of_its_former_engine(tmp_path: Path, engine: str) -> None:
    """Bit for bit where a record of this environment exists; elsewhere what holds in every environment: the same
    run (config hash) and paper MDL within ACROSS_ENVIRONMENTS_BITS of every record, said as a warning."""
    cfg = compose_config(overrides(engine), tmp_path)
    results = run_experiment(cfg, tmp_path / "run")
    assert results["fits"] == engine
    container = OmegaConf.to_container(cfg, resolve=True)
    for record in STORED["records"]:  # the identity of the stored run (its hash as scripts/rehash_store.py gives it)
        on_gpu = record["environment"].get("gpu") is not None  # a CPU run's identity holds its thread count
        expected = identity_hash(container, None if on_gpu else record["environment"]["threads"])
        assert expected == record["runs"][engine]["config_hash"], record["made_by"]
    record = matching_record(STORED, results["environment"])
    if record is not None:
        for key in STORED["keys"]:
            assert results[key] == record["runs"][engine][key], key
        return
    nearest = min(
        STORED["records"], key=lambda r: len(environment_differences(r["environment"], results["environment"]))
    )
    warnings.warn(
        f"no stored numbers of this environment ({'; '.join(environment_differences(nearest['environment'], results['environment']))}"
        f" against the nearest record): checked within {ACROSS_ENVIRONMENTS_BITS} bits, not to the bit; "
        "python scripts/make_reference.py stores this environment's"
    )
    for record in STORED["records"]:
        assert abs(results["paper_mdl"] - record["runs"][engine]["paper_mdl"]) < ACROSS_ENVIRONMENTS_BITS
        assert math.isclose(
            results["online_codelength_bits"], record["runs"][engine]["online_codelength_bits"], rel_tol=0.01
        )


def test_every_stored_record_names_its_environment_and_one_is_the_readmes() -> None:
    for record in STORED["records"]:
        assert set(record["runs"]) == set(MODES) and record["environment"]["torch"], record["made_by"]
    assert sum(bool(r.get("readme")) for r in STORED["records"]) == 1


@pytest.mark.slow
def test_members_per_fit_is_the_one_key_with_its_default_in_each_model_file(tmp_path: Path) -> None:
    """Each conf/model file sets the grouping (the faster one) and trainer.threads_by_members_per_fit the threads that
    go with it: one thread for one member per fit, otherwise null (the CPUs Slurm allocated)."""
    defaults = {"mlp": "all", "lenet": "all", "convnext": 1, "swin": 1}
    for model, k in defaults.items():
        cfg = compose_config([f"model={model}"])
        assert cfg.mdl.members_per_fit == k and "engine" not in cfg.mdl, model
        assert cfg.trainer.torch_threads == (1 if k == 1 else None), model
    for k, threads in (("1", 1), ("all", None), ("auto", None), ("3", None)):
        assert compose_config([f"mdl.members_per_fit={k}"]).trainer.torch_threads == threads, k

    def key(*overrides: str) -> str:
        return config_hash(compose_config(["trainer.torch_threads=1", *overrides], tmp_path))

    assert key() == key("mdl.members_per_fit=all") == key("model=mlp")
    assert len({key(f"mdl.members_per_fit={k}") for k in ("1", "3", "4", "all", "auto")}) == 5


def test_the_retired_engine_keys_are_refused_naming_the_replacement(tmp_path: Path, capsys) -> None:
    for args in (["mdl.engine=stacked"], ["-m", "mdl.engine=sequential,stacked"], ["+mdl.default_engine.mlp=stacked"]):
        done = run_launch([*args, f"paths.output_root={tmp_path}"], tmp_path)
        assert done.returncode == 2 and "mdl.members_per_fit=all" in done.stderr, done.stderr
        assert not (tmp_path / "store").exists()
    with pytest.raises(SystemExit):
        cost_main(["-m", "mdl.engine=stacked,sequential"])
    assert "use mdl.members_per_fit=all (was mdl.engine=stacked)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"mdl.engine is gone.*mdl.members_per_fit=1 \(was mdl.engine=sequential\)"):
        check_before_imports(compose_config(["+mdl.engine=sequential"]))


def test_members_per_fit_is_read_and_checked() -> None:
    assert members_per_fit({"members_per_fit": "all"}) is None
    assert members_per_fit({"members_per_fit": 1}) == 1
    assert members_per_fit({"members_per_fit": "auto"}) == "auto"
    assert grouping({"members_per_fit": 3, "num_blocks": 10}) == "fits of 3"
    assert grouping({"members_per_fit": 10, "num_blocks": 10}) == "stacked"
    assert grouping({"members_per_fit": 1, "num_blocks": 10}) == "sequential"
    for bad in (0, -2, "some", 1.5, True):
        with pytest.raises(ValueError, match="mdl.members_per_fit=.*all, auto, or an integer >= 1"):
            members_per_fit({"members_per_fit": bad})
    with pytest.raises(ValueError, match="mdl.members_per_fit is not set: each conf/model/<name>.yaml sets"):
        members_per_fit({"members_per_fit": None})


def test_fits_cover_every_member_once_in_order() -> None:
    assert fits_of(10, None) == [list(range(10))]
    assert fits_of(10, 1) == [[i] for i in range(10)]
    assert fits_of(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert fits_of(3, 7) == [[0, 1, 2]]


def test_the_stopping_rule_is_lightnings_early_stopping_and_max_epochs() -> None:
    """``MemberState.should_stop``, which every fit applies: an improving epoch never stops a member, even with
    patience 0 (as EarlyStopping); a non-improving one stops it once patience epochs passed without improving;
    max_epochs stops it whatever the loss did."""
    from mdl.engine.protocol import MemberState

    state = MemberState(member=0, n_train=10)
    state.epoch = 1
    assert not state.should_stop(state.judge(1.0, 0), patience=0, max_epochs=None)  # improved: goes on at patience 0
    state.epoch = 2
    assert state.should_stop(state.judge(1.0, 1), patience=0, max_epochs=None)  # the same loss is no improvement
    state = MemberState(member=0, n_train=10)
    for epoch, loss in enumerate([3.0, 4.0, 2.0, 5.0, 6.0]):
        state.epoch = epoch + 1
        stop = state.should_stop(state.judge(loss, epoch), patience=2, max_epochs=None)
        assert stop == (epoch == 4), epoch  # the wait restarts at the improvement to 2.0
    state.epoch = 3
    assert state.should_stop(state.judge(0.5, 5), patience=2, max_epochs=3)  # improved, but at max_epochs


@pytest.mark.slow
def test_fits_of_a_few_members_give_the_numbers_of_one_fit_of_all(tmp_path: Path) -> None:
    """The MLP's stacked form is a batched matmul per member, so a member's numbers do not depend on which
    other members share its fit: two fits of 4 members equal one fit of all 8, block by block."""
    fast = [
        "mdl.num_blocks=8",
        "data.first_block=64",
        "trainer.kwargs.max_epochs=8",
        "trainer.patience=3",
        "width=32",
        "model.base_width=32",
        "trainer.torch_threads=1",
    ]
    together = run_experiment(
        compose_config([*fast, "mdl.members_per_fit=all"], tmp_path / "a"), tmp_path / "a" / "run"
    )
    in_fits = run_experiment(compose_config([*fast, "mdl.members_per_fit=4"], tmp_path / "b"), tmp_path / "b" / "run")
    assert in_fits["fits"] == "fits of 4" and in_fits["members_per_fit"] == 4
    for key in ("blocks", "paper_mdl", "online_codelength_bits", "val_loss_curve", "final_val_loss"):
        assert in_fits[key] == together[key], key


# --- mdl.members_per_fit=auto ----------------------------------------------------------------------


def test_auto_on_a_cpu_puts_every_member_in_one_fit() -> None:
    import torch

    from mdl.engine.memory import members_that_fit

    assert members_that_fit(torch.device("cpu"), 10, lambda m: 1 // 0) is None  # nothing to measure: all in one


def test_auto_count_comes_from_the_measured_memory_of_one_and_two_members(monkeypatch) -> None:
    """Known answer: a step of 1 member peaks at 300 bytes, of 2 at 400: 100 per member, 200 fixed; with 1000
    free and a margin of 0.8, (800 - 200) / 100 = 6 members fit."""
    import torch

    from mdl.engine import memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    assert memory.MEMORY_MARGIN == 0.8
    assert memory.members_that_fit(torch.device("cuda"), 10, {1: 300, 2: 400}.get) == 6
    assert memory.members_that_fit(torch.device("cuda"), 5, {1: 300, 2: 400}.get) is None  # all 5 fit: one fit
    assert memory.members_that_fit(torch.device("cuda"), 10, {1: 900, 2: 1800}.get) == 1  # not even two


FEW = [
    "mdl.num_blocks=8",
    "data.first_block=64",
    "trainer.kwargs.max_epochs=8",
    "trainer.patience=3",
    "width=32",
    "model.base_width=32",
    "trainer.torch_threads=1",
]


def _small_device(monkeypatch, most: int) -> list[int]:
    """Stacked fits of more than ``most`` members run out of memory (as a GPU would); returns the sizes tried."""
    import torch

    import mdl.engine.driver as driver

    real, sizes = driver.run_stacked_fit, []

    def fit(ledgers, members, *args, **kwargs):
        sizes.append(len(members))
        if len(members) > most:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(ledgers, members, *args, **kwargs)

    monkeypatch.setattr(driver, "run_stacked_fit", fit)
    return sizes


@pytest.mark.slow
def test_auto_halves_a_fit_that_runs_out_of_memory_and_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    """members_per_fit=auto: a fit of 8 that runs out of memory goes on as fits of 4, then 2, with a warning,
    and gives the numbers of one fit of all (the MLP's members do not depend on their neighbours)."""
    import logging

    together = run_experiment(compose_config([*FEW, "mdl.members_per_fit=all"], tmp_path / "a"), tmp_path / "a" / "run")
    sizes = _small_device(monkeypatch, most=2)
    with caplog.at_level(logging.WARNING):
        halved = run_experiment(
            compose_config([*FEW, "mdl.members_per_fit=auto"], tmp_path / "b"), tmp_path / "b" / "run"
        )
    assert sizes == [8, 4, 2, 2, 4, 2, 2]
    assert "out of memory with 8 members in one fit: going on with fits of 4" in caplog.text
    assert halved["fits"] == "fits by memory" and halved["members_per_fit"] == "auto"
    for key in ("blocks", "paper_mdl", "online_codelength_bits", "val_loss_curve", "final_val_loss"):
        assert halved[key] == together[key], key


def test_a_chosen_count_that_runs_out_of_memory_says_what_to_set(tmp_path: Path, monkeypatch) -> None:
    _small_device(monkeypatch, most=2)
    with pytest.raises(
        RuntimeError,
        match=r"out of memory training 4 members in one fit .*mdl.members_per_fit \(e.g. 2\)"
        r".*mdl.members_per_fit=auto",
    ):
        run_experiment(compose_config([*FEW, "mdl.members_per_fit=4"], tmp_path), tmp_path / "run")


# --- trainer.compile in a fit of several members ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_blocks", "model"),
    [(5, []), (9, []), pytest.param(5, ["model=convnext", "width=8"], marks=pytest.mark.slow)],  # ConvNeXt: 80 s
)
def test_a_stacked_fit_compiles_a_few_graphs_however_many_members_leave(
    tmp_path: Path, num_blocks: int, model: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.compile in a fit of all members: the member axis is symbolic, so a whole run compiles the same
    few graphs (training and evaluation, each for a stack of several members and of one; ConvNeXt: that per stage,
    its blocks being what compiles) for 5 members or 9, instead of one per stack size; the numbers are those of the
    uncompiled fit (the eager backend runs the same kernels). Inductor's caches go to paths.compile_cache_dir."""
    from torch._dynamo.utils import counters

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    base = [
        *FAST,
        *model,
        f"mdl.num_blocks={num_blocks}",
        "trainer.kwargs.max_epochs=6",
        "trainer.patience=2",
        "mdl.members_per_fit=all",
        "trainer.torch_threads=1",
    ]
    plain = run_experiment(compose_config(base, tmp_path / "a"), tmp_path / "a" / "run")
    counters.clear()
    cfg = compose_config([*base, "trainer.compile=eager", f"paths.cache_dir={tmp_path / 'cache'}"], tmp_path / "b")
    compiled = run_experiment(cfg, tmp_path / "b" / "run")
    assert counters["stats"]["unique_graphs"] <= (16 if model else 4)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "compiled")
    for key in ("blocks", "paper_mdl", "val_loss_curve", "final_val_loss"):
        assert compiled[key] == plain[key], key


@pytest.mark.parametrize("model", [[], pytest.param(["model=convnext", "width=8"], marks=pytest.mark.slow)])
def test_bf16_applies_to_a_fit_of_several_members(tmp_path: Path, model: list[str]) -> None:
    """trainer.precision=bf16 in a fit of all members (the stacked form under bf16 autocast, the MLP's batched
    matmuls and ConvNeXt's grouped convolutions alike): the numbers move by bf16's rounding, and not far."""
    import math

    base = [
        *FAST,
        *model,
        "mdl.num_blocks=3",
        "trainer.kwargs.max_epochs=4",
        "mdl.members_per_fit=all",
        "trainer.torch_threads=1",
    ]
    fp32 = run_experiment(compose_config(base, tmp_path / "a"), tmp_path / "a" / "run")
    bf16 = run_experiment(compose_config([*base, "trainer.precision=bf16"], tmp_path / "b"), tmp_path / "b" / "run")
    assert math.isfinite(bf16["paper_mdl"]) and bf16["members_per_fit"] == "all"
    assert bf16["paper_mdl"] != fp32["paper_mdl"]
    assert abs(bf16["paper_mdl"] - fp32["paper_mdl"]) < 0.05 * fp32["paper_mdl"]


@pytest.mark.parametrize("document", ["README.md", "docs/mdl.md"])
def test_the_printed_example_is_the_lock_environments_default_run(document: str) -> None:
    """The example a new user compares against is the stored default run of the locked install; the stacked test
    above makes that run again bit for bit wherever the environment matches the lock's (CI's machine image)."""
    (readme_record,) = [r for r in STORED["records"] if r.get("readme")]
    text = (REPO / document).read_text()
    for line in readme_record["runs"]["stacked"]["printed"]:
        assert f"    {line}\n" in text, f"{document} does not print {line!r}: python scripts/make_reference.py --readme"
    env = readme_record["environment"]
    assert f"torch {env['torch']}" in (REPO / "README.md").read_text()


def test_the_lock_pins_the_torch_the_printed_example_was_made_with() -> None:
    (readme_record,) = [r for r in STORED["records"] if r.get("readme")]
    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert readme_record["environment"]["torch"].split("+")[0] == pins["torch"]
    assert readme_record["environment"]["numpy"] == pins["numpy"]
