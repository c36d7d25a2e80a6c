"""One definition of the settings that do not change what a run computes (mdl/run/identity.py), used by the
run's identity, the report, W&B names and (checked here) Hydra's job folder names."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

import pytest

from conftest import CONF, FAST, compose_config
from mdl.run.identity import config_hash
from mdl.run.identity import BOOKKEEPING_KEYS, is_bookkeeping, without_bookkeeping
from mdl.report.sweep import is_ignored_key

GROUP_CHOICES = {"hydra/launcher", "logger", "experiment", "+experiment", "report", "+report"}  # same for a whole sweep


def exclude_keys() -> list[str]:
    return list(OmegaConf.load(CONF / "config.yaml").hydra.job.config.override_dirname.exclude_keys)


def test_job_folder_names_leave_out_exactly_the_bookkeeping_settings() -> None:
    excluded = exclude_keys()
    for key in excluded:
        assert key in GROUP_CHOICES or is_bookkeeping(key), (
            f"{key}: excluded from folder names but part of a run's identity"
        )
    cfg = OmegaConf.to_container(compose_config(FAST), resolve=False)
    for dotted in BOOKKEEPING_KEYS:
        node = OmegaConf.select(OmegaConf.create(cfg), dotted)
        if node is None or OmegaConf.is_config(node) or dotted in ("hydra", "logger", "paths"):
            continue  # a group (its choice is excluded) or a subtree: its leaves are listed one by one
        assert dotted in excluded, f"{dotted}: does not change results but would name job folders"
    for leaf in OmegaConf.load(CONF / "paths" / "default.yaml"):
        assert f"paths.{leaf}" in excluded


@pytest.mark.slow
def test_bookkeeping_settings_leave_identity_and_report_cells_alone() -> None:
    base = config_hash(compose_config(FAST))
    for override in (
        "mdl.checkpoint_every_s=5",
        "mdl.steps_per_group=4",
        "mdl.lock_lease_s=60",
        "trainer.profiler=simple",
        "print_config=false",
        "skip_if_done=false",
        "paths.output_root=/elsewhere",
        "logger=wandb",
    ):
        assert config_hash(compose_config([*FAST, override])) == base, override
        key = override.split("=")[0]
        assert is_ignored_key(key, '"x"'), key
    for override in (
        "width=64",
        "eraser=qleace",
        "mdl.members_per_fit=1",
        "trainer.patience=3",
        "data.options.n_test=5",
    ):
        assert not is_bookkeeping(override.split("=")[0]), override


@pytest.mark.slow
def test_the_data_sets_default_lrs_are_where_optimizer_lr_comes_from_not_part_of_a_run() -> None:
    """The defaults table (optimizer.lr_by_data) is looked up once: optimizer.lr is what a run trains with, so the
    table's entry for another data set leaves a run alone, and every data set composes the lr its reference holds
    (tests/reference/hashes_before_lr_moved.json: the lrs of commit 3a3c467, when conf/data held them)."""
    import json

    stored = json.loads((Path(__file__).parent / "reference" / "hashes_before_lr_moved.json").read_text())["runs"]
    for overrides, before in stored.items():
        cfg = compose_config(overrides.split())
        assert cfg.optimizer.lr == before["lr"] and "lr" not in cfg.data, overrides
    base = config_hash(compose_config(FAST))
    assert config_hash(compose_config([*FAST, "optimizer.lr_by_data.svhn=1e-2"])) == base
    assert config_hash(compose_config([*FAST, "optimizer.lr_by_data.digits=1e-2"])) != base  # optimizer.lr moved


def test_the_hash_is_the_resolved_config_minus_bookkeeping_plus_cpu_threads_and_nothing_else() -> None:
    """No key is dropped or rewritten on the way (a run's identity is what it ran): defaults that are off (probes,
    callbacks, the sound protocol, null options) count as they are; only mdl.members_per_fit is counted as trained
    (the next test)."""
    import hashlib
    import json

    for overrides in ([], ["model=swin", "eraser=qleace"], ["protocol=original", "model=convnext"]):
        cfg = compose_config([*FAST, "device=cpu", "trainer.torch_threads=1", *overrides])
        plain = without_bookkeeping(OmegaConf.to_container(cfg, resolve=True)) | {"cpu_threads": 1}
        assert {"probes", "callbacks", "protocol"} <= set(plain) and plain["data"]["balance"] is None
        blob = json.dumps(plain, sort_keys=True, default=str).encode()
        assert config_hash(cfg) == hashlib.sha256(blob).hexdigest()[:16], overrides


def test_the_cache_key_leaves_out_exactly_the_source_options_a_run_s_identity_leaves_out(tmp_path, monkeypatch) -> None:
    """One definition: the erasure cache key ignores the data.options keys that BOOKKEEPING_KEYS names (where and
    how the data is fetched), and keeps the others, as the run's config hash does."""
    from mdl.run import components

    monkeypatch.setattr(components.ErasedDataModule, "setup", lambda self, stage=None: None)  # keys only: no data

    def keys(*overrides: str) -> tuple[str, str]:
        cfg = compose_config(["data=cifarnet", "device=cpu", *overrides], tmp_path)
        dm = components.make_datamodule(cfg)
        return dm.options.eraser_key(), config_hash(cfg)

    base = keys("data.options.root=/a", "data.options.download=false")
    assert keys("data.options.root=/b", "data.options.download=true") == base  # fetched elsewhere: same data, same run
    moved = keys("data.options.root=/a", "data.options.download=false", "data.options.decode_batch_size=64")
    assert moved[0] != base[0] and moved[1] != base[1]  # an option the identity keeps, the cache key keeps too


def test_groupings_that_train_alike_are_one_identity() -> None:
    """k >= the run's members is one fit of all of them; a protocol that backtracks trains one member per fit
    whatever is asked: a finished run of the one is the other's (not computed again). Groupings that train
    differently keep their own hash."""

    def key(*overrides: str) -> str:
        return config_hash(compose_config([*FAST, "device=cpu", "trainer.torch_threads=1", *overrides]))

    assert key("mdl.members_per_fit=1000") == key("mdl.members_per_fit=3") == key("mdl.members_per_fit=all")
    assert key("mdl.members_per_fit=2") != key("mdl.members_per_fit=all") != key("mdl.members_per_fit=1")
    for asked in ("all", "2", "auto"):
        assert key("protocol=original", f"mdl.members_per_fit={asked}") == key(
            "protocol=original", "mdl.members_per_fit=1"
        )
