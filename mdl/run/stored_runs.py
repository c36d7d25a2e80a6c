"""A run store entry read back as a row of ``python -m mdl.runs``: its state (finished, running, interrupted, failed,
damaged; mdl.runs says what each means), its values by column, whether it is a debug run and the command that resumes
it. A record that cannot be read makes a ``damaged`` row and a warning naming the file and what to do.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdl.results import (
    FAILURE_FILE,
    PROGRESS_FILE,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    DamagedRecord,
    read_checked_json,
    read_json,
)
from mdl.run.environment import describe
from mdl.run.identity import grouping
from mdl.run.storage import lock_is_held

STATUSES = ("finished", "running", "interrupted", "failed", "damaged")
HEAD = ("hash", "status", "data", "model", "width", "depth", "eraser", "seed", "lr", "fits", "paper_mdl")
TAIL = ("tags", "date", "code_version", "environment", "path")
# the config keys the fixed columns show (a swept key among them is not repeated)
COLUMN_KEYS = {
    "data": "data.source",
    "model": "model.name",
    "width": "width",
    "depth": "depth",
    "eraser": "eraser.name",
    "seed": "seed",
    "lr": "optimizer.lr",
    "fits": "mdl.members_per_fit",  # shown as the grouping it makes (stacked, sequential, fits of k)
    "tags": "tags",
}
COLUMNS = (*HEAD, *TAIL)  # plus the swept keys between them, and ``error`` when a listed run failed
DEBUG_KEY = "debug_run"  # set by debug=fast|profile and the presets' smoke versions (conf/config.yaml)
LEASE_KEY = "mdl.lock_lease_s"  # the lease a run's lock holder renews, for a holder record that does not say


@dataclass
class StoredRun:
    folder: Path
    status: str  # one of STATUSES
    config: dict[str, Any]
    values: dict[str, Any]  # by column
    debug: str | None = None  # the debug_run label (fast, profile, smoke): listed apart
    resume: str | None = None  # the command that resumes an interrupted run (None: not recorded)


def select(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class Damaged(Exception):
    """A store entry's record that cannot be read: which file, why, and what to do about it."""

    def __init__(self, path: Path, err: Exception, todo: str) -> None:
        super().__init__(f"{path} is damaged ({type(err).__name__}: {err}): {todo}")
        self.path = path


def _progress(folder: Path, command: str) -> str | None:
    """ "3/9 blocks" as the progress record says, None when there is none; Damaged when it cannot be read."""
    path = folder / PROGRESS_FILE
    if not path.exists():
        return None
    try:
        progress = read_checked_json(path)
    except DamagedRecord as err:
        raise Damaged(path, err, f"its finished blocks are not reused: {command} starts the run over") from err
    return f"{len(progress.get('blocks', []))}/{len(progress.get('boundaries', [])) - 1} blocks"


def relaunch(started: dict[str, Any] | None, folder: Path) -> str:
    """How the run is launched again: its command (recorded when it started), else its config."""
    command = (started or {}).get("command")
    return command or f"launching its config again (in {folder / RUN_CONFIG_FILE})"


def read_run(folder: Path) -> StoredRun | None:
    """A store entry as a row; None for a folder that holds no run record. A damaged record is a row too, its status
    ``damaged`` and a warning naming the file and what to do."""
    started, damage = read_started(folder)
    command = relaunch(started, folder)
    results = None
    if (folder / RESULTS_FILE).exists():
        try:
            results = read_checked_json(folder / RESULTS_FILE)
        except DamagedRecord as err:
            todo = f"{command} computes the run again, or delete {folder}"
            return damaged_run(folder, Damaged(folder / RESULTS_FILE, err, todo), started)
    if results is None and damage is not None:
        return damaged_run(folder, damage, None)
    record = results or started
    if record is None:
        return None
    config = record.get("config") or {}
    failure = _read_failure(folder / FAILURE_FILE) if results is None else None
    status, done, resume = "finished", None, None
    if results is None:
        try:
            done = _progress(folder, command)
        except Damaged as err:
            return damaged_run(folder, err, started)
        if failure is not None:
            status = "failed"
        elif lock_is_held(folder, select(config, LEASE_KEY)):
            status = "running"
        else:
            status, resume = "interrupted", command
    values = {
        "hash": folder.name,
        "status": f"{status} ({done})" if done else status,
        **_config_values(config),
        "fits": (results or {}).get("fits") or _grouping(config),
        "paper_mdl": (results or {}).get("paper_mdl"),
        "date": _last_written(folder),
        "code_version": record.get("code_version"),
        "environment": describe(record.get("environment")),
        "path": (failure or started or {}).get("run_dir") or _eraser_folder(results),
        "error": (failure or {}).get("error") if status == "failed" else None,
    }
    debug = _debug_label(config, record)
    return StoredRun(folder, status, config, values | {DEBUG_KEY: debug}, debug, resume)


def read_started(folder: Path) -> tuple[dict[str, Any] | None, Damaged | None]:
    """The entry's config.json (written when its run started), or what is wrong with it."""
    path = folder / RUN_CONFIG_FILE
    if not path.exists():
        return None, None
    try:
        record = read_json(path)
    except (OSError, ValueError) as err:  # cut short by a full disk or a kill: listed, not left out
        return None, Damaged(path, err, f"launch the run again to redo it, or delete {folder}")
    if not isinstance(record, dict):
        return None, Damaged(
            path, ValueError("not a JSON object"), f"launch the run again to redo it, or delete {folder}"
        )
    return record, None


def _read_failure(path: Path) -> dict[str, Any] | None:
    """The failure record of a run's last attempt; one that cannot be read still says the attempt failed."""
    if not path.exists():
        return None
    try:
        failure = read_json(path)
    except (OSError, ValueError):
        return {"error": f"(its record {path} cannot be read)"}
    return failure if isinstance(failure, dict) else {"error": f"(its record {path} cannot be read)"}


def _config_values(config: dict[str, Any]) -> dict[str, Any]:
    return {column: select(config, key) for column, key in COLUMN_KEYS.items()}


def _debug_label(config: dict[str, Any], record: dict[str, Any]) -> str | None:
    """fast, profile or smoke for a debug run (its debug_run; a run recorded before that key: a debug=... override
    in its results), else None."""
    label = config.get(DEBUG_KEY)
    if label:
        return str(label)
    chosen = [o.split("=", 1)[1] for o in record.get("overrides") or [] if o.startswith("debug=")]
    return chosen[-1] if chosen and chosen[-1] not in ("null", "none") else None


def _grouping(config: dict[str, Any]) -> str | None:
    """stacked, sequential, fits of k or fits by memory (mdl.run.identity); None for a config that does not say."""
    try:
        return grouping(config["mdl"])
    except (KeyError, TypeError, ValueError):
        return None


def _last_written(folder: Path) -> str:
    """When the entry's records last changed (started, a block done, failed or finished), to the minute."""
    times = [
        p.stat().st_mtime
        for p in (folder / n for n in (RESULTS_FILE, FAILURE_FILE, PROGRESS_FILE, RUN_CONFIG_FILE))
        if p.exists()
    ]
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(max(times))) if times else ""


def _eraser_folder(results: dict[str, Any] | None) -> str | None:
    """The run folder of a finished run recorded before run folders were (its eraser file lies there)."""
    eraser = (results or {}).get("eraser_path")
    return str(Path(eraser).parent) if eraser else None


def damaged_run(folder: Path, damage: Damaged, started: dict[str, Any] | None) -> StoredRun:
    """A store entry with a record that cannot be read: a row saying which, with what its config.json (``started``)
    tells of the run, and a warning naming the file and what to do."""
    print(f"warning: {damage}", file=sys.stderr)
    config = (started or {}).get("config") or {}
    values = {c: None for c in COLUMNS} | _config_values(config)
    values |= {"hash": folder.name, "status": f"damaged ({damage.path.name})", "date": _last_written(folder)}
    values |= {"path": (started or {}).get("run_dir"), "fits": _grouping(config) if config else None}
    debug = _debug_label(config, started or {})
    return StoredRun(folder, "damaged", config, values | {DEBUG_KEY: debug}, debug)
