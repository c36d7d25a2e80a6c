"""``python -m mdl.runs [overrides] [--where KEY=VALUE] [--status S] [--csv FILE]``: the runs in the store.

One line per run in ``paths.store_dir`` (``outputs/store`` unless overridden, e.g. ``paths.output_root=/scratch/x``):
its config hash, status (finished; partial: blocks done of all; started: no block yet; damaged: its record cannot be
read, named in a warning), data set, model,
width, depth, eraser, seed, engine, paper MDL and code version. ``--where eraser.name=leace`` keeps the
runs whose resolved config has that value (repeatable; dotted keys as in overrides), ``--status``
those in that state, ``--csv`` writes the table (every listed column) to a file as well.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mdl.results import PROGRESS_FILE, RESULTS_FILE, RUN_CONFIG_FILE, DamagedRecord, read_checked_json, read_json

STATUSES = ("finished", "partial", "started", "damaged")
COLUMNS = ("hash", "status", "data", "model", "width", "depth", "eraser", "seed", "engine", "paper_mdl", "code_version")


@dataclass
class StoredRun:
    folder: Path
    status: str
    config: dict[str, Any]
    values: dict[str, Any]


def select(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def read_run(folder: Path) -> StoredRun | None:
    """A store entry as a row; None for a folder that holds no run record."""
    results = None
    if (folder / RESULTS_FILE).exists():
        try:
            results = read_checked_json(folder / RESULTS_FILE)
        except DamagedRecord as err:
            if not (folder / RUN_CONFIG_FILE).exists():  # nothing else says what this run is
                return damaged_run(folder, folder / RESULTS_FILE, err)
            results = None
    record = results
    if record is None and (folder / RUN_CONFIG_FILE).exists():
        try:
            record = read_json(folder / RUN_CONFIG_FILE)
        except (OSError, ValueError) as err:  # cut short by a full disk or a kill: listed, not left out
            return damaged_run(folder, folder / RUN_CONFIG_FILE, err)
    if record is None:
        return None
    config = record.get("config") or {}
    if results is not None:
        status = "finished"
    else:
        status, done = "started", None
        try:
            progress = read_checked_json(folder / PROGRESS_FILE)
            done = f"{len(progress.get('blocks', []))}/{len(progress.get('boundaries', [])) - 1} blocks"
            status = "partial" if progress.get("blocks") else "started"
        except (DamagedRecord, OSError):
            pass
    values = {
        "hash": folder.name, "status": status if results is not None or not done else f"{status} ({done})",
        "data": select(config, "data.source"), "model": select(config, "model.name"), "width": config.get("width"),
        "depth": config.get("depth"), "eraser": select(config, "eraser.name"), "seed": config.get("seed"),
        "engine": (results or {}).get("engine") or select(config, "mdl.engine"),
        "paper_mdl": round(results["paper_mdl"], 4) if results and results.get("paper_mdl") is not None else None,
        "code_version": record.get("code_version"),
    }
    return StoredRun(folder, status, config, values)


def damaged_run(folder: Path, record: Path, err: Exception) -> StoredRun:
    """A store entry whose record cannot be read: a row saying so (its config unknown), and a warning naming the file."""
    print(f"warning: {record} is damaged ({type(err).__name__}: {err}); its run is listed as damaged: launch it "
          f"again to redo it, or delete {folder}", file=sys.stderr)
    values = {c: None for c in COLUMNS} | {"hash": folder.name, "status": "damaged"}
    return StoredRun(folder, "damaged", {}, values)


def list_runs(store: Path, where: Sequence[str] = (), status: str | None = None) -> list[StoredRun]:
    if not store.is_dir():
        raise FileNotFoundError(f"no run store at {store}; runs are recorded there by launch.py "
                                f"(set paths.output_root=... or paths.store_dir=... to look elsewhere)")
    filters = []
    for item in where:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--where {item!r}: use KEY=VALUE, e.g. --where eraser.name=leace")
        filters.append((key, value))
    runs = [r for r in map(read_run, sorted(p for p in store.iterdir() if p.is_dir())) if r is not None]
    if status is not None:
        runs = [r for r in runs if r.status == status]
    return [r for r in runs if all(_matches(select(r.config, k), v) for k, v in filters)]


def _matches(actual: Any, wanted: str) -> bool:
    """A config value against a command-line string: 128 matches 128, true matches True, lists as JSON."""
    if isinstance(actual, (list, dict, bool)) or actual is None:
        return json.dumps(actual) == wanted or str(actual).lower() == wanted.lower()
    return str(actual) == wanted


def format_table(runs: list[StoredRun]) -> str:
    rows = [[("" if r.values[c] is None else str(r.values[c])) for c in COLUMNS] for r in runs]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(COLUMNS), *map(line, rows)])


def store_dir(overrides: Sequence[str]) -> Path:
    """paths.store_dir as conf/ resolves it with these overrides (no path is written in Python)."""
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return Path(compose("config", overrides=list(overrides)).paths.store_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mdl.runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides that move the store, e.g. paths.output_root=/x")
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="keep runs with this config value")
    parser.add_argument("--status", choices=STATUSES, default=None)
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    args = parser.parse_args(argv)
    from hydra.errors import HydraException

    try:
        runs = list_runs(store_dir(args.overrides), args.where, args.status)
    except (FileNotFoundError, ValueError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(runs))
    print(f"{len(runs)} run(s): " + ", ".join(f"{sum(r.status == s for r in runs)} {s}" for s in STATUSES))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(r.values for r in runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
