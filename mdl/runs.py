"""``python -m mdl.runs [overrides] [--where KEY=VALUE] [--status S] [--csv FILE]``: the runs in the store.

One line per run in ``paths.store_dir`` (``outputs/store`` unless overridden, e.g. ``paths.output_root=/scratch/x``):
its config hash, status (finished; failed, with the error's first line; partial: blocks done of all; started: no
block yet; damaged: its record cannot be read, named in a warning), data set, model, width, depth, eraser, seed,
learning rate, how its members were grouped into fits (``mdl.members_per_fit``), paper MDL, every other config key
that differs between runs of one data set, model and eraser (e.g. ``activation``), tags, date, code version, the
environment that computed it (torch, device, threads) and the run's folder. ``--where eraser.name=leace`` keeps
the runs whose resolved config has that value (repeatable; dotted keys as in overrides; a key no run has is refused
with the nearest one), ``--status`` those in that state, ``--csv`` writes the table (every listed column, numbers in
full precision) to a file as well.

``--rehash [--dry-run]`` moves every stored run to the folder its config hash names today (mdl.run.rehash), once
after the config's keys or the hash changed, so that relaunches find the runs done instead of training them again.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mdl.report.runs import display_names, flatten, is_ignored_key
from mdl.run.environment import describe
from mdl.run.identity import grouping
from mdl.results import (
    FAILURE_FILE,
    PROGRESS_FILE,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    DamagedRecord,
    read_checked_json,
    read_json,
)

STATUSES = ("finished", "failed", "partial", "started", "damaged")
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


def _read(path: Path, checked: bool = False) -> dict[str, Any] | None:
    """A store record, or None when it is missing or damaged."""
    try:
        return read_checked_json(path) if checked else read_json(path)
    except (DamagedRecord, OSError, ValueError):
        return None


def _progress(folder: Path) -> tuple[str, str | None]:
    """partial or started, and "3/9 blocks" when the progress record says."""
    progress = _read(folder / PROGRESS_FILE, checked=True)
    if progress is None:
        return "started", None
    done = f"{len(progress.get('blocks', []))}/{len(progress.get('boundaries', [])) - 1} blocks"
    return ("partial" if progress.get("blocks") else "started"), done


def read_run(folder: Path) -> StoredRun | None:
    """A store entry as a row; None for a folder that holds no run record."""
    results = started = None
    if (folder / RESULTS_FILE).exists():
        try:
            results = read_checked_json(folder / RESULTS_FILE)
        except DamagedRecord as err:
            if not (folder / RUN_CONFIG_FILE).exists():  # nothing else says what this run is
                return damaged_run(folder, folder / RESULTS_FILE, err)
    if (folder / RUN_CONFIG_FILE).exists():
        try:
            started = read_json(folder / RUN_CONFIG_FILE)
        except (OSError, ValueError) as err:  # cut short by a full disk or a kill: listed, not left out
            if results is None:
                return damaged_run(folder, folder / RUN_CONFIG_FILE, err)
    failure = _read(folder / FAILURE_FILE) if (folder / FAILURE_FILE).exists() else None
    record = results or started
    if record is None:
        return None
    config = record.get("config") or {}
    if results is not None:
        status, shown = "finished", "finished"
    else:
        status, done = _progress(folder)
        status = "failed" if failure is not None else status
        shown = f"{status} ({done})" if done else status
    values = {
        "hash": folder.name,
        "status": shown,
        **{column: select(config, key) for column, key in COLUMN_KEYS.items()},
        "fits": (results or {}).get("fits") or _grouping(config),
        "paper_mdl": (results or {}).get("paper_mdl"),
        "date": _last_written(folder),
        "code_version": record.get("code_version"),
        "environment": describe(record.get("environment")),
        "path": (failure or started or {}).get("run_dir") or _eraser_folder(results),
        "error": (failure or {}).get("error") if status == "failed" else None,
    }
    return StoredRun(folder, status, config, values)


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


def swept_keys(runs: list[StoredRun]) -> list[str]:
    """Config keys that take more than one value among runs of the same data set, model and eraser (what a
    sweep varied, e.g. model.options.activation), less bookkeeping and the keys the fixed columns show."""
    groups: dict[tuple, list[dict[str, str]]] = {}
    for run in runs:
        flat = {k: v for k, v in flatten(run.config).items() if not is_ignored_key(k, v)}
        groups.setdefault((run.values["data"], run.values["model"], run.values["eraser"]), []).append(flat)
    shown = set(COLUMN_KEYS.values())
    varying = {
        k
        for members in groups.values()
        for k in set().union(*members)
        if k not in shown and len({m.get(k) for m in members}) > 1
    }
    return sorted(k for k in varying if not _repeats_a_column(k, runs))


def _repeats_a_column(key: str, runs: list[StoredRun]) -> bool:
    """``model.width`` when ``width`` reads it: the same value as a fixed column in every run."""
    values = [select(r.config, key) for r in runs]
    return any(values == [r.values[c] for r in runs] for c in COLUMN_KEYS)


def with_swept_columns(runs: list[StoredRun]) -> tuple[str, ...]:
    """The columns of this listing (fixed ones, its swept keys by short name, ``error`` if a run failed); each
    run's values gain its swept keys' values."""
    keys = swept_keys(runs)
    names = display_names(keys)
    for run in runs:
        run.values |= {names[k]: select(run.config, k) for k in keys}
    error = ("error",) if any(r.status == "failed" for r in runs) else ()
    return (*HEAD, *(names[k] for k in keys), *TAIL, *error)


def check_where_key(key: str, runs: list[StoredRun]) -> None:
    """A --where key that no run's config holds as a value would silently match nothing: refuse it, nearest named."""
    leaves = set().union(*(flatten(r.config) for r in runs)) if runs else set()
    if not leaves or key in leaves:
        return
    inside = sorted(k for k in leaves if k.startswith(key + "."))
    near = inside[:1] if inside else difflib.get_close_matches(key, sorted(leaves), n=1)
    what = "a group of settings, not one value" if inside else "not a config key of any listed run"
    hint = f"; did you mean --where {near[0]}=...?" if near else ""
    raise ValueError(
        f"--where {key}: {what}{hint} (keys are dotted as in overrides, e.g. eraser.name, model.options.activation)"
    )


def damaged_run(folder: Path, record: Path, err: Exception) -> StoredRun:
    """A store entry whose record cannot be read: a row saying so (its config unknown), and a warning naming the file."""
    print(
        f"warning: {record} is damaged ({type(err).__name__}: {err}); its run is listed as damaged: launch it "
        f"again to redo it, or delete {folder}",
        file=sys.stderr,
    )
    values = {c: None for c in COLUMNS} | {"hash": folder.name, "status": "damaged"}
    return StoredRun(folder, "damaged", {}, values)


def list_runs(store: Path, where: Sequence[str] = (), status: str | None = None) -> list[StoredRun]:
    """The runs recorded in ``store``, those whose config matches every ``--where KEY=VALUE`` and in
    ``status``, in hash order. A key no run holds is refused rather than matching nothing, so a typo cannot look
    like an empty store."""
    if not store.is_dir():
        raise FileNotFoundError(
            f"no run store at {store}; runs are recorded there by launch.py "
            f"(set paths.output_root=... or paths.store_dir=... to look elsewhere)"
        )
    filters = []
    for item in where:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--where {item!r}: use KEY=VALUE, e.g. --where eraser.name=leace")
        filters.append((key, value))
    runs = [r for r in map(read_run, sorted(p for p in store.iterdir() if p.is_dir())) if r is not None]
    for key, _ in filters:
        check_where_key(key, runs)
    if status is not None:
        runs = [r for r in runs if r.status == status]
    return [r for r in runs if all(_matches(select(r.config, k), v) for k, v in filters)]


def _matches(actual: Any, wanted: str) -> bool:
    """A config value against a command-line string: 128 matches 128, true matches True, lists as JSON."""
    if isinstance(actual, (list, dict, bool)) or actual is None:
        return json.dumps(actual) == wanted or str(actual).lower() == wanted.lower()
    return str(actual) == wanted


def cell(column: str, value: Any, full: bool = False) -> str:
    """A value as the table shows it (paper MDL to 4 decimals, other numbers short) or, ``full``, as the CSV keeps it."""
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, float) and not full:
        return f"{value:.4f}" if column == "paper_mdl" else f"{value:g}"
    return str(value)


def format_table(runs: list[StoredRun], columns: Sequence[str] = COLUMNS) -> str:
    rows = [[cell(c, r.values.get(c)) for c in columns] for r in runs]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), *map(line, rows)])


def write_csv(path: str, runs: list[StoredRun], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([cell(c, r.values.get(c), full=True) for c in columns] for r in runs)


def store_dir(overrides: Sequence[str]) -> Path:
    """paths.store_dir as conf/ resolves it with these overrides (no path is written in Python)."""
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return Path(compose("config", overrides=list(overrides)).paths.store_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: the table of the store's runs (and ``--csv``), exit 2 with one ``error:`` line
    when the store or a filter is wrong, so a script can tell a bad query from an empty answer."""
    parser = argparse.ArgumentParser(prog="python -m mdl.runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides that move the store, e.g. paths.output_root=/x")
    parser.add_argument(
        "--where", action="append", default=[], metavar="KEY=VALUE", help="keep runs with this config value"
    )
    parser.add_argument("--status", choices=STATUSES, default=None)
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV (full precision)")
    parser.add_argument(
        "--rehash", action="store_true", help="move every stored run to the folder its config hash names today"
    )
    parser.add_argument("--dry-run", action="store_true", help="with --rehash: say what would move, move nothing")
    args = parser.parse_args(argv)
    if args.dry_run and not args.rehash:
        parser.error("--dry-run goes with --rehash: python -m mdl.runs --rehash --dry-run")
    from hydra.errors import HydraException

    if args.rehash:
        return rehash(args.overrides, args.dry_run)
    try:
        runs = list_runs(store_dir(args.overrides), args.where, args.status)
    except (FileNotFoundError, ValueError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    columns = with_swept_columns(runs)
    print(format_table(runs, columns))
    print(f"{len(runs)} run(s): " + ", ".join(f"{sum(r.status == s for r in runs)} {s}" for s in STATUSES))
    if args.csv:
        write_csv(args.csv, runs, columns)
    return 0


def rehash(overrides: Sequence[str], dry_run: bool) -> int:
    """``--rehash``: one line per run moved or left; exit status 1 when a run that should move was left."""
    from hydra.errors import HydraException

    from mdl.run.rehash import rehash_store

    try:
        lines, left = rehash_store(store_dir(overrides), dry_run)
    except (FileNotFoundError, PermissionError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
