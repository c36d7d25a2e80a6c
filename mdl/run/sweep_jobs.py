"""Which jobs of a Hydra multirun have no results yet: the jobs its sweeper would launch (read
back from the sweep's ``multirun.yaml``) against the job folders holding a results.json. A report
over an interrupted sweep names the missing ones instead of silently averaging what is there."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mdl.results import RESULTS_FILE

log = logging.getLogger(__name__)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
SEED_KEYS = ("seed", "data_seed")  # change no job's cost: jobs differing only in these are costed once


def without_keys(overrides: Sequence[str], keys: Sequence[str]) -> tuple[str, ...]:
    """A job's overrides without those that set ``keys`` (with or without a +/~ prefix)."""
    return tuple(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys)


@dataclass(frozen=True)
class MissingJob:
    sweep_dir: Path
    num: int
    overrides: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.sweep_dir} job #{self.num}: {' '.join(self.overrides) or '(no overrides)'}"


def planned_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """Every job's overrides, in job-number order, as Hydra's basic sweeper expands the sweep's command
    line; None when the folder is not a multirun, another sweeper made it (it cannot be replayed) or its record is
    damaged (a warning names it)."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    try:
        return _expanded(path)
    except Exception as err:  # noqa: BLE001 - yaml, omegaconf and Hydra's parser raise many types for a damaged file
        log.warning(
            "%s is damaged (%s: %s): the jobs of this sweep that wrote no results cannot be listed; the "
            "results found are reported",
            path,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None


def _expanded(path: Path) -> list[list[str]] | None:
    from omegaconf import OmegaConf

    hydra = OmegaConf.load(path).hydra
    if OmegaConf.select(hydra, "sweeper._target_") != BASIC_SWEEPER:
        return None
    return expand_sweep(hydra.sweeper.get("params") or {}, hydra.overrides.task)


def expand_sweep(params: Mapping[str, Any], overrides: Sequence[str]) -> list[list[str]]:
    """Every job's overrides, exactly as Hydra's BasicSweeper expands them: a preset's sweep
    (``hydra.sweeper.params``) first, then the command line (later wins)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def job_folder(sweep_dir: Path, num: int) -> Path | None:
    """Job ``num``'s folder (``<num>`` or ``<num>_<overrides>``, mdl.run.storage.job_dirname), if it exists."""
    for candidate in sweep_dir.glob(f"{num}*"):
        if candidate.is_dir() and (candidate.name == str(num) or candidate.name.startswith(f"{num}_")):
            return candidate
    return None


def missing_jobs(dirs: Iterable[str | Path]) -> list[MissingJob]:
    """The planned jobs of every multirun folder among ``dirs`` that wrote no results.json."""
    missing = []
    for sweep_dir in map(Path, dirs):
        jobs = planned_jobs(sweep_dir) or []
        shared = set.intersection(*(set(job) for job in jobs)) if jobs else set()
        for num, overrides in enumerate(jobs):
            folder = job_folder(sweep_dir, num)
            if folder is None or not (folder / RESULTS_FILE).is_file():  # the job's own values: what the sweep varies
                missing.append(MissingJob(sweep_dir, num, tuple(o for o in overrides if o not in shared)))
    return missing


def sweep_dimensions(jobs: list[list[str]]) -> list[tuple[str, int]]:
    """(key, number of values) of every swept key, in Hydra's order."""
    if not jobs:
        return []
    dims = []
    for i, entry in enumerate(jobs[0]):
        values = {job[i] for job in jobs}
        if len(values) > 1:
            dims.append((entry.split("=", 1)[0], len(values)))
    return dims
