"""``python -m mdl.runs [overrides] [--where KEY=VALUE] [--status S] [--csv FILE]``: the runs in the store.

One line per run in ``paths.store_dir`` (``outputs/store`` unless overridden, e.g. ``paths.output_root=/scratch/x``):
its config hash, status, data set, model, width, depth, eraser, seed, learning rate, how its members were grouped
into fits (``mdl.members_per_fit``), paper MDL, every other config key that differs between runs of one data set,
model and eraser (e.g. ``activation``), tags, date, code version, the environment that computed it (torch, device,
threads) and the run's folder (each entry read by mdl.run.stored_runs). The status is one of

- finished;
- running: a process holds the run's lock now (its heartbeat is younger than its lease);
- interrupted: stopped before it finished, by a Ctrl-C, a SIGTERM (preemption, a time limit) or a kill: the command
  that started it resumes it from its finished blocks and last checkpoint, and the listing prints that command;
- failed, with the error's first line (the same command runs it again);
- damaged: a record of the run (results.json, config.json or progress.json) cannot be read; a warning names the file
  and what to do.

Running, interrupted and failed runs say how many blocks they have done ("3/9 blocks"). Rows are in the order of the
columns, left to right (data set, model, width, depth, eraser in the paper's order, seed, lr, the swept keys), then by
date. Runs of ``debug=fast``, ``debug=profile`` and the presets' smoke versions (``debug_run`` in their config), whose
numbers mean nothing, are listed apart, below the others.

``--where KEY=VALUE`` keeps the runs whose value in a column of the table (``eraser=leace``, ``activation=gelu``,
``status=interrupted``) or at a dotted config key (``eraser.name=leace``, as in overrides) is VALUE (repeatable; a key
that is neither is refused with the nearest one), ``--status`` those in that state, ``--csv`` writes the table (every
listed column, numbers in full precision, and ``debug_run``) to a file as well.

A store written before the config's keys or the hash changed is moved to today's hashes once by
``python scripts/rehash_store.py <store>``, so that relaunches find its runs done instead of training them again.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from mdl.report.sweep import display_names, eraser_sort_key, flatten, is_ignored_key, sortable
from mdl.run.stored_runs import (
    COLUMN_KEYS,
    COLUMNS,
    DEBUG_KEY,
    HEAD,
    STATUSES,
    TAIL,
    StoredRun,
    read_run,
    relaunch,
    select,
)


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


def column_keys(runs: list[StoredRun]) -> dict[str, str | None]:
    """Every column the table of ``runs`` can show, with the config key it shows (None: a column of the record, such
    as status, paper_mdl or fits, which shows the grouping rather than mdl.members_per_fit's value)."""
    keys = swept_keys(runs)
    shown: dict[str, str | None] = {c: None for c in (*COLUMNS, "error")}
    shown |= {c: k for c, k in COLUMN_KEYS.items() if c != "fits"}
    return shown | {name: key for key, name in display_names(keys).items()}


def check_where_key(key: str, runs: list[StoredRun], columns: dict[str, str | None]) -> None:
    """A --where key that is neither a column of the table nor a config key of any run would silently match nothing:
    refuse it, the nearest named."""
    leaves = set().union(*(flatten(r.config) for r in runs)) if runs else set()
    if not runs or key in columns or key in leaves:
        return
    inside = sorted(k for k in leaves if k.startswith(key + "."))
    near = inside[:1] if inside else difflib.get_close_matches(key, sorted(columns) + sorted(leaves), n=1)
    what = "a group of settings, not one value" if inside else "not a column of the table nor a config key of any run"
    hint = f"; did you mean --where {near[0]}=...?" if near else ""
    raise ValueError(
        f"--where {key}: {what}{hint} (a column: {', '.join(columns)}; or a config key, dotted as in overrides, "
        f"e.g. eraser.name, model.options.activation)"
    )


def where_matches(run: StoredRun, key: str, wanted: str, columns: dict[str, str | None]) -> bool:
    """Whether ``run`` has ``wanted`` in the column ``key`` (its state, for status; the text the table shows, for a
    column of the record) or at the config key it shows, or at ``key`` as a dotted config key."""
    if key == "status":
        return run.status == wanted
    if key in columns and columns[key] is None:
        return cell(key, run.values.get(key)) == wanted or cell(key, run.values.get(key), full=True) == wanted
    return _matches(select(run.config, columns.get(key) or key), wanted)


def reading_order(runs: list[StoredRun]) -> list[StoredRun]:
    """The rows as a reader scans the table: by its columns from the left (data set, model, width, depth, eraser in
    the paper's order, seed, lr, the swept keys), then by date and hash; a row whose config is unknown last."""
    keys = swept_keys(runs)

    def key(run: StoredRun) -> tuple:
        v = run.values
        head = sortable((v["data"], v["model"], v["width"], v["depth"]))
        rest = sortable((v["seed"], v["lr"], *(select(run.config, k) for k in keys), v["date"], v["hash"]))
        return (not run.config, head, eraser_sort_key(str(v["eraser"] or "")), rest)

    return sorted(runs, key=key)


def list_runs(store: Path, where: Sequence[str] = (), status: str | None = None) -> list[StoredRun]:
    """The runs recorded in ``store``, those that match every ``--where KEY=VALUE`` (a column of the table or a
    config key) and in ``status``, in reading order (``reading_order``). A key that is neither is refused rather than
    matching nothing, so a typo cannot look like an empty store."""
    if not store.is_dir():
        raise FileNotFoundError(
            f"no run store at {store}; runs are recorded there by launch.py "
            f"(set paths.output_root=... or paths.store_dir=... to look elsewhere)"
        )
    filters = []
    for item in where:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--where {item!r}: use KEY=VALUE, e.g. --where eraser=leace")
        filters.append((key, value))
    runs = [r for r in map(read_run, sorted(p for p in store.iterdir() if p.is_dir())) if r is not None]
    columns = column_keys(runs)
    for key, _ in filters:
        check_where_key(key, runs, columns)
    if status is not None:
        runs = [r for r in runs if r.status == status]
    return reading_order([r for r in runs if all(where_matches(r, k, v, columns) for k, v in filters)])


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
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keep runs with this value in a column of the table (eraser=leace) or at a config key (eraser.name=leace)",
    )
    parser.add_argument("--status", choices=STATUSES, default=None)
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV (full precision)")
    args = parser.parse_args(argv)
    from hydra.errors import HydraException

    try:
        runs = list_runs(store_dir(args.overrides), args.where, args.status)
    except (FileNotFoundError, ValueError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(listing(runs))
    if args.csv:
        from mdl.report.tables import write_csv  # numpy: only for --csv

        columns = (*with_swept_columns(runs), DEBUG_KEY)
        write_csv(args.csv, columns, ([cell(c, r.values.get(c), full=True) for c in columns] for r in runs))
    return 0


def counts(runs: list[StoredRun]) -> str:
    return ", ".join(f"{sum(r.status == s for r in runs)} {s}" for s in STATUSES)


def listing(runs: list[StoredRun]) -> str:
    """The tables ``python -m mdl.runs`` prints: the runs, then the debug runs apart (each table with the columns its
    runs need), then the command that resumes each interrupted run."""
    real = [r for r in runs if r.debug is None]
    debug = [r for r in runs if r.debug is not None]
    parts = []
    if real or not debug:
        parts += [format_table(real, with_swept_columns(real)), f"{len(real)} run(s): {counts(real)}"]
    if debug:
        labels = ", ".join(sorted({str(r.debug) for r in debug}))
        parts += [
            "" if parts else f"0 run(s) besides {len(debug)} debug run(s)",
            f"debug runs ({labels}: debug=fast, debug=profile or a preset's smoke version; their numbers mean nothing):",
            format_table(debug, with_swept_columns(debug)),
            f"{len(debug)} debug run(s): {counts(debug)}",
        ]
    stopped = [r for r in runs if r.status == "interrupted"]
    if stopped:
        parts += ["", "interrupted runs resume (finished blocks and the last checkpoint kept) with:"]
        parts += [f"  {r.folder.name}  {r.resume or relaunch(None, r.folder)}" for r in stopped]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
