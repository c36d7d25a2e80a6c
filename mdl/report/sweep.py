"""Find, load and group the ``results.json`` files of a sweep for the report.

A *condition* is one point of the experimental design: the resolved config with the replicate
keys (every key named ``seed`` or ``*_seed``) and the bookkeeping keys (paths, logger, hydra)
removed. Runs of one condition are its seeds; the report averages over them and nothing else, so
two widths, two depths or two eraser option settings never end up in one mean.

Within a condition's config three kinds of keys matter for display:
- the architecture label: ``model.name`` plus any other ``model.*`` key that varies within that
  architecture (e.g. ``mlp-gelu`` when several activations were swept);
- the eraser label: ``eraser.name`` plus any ``eraser.*`` key that varies within that eraser
  (e.g. ``alf_qleace (max_rank=15)``), so option sweeps stay apart and still share a control;
- the row keys: every other key that varies within some (architecture, eraser) pair, e.g.
  ``width``, ``depth``, ``data.source`` (what the sweeps swept), or the keys the user names
  (``--rows``). Rows are (architecture, row-key values).

Runs of different *designs* (runs that do not share their config keys, e.g. a paper preset's
``paper.*`` lookup tables beside a plain sweep) are kept apart by ``load_sweeps``: one Sweep, hence one
table, per design, instead of one table with a row key for every key some design lacks.

The code version that computed a run (``code_version`` in results.json, else ``git_sha``, else
``unknown``) is part of a condition by default: when a sweep holds more than one version, runs of
different versions are never averaged together and the version becomes the last row key
(``code_version``). ``merge_code_versions=True`` averages them in one cell; the report says which.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

from mdl.results import read_checked_json
from mdl.run.environment import describe
from mdl.run.identity import is_bookkeeping

RESULTS_NAME = "results.json"
REQUIRED_KEYS = ("config",)
PATHLIKE_SUFFIXES = ("dir", "path", "root", "file", "dirname")
CONTROL = "none"
AXIS_ORDER = ("width", "depth")
COMPARED_METRICS = ("paper_mdl", "online_codelength_bits", "final_val_loss", "val_loss_curve")
ERASER_ORDER = ("none", "leace", "alf_qleace", "gradient", "qleace", "random")
PROTOCOL_KEY = "protocol.name"  # the training loop (conf/protocol/): original or sound
CODE_VERSION_KEY = "code_version"  # the pseudo row key holding the code version when cells are split
UNKNOWN_VERSION = "unknown"
T = TypeVar("T")


@dataclass
class Run:
    """One results.json: its flattened config split into the parts the report groups by."""

    path: Path
    results: dict[str, Any]
    flat: dict[str, Any]  # dotted config key -> JSON-encoded value
    replicate: tuple[tuple[str, Any], ...]  # (key, value) of every seed key, sorted
    mtime: float
    arch: str = ""
    eraser: str = ""
    row: tuple[Any, ...] = ()  # values of the row keys, in Sweep.row_keys order

    @property
    def environment(self) -> str:
        """Where this run's numbers were computed, in one line (mdl.run.environment)."""
        return describe(self.results.get("environment"))

    @property
    def code_version(self) -> str:
        """What computed this run: results' code_version, else its git_sha, else 'unknown'."""
        return str(self.results.get("code_version") or self.results.get("git_sha") or UNKNOWN_VERSION)

    def metric(self, name: str) -> float | None:
        value = self.results.get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class Problem:
    path: Path
    reason: str


@dataclass
class Sweep:
    runs: list[Run]
    row_keys: list[str]
    replicate_keys: list[str]  # seed keys whose value varies somewhere
    problems: list[Problem] = field(default_factory=list)
    duplicates: list[tuple[Run, Run]] = field(default_factory=list)  # (kept, dropped) with different numbers
    copies: int = 0  # results.json files identical in numbers to one kept (store/, skipped re-launches)
    code_versions: list[str] = field(default_factory=list)  # distinct versions of the kept runs, sorted
    split_code_versions: bool = True  # False: --merge-code-versions, runs of all versions share cells
    design: str = ""  # what sets these runs' design apart from the other designs read with them ("": one design)

    @property
    def mixed_versions(self) -> bool:
        return len(self.code_versions) > 1

    def code_version_line(self) -> str:
        """One line on how many code versions the runs come from and whether cells were split;
        empty when all runs come from one version."""
        if not self.mixed_versions:
            return ""
        how = (
            "cells were split by code version (a `code_version` column tells them apart; pass "
            "--merge-code-versions to average them together)"
            if self.split_code_versions
            else "cells were merged across code versions (--merge-code-versions): a cell's mean may mix versions"
        )
        return f"runs come from {len(self.code_versions)} code versions ({', '.join(self.code_versions)}); {how}."

    def row_names(self) -> list[str]:
        names = display_names(self.row_keys)
        return [names[k] for k in self.row_keys]

    def describe(self, row: tuple[Any, ...], *skip: str) -> str:
        """'width=128, depth=2' for a row (optionally without the keys ``skip``); '' when no key is left."""
        return ", ".join(f"{name}={v}" for k, name, v in zip(self.row_keys, self.row_names(), row) if k not in skip)

    def replicate_label(self, replicate: tuple[tuple[str, Any], ...]) -> str:
        """'seed=2' (only the seed keys that vary in this sweep; the first one if none varies)."""
        values = dict(replicate)
        keys = self.replicate_keys or [k for k, _ in replicate][:1]
        return ",".join(f"{k}={values.get(k)}" for k in keys) or "-"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": JSON string}; lists are leaves (JSON-encoded, hashable)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(tree, sort_keys=True)}


def is_replicate_key(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return last == "seed" or last.endswith("_seed")


def is_ignored_key(key: str, encoded: str, extra_ignored: Iterable[str] = ()) -> bool:
    """Bookkeeping that differs between runs of one condition: paths, logger, hydra, --ignore."""
    if is_bookkeeping(key):  # mdl.run.identity: the keys a run's identity leaves out
        return True
    if any(key == prefix or key.startswith(prefix + ".") for prefix in extra_ignored):
        return True
    if key.rsplit(".", 1)[-1].lower().endswith(PATHLIKE_SUFFIXES):
        return True
    value = json.loads(encoded)
    return isinstance(value, str) and value.startswith(("/", "~"))


def find_results(dirs: Iterable[str | os.PathLike]) -> list[Path]:
    found: set[Path] = set()
    for d in dirs:
        d = Path(d)
        if not d.exists():
            raise FileNotFoundError(f"sweep directory {d} does not exist; pass the multirun/<date>/<time> folder")
        found.update(p.resolve() for p in ([d] if d.is_file() else d.rglob(RESULTS_NAME)))
    return sorted(found)


def load_run(path: Path, extra_ignored: Iterable[str] = ()) -> Run:
    """One results.json as a Run; its checksum is checked (mdl.results.DamagedRecord, a ValueError, when it is
    truncated or was edited by hand: a changed number must not enter a report silently)."""
    results = read_checked_json(path)
    if any(k not in results for k in REQUIRED_KEYS):
        raise ValueError(f"missing keys {[k for k in REQUIRED_KEYS if k not in (results or {})]}")
    flat = flatten(results["config"])
    replicate = tuple(sorted((k, json.loads(v)) for k, v in flat.items() if is_replicate_key(k)))
    kept = {k: v for k, v in flat.items() if not is_replicate_key(k) and not is_ignored_key(k, v, extra_ignored)}
    return Run(path=path, results=results, flat=kept, replicate=replicate, mtime=path.stat().st_mtime)


def _value(run: Run, key: str) -> Any:
    """A config value as the report compares it: lists as tuples (``optimizer.betas`` keys rows and cells)."""
    return hashable(json.loads(run.flat[key])) if key in run.flat else None


def hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    return value


def group_by(items: Iterable[T], key: Callable[[T], Any]) -> dict[Any, list[T]]:
    """``items`` by ``key(item)``, in order of first appearance, each group in the items' order."""
    groups: dict[Any, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def _varying_within(runs: list[Run], group_of, keys_of) -> dict[Any, list[str]]:
    """Per group (chosen by group_of): the keys (chosen by keys_of) taking more than one value."""
    varying = {}
    for group, members in group_by(runs, group_of).items():
        keys = set().union(*(keys_of(r) for r in members))
        varying[group] = sorted(k for k in keys if len({r.flat.get(k) for r in members}) > 1)
    return varying


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def display_names(keys: Iterable[str]) -> dict[str, str]:
    """The shortest dotted suffix naming each key unambiguously: width -> width, but
    optimizer.lr and data.lr stay apart; a group's ``name`` keeps its group (protocol.name, not name)."""
    keys = list(keys)
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(2 if parts[-1] == "name" and len(parts) > 1 else 1, len(parts) + 1):
            name = ".".join(parts[-n:])
            if sum(other == name or other.endswith("." + name) for other in keys) == 1:
                break
        names[key] = name
    return names


def _label(base: str, run: Run, keys: list[str]) -> str:
    names = display_names(keys)
    parts = [f"{names[k]}={_value(run, k)}" for k in keys]
    return f"{base} ({', '.join(parts)})" if parts else base


def arch_label(run: Run, model_keys: list[str]) -> str:
    """``mlp``, ``mlp-gelu`` when activations differ (model.activation or model.options.activation)."""
    base = str(_value(run, "model.name"))
    activation = [k for k in model_keys if _short(k) == "activation"]
    for key in activation:
        base = f"{base}-{_value(run, key)}"
    return _label(base, run, [k for k in model_keys if k not in activation])


def eraser_sort_key(label: str) -> tuple[int, str]:
    name = label.split(" ", 1)[0]
    return (ERASER_ORDER.index(name) if name in ERASER_ORDER else len(ERASER_ORDER), label)


def short_versions(versions: Iterable[str]) -> dict[str, str]:
    """Table labels of code versions: 12 characters (git shas keep a '-dirty' suffix), the full
    text wherever two versions would share a label."""
    versions = sorted(set(versions))

    def short(v: str) -> str:
        base, dirty = (v[:-6], "-dirty") if v.endswith("-dirty") else (v, "")
        return base[:12] + dirty

    labels = [short(v) for v in versions]
    return {v: (lab if labels.count(lab) == 1 else v) for v, lab in zip(versions, labels)}


def read_runs(dirs: Iterable[str | os.PathLike], extra_ignored: Iterable[str] = ()) -> tuple[list[Run], list[Problem]]:
    """Every readable results.json below ``dirs`` as a Run, and a Problem for each unreadable one."""
    runs: list[Run] = []
    problems: list[Problem] = []
    for path in find_results(dirs):
        try:
            runs.append(load_run(path, extra_ignored))
        except (OSError, ValueError) as err:
            problems.append(Problem(path, f"unreadable: {err}"))
    problems += [
        Problem(run.path, f"config has no {key}; counted under 'None'")
        for run in runs
        for key in ("model.name", "eraser.name")
        if key not in run.flat
    ]
    return runs, problems


def load_sweep(
    dirs: Iterable[str | os.PathLike],
    extra_ignored: Iterable[str] = (),
    merge_code_versions: bool = False,
    rows: Sequence[str] | None = None,
) -> Sweep:
    """All runs below ``dirs`` as one Sweep, whatever their designs (``load_sweeps`` keeps designs apart)."""
    runs, problems = read_runs(dirs, extra_ignored)
    return make_sweep(runs, problems, merge_code_versions, rows)


def load_sweeps(
    dirs: Iterable[str | os.PathLike],
    extra_ignored: Iterable[str] = (),
    merge_code_versions: bool = False,
    rows: Sequence[str] | None = None,
) -> list[Sweep]:
    """The runs below ``dirs`` as one Sweep per design (``design_groups``): a parent folder of mixed
    sweeps gives a table per design instead of one table with a row key per key that any design lacks."""
    runs, problems = read_runs(dirs, extra_ignored)
    groups = design_groups(runs)
    return [make_sweep(members, problems, merge_code_versions, rows, design=name) for name, members in groups.items()]


DESIGN_FREE_PREFIXES = ("model.", "eraser.", "data.options.")  # what the chosen model, eraser or data set brings


def design_keys(run: Run) -> frozenset[str]:
    """The config keys that make a run's design: all but those its model, eraser and data set bring along,
    which differ between the arms of any one sweep (a ConvNeXt has no activation, a control no options)."""
    return frozenset(k for k in run.flat if not k.startswith(DESIGN_FREE_PREFIXES))


def design_groups(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs grouped by their design keys, each group named by the keys that set it apart from the others
    ('paper.*' for a paper preset's lookup tables; 'shared keys only' for the group that has no key of its own)."""
    groups = group_by(runs, design_keys)
    if len(groups) < 2:
        return {"": runs}
    common = frozenset.intersection(*groups)
    named: dict[str, list[Run]] = {}
    for keys, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), sorted(kv[0]))):
        own = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in keys - common})
        name = ", ".join(own) or "shared keys only"
        named[name if name not in named else f"{name} ({len(named) + 1})"] = members
    return named


def choose_row_keys(runs: list[Run], rows: Sequence[str] | None) -> list[str]:
    """The row keys: ``rows`` (full or unambiguous trailing dotted names) when given, else every key that
    varies within an (architecture, eraser) pair, i.e. what the sweeps swept. Given ``rows``, a key that varies
    within a pair and is neither a row nor ignored is an error: its runs would be averaged together."""
    varying = _varying_within(
        runs, lambda r: (r.arch, r.eraser), lambda r: {k for k in r.flat if not k.startswith(("model.", "eraser."))}
    )
    swept = (set().union(*varying.values()) if varying else set()) - set_by_protocol(runs)
    if rows is None:
        return sorted(swept, key=lambda k: (AXIS_ORDER.index(k) if k in AXIS_ORDER else len(AXIS_ORDER), k))
    known = sorted(set().union(*(r.flat for r in runs)) if runs else set())
    chosen = [resolve_key(name, known) for name in rows]
    left = sorted(swept - set(chosen))
    if left:
        raise ValueError(
            f"runs of one architecture and eraser also differ in {', '.join(left)}: add "
            f"{'them' if len(left) > 1 else 'it'} to --rows, or --ignore {left[0]} to average over it"
        )
    return chosen


def set_by_protocol(runs: list[Run]) -> set[str]:
    """The protocol.* keys that protocol.name decides: a sweep over protocol=original,sound gets one row key."""
    rules = {k for r in runs for k in r.flat if k.startswith("protocol.") and k != PROTOCOL_KEY}
    return rules - set().union(*_varying_within(runs, lambda r: r.flat.get(PROTOCOL_KEY), lambda r: rules).values())


def resolve_key(name: str, known: Sequence[str]) -> str:
    """A config key from its full dotted name or an unambiguous trailing part (``lr`` for ``optimizer.lr``)."""
    if name in known:
        return name
    matches = [k for k in known if k.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"--rows {name} is ambiguous: {', '.join(matches)}")
    close = difflib.get_close_matches(name, known, n=3)
    raise ValueError(
        f"--rows {name}: no run has this config key" + (f"; did you mean {', '.join(close)}?" if close else "")
    )


def make_sweep(
    runs: list[Run],
    problems: list[Problem],
    merge_code_versions: bool = False,
    rows: Sequence[str] | None = None,
    design: str = "",
) -> Sweep:
    """Label ``runs``, choose their row keys, and keep one run per (condition, seed).

    Copies with the same numbers (the run store, a re-launch's skipped jobs: they carry the
    original's code version) are counted once; real re-runs with different numbers keep the newest
    non-skipped file and are listed. With more than one code version among the runs, the version is
    part of the condition (runs of two versions are two runs, in two cells, under a ``code_version``
    row key) unless ``merge_code_versions``.
    """
    model_keys = _varying_within(
        runs,
        lambda r: _value(r, "model.name"),
        lambda r: {k for k in r.flat if k.startswith("model.") and k != "model.name"},
    )
    eraser_keys = _varying_within(
        runs,
        lambda r: _value(r, "eraser.name"),
        lambda r: {k for k in r.flat if k.startswith("eraser.") and k != "eraser.name"},
    )
    for run in runs:
        run.arch = arch_label(run, model_keys[_value(run, "model.name")])
        run.eraser = _label(str(_value(run, "eraser.name")), run, eraser_keys[_value(run, "eraser.name")])
    row_keys = choose_row_keys(runs, rows)
    split = not merge_code_versions and len({r.code_version for r in runs}) > 1
    labels = short_versions(r.code_version for r in runs)
    for run in runs:
        run.row = tuple(_value(run, k) for k in row_keys) + ((labels[run.code_version],) if split else ())
    if split:
        row_keys.append(CODE_VERSION_KEY)

    by_seed = group_by(runs, lambda r: (tuple(sorted(r.flat.items())), r.replicate, r.code_version if split else None))
    kept: dict[tuple, Run] = {}
    duplicates: list[tuple[Run, Run]] = []
    copies = 0
    for key, files in by_seed.items():
        versions: dict[str, Run] = {}  # numbers -> newest non-skipped file holding them
        for run in sorted(files, key=lambda r: (r.results.get("skipped", False), -r.mtime)):
            versions.setdefault(json.dumps([run.results.get(m) for m in COMPARED_METRICS]), run)
        copies += len(files) - len(versions)
        newest, *others = sorted(versions.values(), key=lambda r: -r.mtime)
        kept[key] = newest
        duplicates += [(newest, other) for other in others]
    all_replicates = {r.replicate for r in kept.values()}
    replicate_keys = sorted(
        {k for rep in all_replicates for k, _ in rep if len({dict(r).get(k) for r in all_replicates}) > 1}
    )
    ordered = sorted(
        kept.values(), key=lambda r: (r.arch, sortable(r.row), eraser_sort_key(r.eraser), str(r.replicate))
    )
    return Sweep(
        runs=ordered,
        row_keys=row_keys,
        replicate_keys=replicate_keys,
        problems=problems,
        duplicates=duplicates,
        copies=copies,
        code_versions=sorted({r.code_version for r in ordered}),
        split_code_versions=not merge_code_versions,
        design=design,
    )


def sortable(values: tuple[Any, ...]) -> tuple:
    """Sort rows numerically where values are numbers, by text otherwise (None first)."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, json.dumps(v)) for v in values)
