"""``python scripts/rehash_store.py <store>``: a store written by older code, moved so that relaunches find its runs done.

tests/reference/store_2797eff is a store that commit 2797eff wrote (``python launch.py debug=fast device=cpu
paths.output_root=/tmp/oldstore`` with the overrides in ``OLD_RUNS``; the seed=1 entry kept only its config.json, as a
run killed before its first block), with the run folder of its default run. That code named runs by hashes with
mdl.engine in them; a relaunch today computes other hashes, and finds the runs only after the migration.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import FAST, REPO, compose_config
from mdl.results import RESULTS_FILE, RUN_CONFIG_FILE, read_checked_json
from mdl.run import identity
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash, identity_hash
from mdl.runs import list_runs

sys.path.insert(0, str(REPO / "scripts"))
import rehash_store  # noqa: E402
from rehash_store import current_form, main  # noqa: E402

FIXTURE = Path(__file__).parent / "reference" / "store_2797eff"
WRITTEN_AT = "/tmp/oldstore"  # the output root the fixture was written under (its records name it)
# old store folder -> the same run's overrides today (then: "", mdl.engine=sequential, mdl.members_per_fit=2, seed=1)
OLD_RUNS = {
    "093bf4759004a35d": [],
    "b4d02962018d552a": ["mdl.members_per_fit=1"],
    "b4523971d6a0d167": ["mdl.members_per_fit=2"],
    "d5dab5d1a3a4890b": ["seed=1"],
}
COMMON = [*FAST, "device=cpu"]
FORMER_FITS = {"093bf4759004a35d": "stacked", "b4d02962018d552a": "sequential", "b4523971d6a0d167": "fits of 2"}


@pytest.fixture
def old_store(tmp_path: Path, monkeypatch) -> Path:
    """The fixture copied to ``tmp_path``, its recorded run folders pointing at the copy; its runs trained on one
    thread (trainer.torch_threads=null outside Slurm), as this test's runs are told."""
    root = tmp_path / "outputs"
    shutil.copytree(FIXTURE, root)
    for record in root.glob(f"store/*/{RUN_CONFIG_FILE}"):
        record.write_text(record.read_text().replace(WRITTEN_AT, str(root)))
    monkeypatch.setattr(identity, "DEFAULT_THREADS", 1)
    return root


def relaunch(root: Path, overrides: list[str], run_dir: Path) -> dict:
    """The same config as the old run, in another environment if need be (the numbers' bits are not tested here)."""
    cfg = compose_config([*COMMON, *overrides, "mdl.reuse_across_environments=true"], root)
    return run_experiment(cfg, run_dir)


@pytest.mark.slow
def test_a_migrated_store_has_every_run_under_today_s_hash_and_relaunches_skip(old_store: Path, capsys) -> None:
    store = old_store / "store"
    new = {old: config_hash(compose_config([*COMMON, *overrides], old_store)) for old, overrides in OLD_RUNS.items()}
    assert not set(new.values()) & {p.name for p in store.iterdir()}  # before: no relaunch finds them

    assert main([str(old_store / "store"), "--dry-run"]) == 0
    assert {p.name for p in store.iterdir()} == set(OLD_RUNS)  # a dry run moves nothing
    assert "4 would move, 0 in place, 0 left" in capsys.readouterr().out

    assert main([str(old_store / "store")]) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in store.iterdir()} == set(new.values())
    for old, key in new.items():
        assert f"moved {old} -> {key}" in printed
        for record in (store / key).glob("*.json"):
            assert json.loads(record.read_text())["config_hash"] == key
            assert "engine" not in json.loads(record.read_text())["config"]["mdl"]
        if (store / key / RESULTS_FILE).exists():  # its grouping under today's name
            finished = read_checked_json(store / key / RESULTS_FILE)
            assert "engine" not in finished and finished["fits"] == FORMER_FITS[old]
    (run_folder,) = old_store.glob(f"runs/*/*/{RESULTS_FILE}")
    assert read_checked_json(run_folder)["config_hash"] == new["093bf4759004a35d"]  # its run folder's reference too

    assert main([str(old_store / "store")]) == 0  # idempotent
    assert "0 moved, 4 in place, 0 left" in capsys.readouterr().out

    for old, overrides in OLD_RUNS.items():
        stored = store / new[old] / RESULTS_FILE
        if not stored.exists():
            continue  # the run killed before its first block: listed, trained by its next launch
        results = relaunch(old_store, overrides, old_store / "again" / old)
        assert results["skipped"] and results["paper_mdl"] == read_checked_json(stored)["paper_mdl"], overrides
    listed = {r.values["hash"]: r.status for r in list_runs(store)}
    assert listed == {key: ("interrupted" if old == "d5dab5d1a3a4890b" else "finished") for old, key in new.items()}


def test_a_run_whose_folder_is_taken_is_left_and_said(old_store: Path, capsys) -> None:
    store = old_store / "store"
    taken = config_hash(compose_config(COMMON, old_store))
    (store / taken).mkdir()  # e.g. a relaunch made before the migration, killed at once
    (store / taken / "run.lock").touch()
    assert main([str(old_store / "store")]) == 1
    printed = capsys.readouterr().out
    assert f"left 093bf4759004a35d: it is run {taken}, whose folder already exists" in printed
    assert (store / "093bf4759004a35d" / RESULTS_FILE).exists() and "3 moved, 0 in place, 1 left" in printed


def test_older_forms_of_a_config_hash_as_today_s(tmp_path: Path) -> None:
    """Configs stored before the keys of today existed (the probes, callbacks and protocol groups, eraser.fit_scope,
    Swin's variant and heads, drop_path_rate, the null options, the lr in conf/data, mdl.engine) are written as
    today's conf composes the same run, so they hash as its relaunch does."""
    for overrides, engine in (
        (["model=swin", "eraser=leace", "eraser.fit_scope=split"], "sequential"),  # fitted on the split then
        (["model=convnext", "eraser=qleace", "eraser.fit_scope=split"], "sequential"),
        (["model=mlp", "eraser=none"], "stacked"),
    ):
        cfg = compose_config([*COMMON, "trainer.torch_threads=1", *overrides], tmp_path)
        today = json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True)))
        older = json.loads(json.dumps(today))
        for group in ("probes", "callbacks", "protocol"):
            del older[group]
        older["eraser"].pop("fit_scope", None)
        for key in ("drop_path_rate", "variant", "heads"):
            older["model"]["options"].pop(key, None)
        for group, key in (("data", "balance"), ("data", "transform"), ("optimizer", "precondition")):
            del older[group][key]
        older["data"]["lr"] = older["optimizer"].pop("lr_by_data")[older["data"]["source"]]
        del older["mdl"]["members_per_fit"]
        older["mdl"]["engine"] = engine
        assert current_form(older) != older
        assert identity_hash(current_form(older), 1) == config_hash(cfg), overrides
        assert current_form(current_form(older)) == current_form(older)


@pytest.mark.parametrize("damage", [{}, {"probes": {"enabled": False}, "seed": 0}, "seed"])
def test_a_damaged_store_record_is_left_and_its_run_folder_untouched(old_store: Path, capsys, damage) -> None:
    """The store entry of the default run keeps only its config.json, whose config is empty, a fragment, or names
    another seed than the run folder's intact results.json: the entry is left with a line saying why, and the run
    folder's checksummed record is not rewritten with the store's config."""
    store, old = old_store / "store", "093bf4759004a35d"
    (store / old / RESULTS_FILE).unlink()
    started = json.loads((store / old / RUN_CONFIG_FILE).read_text())
    if damage == "seed":
        started["config"]["seed"] = 7
    else:
        started["config"] = damage
    (store / old / RUN_CONFIG_FILE).write_text(json.dumps(started))
    (run_folder,) = old_store.glob(f"runs/*/*/{RESULTS_FILE}")
    before = run_folder.read_bytes()

    assert main([str(old_store / "store")]) == 1
    printed = capsys.readouterr().out
    why = "records disagree" if damage == "seed" else "config lacks"
    assert f"left {old}: " in printed and why in printed and "3 moved, 0 in place, 1 left" in printed
    assert run_folder.read_bytes() == before and (store / old / RUN_CONFIG_FILE).exists()


def test_a_read_only_store_is_one_clear_error(old_store: Path, capsys, monkeypatch) -> None:
    """Before: a 25-line PermissionError traceback from the first run's lock. As root (CI) every folder is writable,
    so the store's permission is what ``os.access`` answers for this user."""
    import os

    store = old_store / "store"
    store.chmod(0o555)
    real = os.access
    monkeypatch.setattr(rehash_store.os, "access", lambda p, mode: False if Path(p) == store else real(p, mode))
    try:
        assert main([str(old_store / "store")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: the run store {store} is read-only") and "Traceback" not in err
        assert main([str(old_store / "store"), "--dry-run"]) == 0  # reads only
    finally:
        store.chmod(0o755)


def test_a_lock_that_cannot_be_taken_leaves_the_run_with_a_line(old_store: Path, capsys, monkeypatch) -> None:
    from filelock import FileLock

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", self.lock_file)

    monkeypatch.setattr(FileLock, "acquire", denied)
    assert main([str(old_store / "store")]) == 1
    printed = capsys.readouterr().out
    assert "its lock cannot be taken (PermissionError" in printed and "0 moved, 0 in place, 4 left" in printed
