"""Once, on a store written by older code: every stored run moved to the folder its config hash names today.

    python scripts/rehash_store.py outputs/store [--dry-run]

A run's store folder is named by its config hash (mdl.run.identity), which decides skip-if-done and resume. When
the config's keys or the hash changed, the runs already stored would be trained again. This rewrites a store once,
so that a relaunch finds each run where it looks: the stored config is written as today's conf composes the same run
(``current_form``), its hash recomputed from that, its records and its run folder's results.json say so (and name
its grouping ``fits``, formerly ``engine``), and its
folder is renamed (one atomic rename per run, after its records are rewritten, so a rerun finishes a cut-short one).
Run it while nothing else writes to the store. One line per run moved or left; exit status 1 when a run that should
move was left, 2 when the store cannot be read or written.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from filelock import FileLock, Timeout
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mdl.results import (  # noqa: E402
    CHECKSUM_KEY,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    DamagedRecord,
    atomic_write_json,
    read_checked_json,
    read_json,
    write_checked_json,
)
from mdl.run.environment import ENVIRONMENT_KEY  # noqa: E402
from mdl.run.identity import identity_hash, without_bookkeeping  # noqa: E402
from mdl.run.storage import LOCK_FILE  # noqa: E402

CONF_DIR = REPO / "conf"
FORMER_GROUPINGS = {"stacked": "all", "sequential": 1}  # a stored mdl.engine -> its mdl.members_per_fit
FORMER_RESULT_KEY = "engine"  # results.json's name for its grouping (stacked, fits of k, ...) before ``fits``
POOLED_BY_DEFAULT = ("leace", "qleace", "alf_qleace")  # erasers stored without eraser.fit_scope fitted on the split
UNSET_IS_NULL = {"data": ("balance", "transform"), "optimizer": ("precondition",)}  # options stored runs may lack


# --- a stored config as today's conf composes the same run ---------------------------------------------------


def grouping_as_one_key(config: dict[str, Any]) -> None:
    """``mdl.engine`` (and its per-model defaults) said how members were grouped when ``members_per_fit`` was null."""
    mdl = config.get("mdl") or {}
    engine = mdl.pop("engine", None)
    mdl.pop("default_engine", None)
    (config.get("trainer") or {}).pop("threads_by_engine", None)
    if mdl.get("members_per_fit") is None and engine is not None:
        if engine not in FORMER_GROUPINGS:
            raise ValueError(f"mdl.engine={engine!r} names no grouping ({', '.join(FORMER_GROUPINGS)})")
        mdl["members_per_fit"] = FORMER_GROUPINGS[engine]


def pack_size_at_launch(config: dict[str, Any]) -> None:
    """``mdl.pack_data_fraction`` split a pack at train time; packs are sized at launch (``mdl.pack_data_gb``)."""
    (config.get("mdl") or {}).pop("pack_data_fraction", None)


def lr_in_optimizer(config: dict[str, Any]) -> None:
    """``data.lr`` held the data set's default lr; ``optimizer.lr`` holds the lr the run trained with."""
    (config.get("data") or {}).pop("lr", None)


def groups_present(config: dict[str, Any]) -> None:
    """Runs stored before the probes, callbacks and protocol groups existed ran what their defaults run."""
    for group, choice in (("probes", "none"), ("callbacks", "none"), ("protocol", "sound")):
        if group not in config:
            config[group] = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{choice}.yaml"))


def options_present(config: dict[str, Any]) -> None:
    """Options added since a run was stored, at the values that do what it did."""
    eraser = config.get("eraser") or {}
    if eraser.get("name") in POOLED_BY_DEFAULT:
        eraser.setdefault("fit_scope", "split")
    model = config.get("model") or {}
    options = model.get("options")
    if isinstance(options, dict) and model.get("name") in ("convnext", "swin"):
        options.setdefault("drop_path_rate", 0.0)
    if isinstance(options, dict) and model.get("name") == "swin":
        options.setdefault("variant", "timm")
        if options["variant"] == "timm":
            options.setdefault("heads", None)
    protocol = config.get("protocol")
    if isinstance(protocol, dict):  # both loops compared the float32 rounding before exact_stopping existed
        protocol.setdefault("exact_stopping", False)
        protocol.setdefault("batch_mean_validation", False)  # nor added up validation per batch in bits before it
        protocol.setdefault("final_fit", True)  # every run trained a final fit before protocol.final_fit existed
        protocol.setdefault("redraw_per_block", False)  # one order of the pool for every block before it existed
        protocol.setdefault("eraser_fit_dtype", "float64")
    options = eraser.get("options")
    if isinstance(options, dict) and eraser.get("name") in ("qleace", "alf_qleace"):
        options.setdefault("fit_dtype", "float64")  # fitted in float64 before the option existed
    for group, keys in UNSET_IS_NULL.items():
        node = config.get(group)
        for key in keys if isinstance(node, dict) else ():
            node.setdefault(key, None)


UPGRADES: tuple[Callable[[dict[str, Any]], None], ...] = (
    grouping_as_one_key,
    lr_in_optimizer,
    groups_present,
    options_present,
    pack_size_at_launch,
)


def current_form(config: dict[str, Any]) -> dict[str, Any]:
    """A stored run's resolved config as today's conf composes the same run (a copy; unchanged if it already is)."""
    config = copy.deepcopy(config)
    for upgrade in UPGRADES:
        upgrade(config)
    return config


# --- one store entry ----------------------------------------------------------------------------------------


class Unmovable(Exception):
    """A store entry the migration leaves where it is; the message says why."""


@dataclass
class Entry:
    """A store folder, its records (results.json when finished, config.json when started) and its hash today."""

    folder: Path
    results: dict[str, Any] | None
    started: dict[str, Any] | None
    config: dict[str, Any]
    key: str

    @classmethod
    def read(cls, folder: Path) -> Entry:
        """The entry of ``folder``; Unmovable when its records are missing, incomplete or disagree (the migration
        would write a damaged config over intact records)."""
        results = _read(folder / RESULTS_FILE, checked=True)
        started = _read(folder / RUN_CONFIG_FILE, checked=False)
        record = results or started
        if record is None or not isinstance(record.get("config"), dict):
            raise Unmovable("no readable run record (results.json or config.json)")
        try:
            config = current_form(record["config"])
        except (ValueError, TypeError, AttributeError) as err:
            raise Unmovable(f"its config cannot be read as today's ({err})") from None
        missing = sorted(run_keys() - set(config))
        if missing:
            raise Unmovable(
                f"its record's config lacks {', '.join(missing)} (cut short or edited by hand): restore it, or delete "
                "the folder to train the run again"
            )
        entry = cls(folder, results, started, config, identity_hash(config, cpu_threads(record)))
        entry.check_records_agree()
        return entry

    def check_records_agree(self) -> None:
        """Unmovable when the run's records name other configs (one edited or damaged): the migration would write
        one of them over the others."""
        run_results = self.run_folder_results()
        others = {
            RUN_CONFIG_FILE: self.started,
            RESULTS_FILE: self.results,
            str(run_results): read_checked_json(run_results) if run_results else None,
        }
        this_run = without_bookkeeping(copy.deepcopy(self.config))  # where a record was written may differ
        for name, record in others.items():
            config = (record or {}).get("config")
            if record is None:
                continue
            if not isinstance(config, dict) or without_bookkeeping(current_form(config)) != this_run:
                raise Unmovable(
                    f"its records disagree on the run's config ({name} names another): compare them, and delete the "
                    "wrong one (or the folder, to train the run again)"
                )

    @property
    def old(self) -> str:
        return self.folder.name

    def current(self) -> bool:
        """Whether the folder and every record already name today's hash and config."""
        records = [r for r in (self.results, self.started) if r is not None]
        return (
            self.old == self.key
            and all(r.get("config_hash") == self.key and r["config"] == self.config for r in records)
            and FORMER_RESULT_KEY not in (self.results or {})
        )

    def records(self) -> list[str]:
        """The records that name the run's hash: the store's, and the results.json of the run folder it recorded."""
        run_results = self.run_folder_results()
        return [
            *([RUN_CONFIG_FILE] if self.started is not None else []),
            *([RESULTS_FILE] if self.results is not None else []),
            *([str(run_results)] if run_results is not None else []),
        ]

    def rewrite_records(self) -> None:
        """Every record of ``records`` rewritten (atomically) with today's hash and config."""
        if self.started is not None:
            atomic_write_json(self.folder / RUN_CONFIG_FILE, {**self.started, **self.identity()})
        if self.results is not None:
            write_checked_json(self.folder / RESULTS_FILE, self.updated(self.results))
        run_results = self.run_folder_results()
        if run_results is not None:
            write_checked_json(run_results, self.updated(read_checked_json(run_results)))

    def identity(self) -> dict[str, Any]:
        return {"config": self.config, "config_hash": self.key}

    def updated(self, results: dict[str, Any]) -> dict[str, Any]:
        """A results record of this run naming today's hash, config and store folder."""
        updated = {k: v for k, v in results.items() if k != CHECKSUM_KEY} | self.identity()
        if FORMER_RESULT_KEY in updated:
            updated["fits"] = updated.pop(FORMER_RESULT_KEY)
        reused = updated.get("reused_from")
        if reused and Path(reused).parent.name == self.old:
            updated["reused_from"] = str(Path(reused).parent.parent / self.key / RESULTS_FILE)
        return updated

    def run_folder_results(self) -> Path | None:
        """The results.json of the run folder the store records (its last attempt), if it is this run's."""
        run_dir = (self.started or {}).get("run_dir")
        path = Path(run_dir) / RESULTS_FILE if run_dir else None
        if path is None or not path.is_file():
            return None
        try:
            recorded = read_checked_json(path).get("config_hash")
        except DamagedRecord:
            return None
        return path if recorded in (self.old, self.key) and path.parent != self.folder else None


@lru_cache(maxsize=1)
def run_keys() -> frozenset[str]:
    """The top-level keys of a run's identity today: those of the default config, less the bookkeeping ones."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config"), resolve=False)
    return frozenset(without_bookkeeping(composed))


def cpu_threads(record: dict[str, Any]) -> int | None:
    """The CPU threads a stored run trained with (None: it trained on a GPU), from its recorded environment."""
    environment = record.get(ENVIRONMENT_KEY)
    if not isinstance(environment, dict) or not isinstance(environment.get("threads"), int):
        raise Unmovable("no environment recorded (its thread count, part of a CPU run's hash, is unknown)")
    return None if environment.get("gpu") else environment["threads"]


def _read(path: Path, checked: bool) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        record = read_checked_json(path) if checked else read_json(path)
    except (DamagedRecord, OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# --- the store ----------------------------------------------------------------------------------------------


def rehash_store(store: Path, dry_run: bool = False) -> tuple[list[str], int]:
    """Move every run of ``store`` to its folder by today's hash: (one line per entry, how many were left that should
    have moved). Idempotent: a second pass finds every run in place."""
    if not store.is_dir():
        raise FileNotFoundError(f"no run store at {store} (give the store folder, e.g. outputs/store)")
    if not dry_run and not os.access(store, os.W_OK):
        raise PermissionError(
            f"the run store {store} is read-only here: this script rewrites its records and renames its folders; run it "
            "as the store's owner (--dry-run says what would move)"
        )
    lines, counts = [], {"moved": 0, "in place": 0, "left": 0}
    for folder in sorted(p for p in store.iterdir() if p.is_dir()):
        try:
            entry = Entry.read(folder)
        except Unmovable as err:
            if (folder / RESULTS_FILE).exists() or (folder / RUN_CONFIG_FILE).exists():
                counts["left"] += 1
                lines.append(f"left {folder.name}: {err}")
            else:
                lines.append(f"not a run: {folder.name}/ (no run record), left as it is")
            continue
        outcome, line = move(entry, dry_run)
        counts[outcome] += 1
        if line:
            lines.append(line)
    verb = "would move" if dry_run else "moved"
    lines.append(f"{counts['moved']} {verb}, {counts['in place']} in place, {counts['left']} left ({store})")
    return lines, counts["left"]


def move(entry: Entry, dry_run: bool) -> tuple[str, str]:
    """One entry's records rewritten, then its folder renamed: (moved | in place | left, what was done)."""
    if entry.current():
        return "in place", ""
    target = entry.folder.parent / entry.key
    if target.exists() and target != entry.folder:
        return "left", f"left {entry.old}: it is run {entry.key}, whose folder already exists (compare and delete one)"
    what = f"{entry.old} -> {entry.key} ({'finished' if entry.results else 'not finished'}; records: "
    what += f"{', '.join(entry.records())})"
    if dry_run:
        return "moved", f"would move {what}"
    lock = FileLock(str(entry.folder / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return (
            "left",
            f"left {entry.old}: a process holds its lock ({entry.folder / LOCK_FILE}); run again once it ends",
        )
    except OSError as err:  # e.g. a folder this user may not write
        return "left", f"left {entry.old}: its lock cannot be taken ({type(err).__name__}: {err})"
    try:
        entry.rewrite_records()
        if target != entry.folder:
            os.rename(entry.folder, target)  # atomic; refuses a target that appeared meanwhile
    except OSError as err:
        return "left", f"left {entry.old}: {err}"
    finally:
        lock.release()
    return "moved", f"moved {what}"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: one line per run moved or left; exit status 1 when a run that should move was left, 2 with
    one ``error:`` line when the store cannot be read or written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="the run store (paths.store_dir; outputs/store by default)")
    parser.add_argument("--dry-run", action="store_true", help="say what would move, move nothing")
    args = parser.parse_args(argv)
    try:
        lines, left = rehash_store(args.store, args.dry_run)
    except (FileNotFoundError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
