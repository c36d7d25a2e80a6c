"""Runs of a sweep trained as members of one fit (``hydra/launcher=packed``).

``pack_key`` says which runs can share a fit: equal configs but for ``seed``, ``eraser`` and ``data_seed``
(and bookkeeping keys), so with equal input shapes, classes and block schedules, whose members train stacked
(``mdl.members_per_fit`` all, auto or k > 1: a pack is trained in fits of as many members; with 1 a pack would be
its runs one after another), without a profiler. Runs that differ
only in their seed share one data module (``data_key``); the others each bring their own erased data, so a pack holds
at most ``mdl.pack_data_gb`` of data as the sources declare them (``plan_packs``, when the sweep is launched: a
relaunch makes the same packs).
``run_pack`` takes every run's lock, skips the finished ones (as ``run_experiment`` does), and trains
the others together; each still gets its own run folder, results.json, store entry and loggers, with
the numbers it would have alone. Its log lines name it (``run_label``: what varies in the pack), go to its
job's own log file (mdl.run.job_logs), and end with its summary, as launch.py prints a run's.
"""

from __future__ import annotations

import logging
import math
import shutil
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from datamodules.datamodule import ErasedDataModule
from datamodules.splits import size_follows_data_seed
from datamodules.sources import declared_bytes
from erasure.files import sha256_hex
from mdl.engine.checkpoints import run_stamp
from mdl.engine.driver import train_runs
from mdl.engine.preemption import sigterm_guard
from mdl.engine.protocol import LoopRules
from mdl.results import RESULTS_FILE
from mdl.run.experiment import Job, PreparedRun, checkpoint_bytes, finish_run, job_data, prepare_run, train_alone
from mdl.run.console import summary
from mdl.run.identity import config_hash, members_per_fit
from mdl.run.job_logs import job_log_files, own_lines, owned_by
from mdl.run.phases import PROFILE_DIR, profiled_phases
from mdl.run.storage import require_space, run_lock

log = logging.getLogger(__name__)
PACKS_DIR = "packs"  # under paths.store_dir: one folder per pack in progress (its checkpoint)


PACKED_ERASER = {"name": "packed"}  # stands for any eraser in a pack key


def pack_key(cfg: DictConfig) -> str | None:
    """Runs with equal keys can be trained in one fit; None: this run trains alone. With
    ``optimizer.precondition`` (a fit-wide callback made from one run's data) only the seed may differ. A protocol
    that backtracks trains one member per fit (``mdl.engine.protocol.LoopRules``): alone. One stack needs its runs'
    input shapes, classes and block schedules equal: the data config sets them (an eraser keeps the shape), but for
    ``data.balance=suby``, whose training split's size follows the data seed: then runs of one data seed only."""
    if (
        members_per_fit(cfg.mdl) == 1
        or cfg.trainer.get("profiler")
        or LoopRules.of(cfg.get("protocol")).one_member_per_fit
    ):
        return None
    if cfg.optimizer.get("precondition") is not None:
        return data_key(cfg)
    free = {"seed": 0} if size_follows_data_seed(cfg.data.get("balance")) else {"seed": 0, "data_seed": 0}
    return _hash_with(cfg, free, eraser=PACKED_ERASER)


def plan_packs(cfgs: Sequence[DictConfig]) -> list[list[int]]:
    """The sweep's jobs (their configs, in the sweep's order) as packs of job indices: jobs of one ``pack_key`` (None:
    a job alone), their data sets (``data_key``: one per eraser and data seed) in packs of as many as
    ``mdl.pack_data_gb`` holds as their source declares them (``declared_bytes``; at least one each). Decided from the
    configs alone, in the order of the data keys, so a relaunch of the sweep makes the same packs (each pack's folder
    is named by its runs: a killed pack resumes) on any device."""
    by_key: dict[Any, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        key = pack_key(cfg)
        by_key.setdefault(key if key is not None else ("alone", i), []).append(i)
    packs = []
    for jobs in by_key.values():
        by_data: dict[str, list[int]] = {}
        for i in jobs:
            by_data.setdefault(data_key(cfgs[i]), []).append(i)
        data = [by_data[k] for k in sorted(by_data)]
        cfg = cfgs[jobs[0]]
        each = declared_bytes(cfg.data.source, OmegaConf.to_container(cfg.data.options, resolve=True))
        at_once = max(1, math.floor(cfg.mdl.pack_data_gb * 1e9 / each))
        packs += [sorted(i for group in data[a : a + at_once] for i in group) for a in range(0, len(data), at_once)]
        if len(data) > at_once:
            log.warning(
                "%d runs with %d data sets of %.3g GB each (as data=%s declares them) make %d packs of at most %d data "
                "sets (mdl.pack_data_gb=%s)",
                len(jobs),
                len(data),
                each / 1e9,
                cfg.data.source,
                math.ceil(len(data) / at_once),
                at_once,
                cfg.mdl.pack_data_gb,
            )
    return sorted(packs)


def data_key(cfg: DictConfig) -> str:
    """Runs with equal keys have equal data (they differ at most in their seed): one data module serves them."""
    return _hash_with(cfg, {"seed": 0})


def _hash_with(cfg: DictConfig, values: dict[str, Any], eraser: dict[str, Any] | None = None) -> str:
    """The config hash with these top-level values (and the eraser node replaced, if given), set after the config is
    resolved: what interpolates them (the paper presets' ``data_seed: ${seed}``, a learning rate looked up by eraser)
    keeps each run's own value, so runs whose data or training differ never share a key."""
    trimmed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(trimmed):
        trimmed.pop("hydra", None)  # a sweep's composed job config (mdl.sweeps.cost) carries Hydra's node
    plain = OmegaConf.to_container(trimmed, resolve=True)
    plain.update(values)
    if eraser is not None:
        plain["eraser"] = eraser
    return config_hash(OmegaConf.create(plain))


def run_pack(jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """Each job's results, in order: finished runs skipped, the others trained in one fit (one alone: as usual). A job
    that repeats an earlier job's run (they differ only in bookkeeping keys) comes after it, as with Hydra's basic
    launcher: skipped as done (or, with skip_if_done=false, trained again alone)."""
    keys = {pack_key(job.cfg) for job in jobs}
    if len(jobs) > 1 and (None in keys or len(keys) > 1):
        raise ValueError(
            "run_pack: these runs differ in more than their seed, eraser and data seed (or train one member per fit)"
        )
    jobs = [replace(job, label=run_label(jobs, job)) for job in jobs]
    first: dict[str, int] = {}
    for i, job in enumerate(jobs):
        first.setdefault(job.key, i)
    results: dict[int, dict[str, Any]] = {}
    with ExitStack() as held, sigterm_guard(), job_log_files({job.key: job.log_files for job in jobs}):
        for i in sorted(
            first.values(), key=lambda i: jobs[i].key
        ):  # one lock order: packs never wait on each other in a cycle
            held.enter_context(run_lock(jobs[i].store, jobs[i].cfg.mdl.lock_lease_s))
        todo = []
        for i in sorted(first.values()):
            done = owned_by([jobs[i].key], jobs[i].stored_results)()
            if done is not None:
                results[i] = done
            else:
                todo.append(i)
        if len(todo) == 1:
            results[todo[0]] = _run_alone(jobs[todo[0]])
        elif todo:
            # one order however the sweep listed them: a resumed pack's members are where its checkpoint has them
            todo.sort(key=lambda i: jobs[i].key)
            together = [jobs[i] for i in todo]
            with own_lines(*(job.key for job in together)):  # the fit's own lines ("resuming fit from") go to its runs'
                trained = _fit_pack(_prepare_sharing_data(together), [jobs[i].key for i in first.values()])
            for i, result in zip(todo, trained):
                results[i] = result
        for i, job in enumerate(jobs):
            if i not in results:  # a repeat of a run above, whose lock is held
                results[i] = owned_by([job.key], job.stored_results)() or _run_alone(job)
        for i, job in enumerate(jobs):
            _log_summary(job, results[i])
    return [results[i] for i in range(len(jobs))]


def _run_alone(job: Job) -> dict[str, Any]:
    """A run of a sweep that trains alone; with a profiler (such a run is never packed), where its time went."""
    profile = job.run_dir / PROFILE_DIR
    with own_lines(job.key), job.disk_errors_named(), profiled_phases(job.cfg.trainer.get("profiler"), profile):
        return finish_run(*train_alone(prepare_run(job)))


def _log_summary(job: Job, results: dict[str, Any]) -> None:
    """The run's closing summary, as launch.py prints a run's, each line named by the run (and in its own log)."""
    with own_lines(job.key):
        for line in summary(results, job.run_dir / RESULTS_FILE).splitlines():
            log.info("%s: %s", job.label, line)


def packs_line(jobs: int, packs: int) -> str:
    """How a sweep's jobs group into packs, for the launchers' and the cost estimate's output."""
    return f"{jobs} jobs in {packs} pack{'s' if packs != 1 else ''} (a job that cannot be packed is a pack of its own)"


def pack_folder(jobs: Sequence[Job], pack: Sequence[str] = ()) -> Path:
    """The pack's own folder in the store, named by all its runs' keys (``pack``, finished runs included; default: the
    jobs'), so a relaunch finds it again, however many of its runs have finished since (the checkpoint inside says
    which members it holds: one of other members is not resumed, and is replaced)."""
    keys = sorted(pack or [job.key for job in jobs])
    return Path(jobs[0].cfg.paths.store_dir) / PACKS_DIR / sha256_hex(" ".join(keys).encode())[:16]


def pack_stamp(folder: Path, jobs: Sequence[Job]) -> str:
    """What the pack's checkpoints must have been written by: this code, this pack's folder and exactly these runs in
    this order (after some runs of the pack have finished, the others' checkpoint is not resumed: its rows differ)."""
    return f"{run_stamp(folder)} runs {sha256_hex(' '.join(job.key for job in jobs).encode())[:16]}"


def _prepare_sharing_data(jobs: list[Job]) -> list[PreparedRun]:
    """Each run prepared; runs with equal data (``data_key``) share one data module."""
    prepared: list[PreparedRun] = []
    modules: dict[str, ErasedDataModule] = {}
    for job in jobs:
        dm = modules.get(data_key(job.cfg))
        if dm is None:
            with own_lines(*_sharing_data(job, jobs)):  # the data's lines: in the log of each run it serves
                dm = modules[data_key(job.cfg)] = job_data(job)
        with own_lines(job.key):  # the run's own lines ("run <key> ..."): in its log only
            prepared.append(prepare_run(job, dm=dm))
    return prepared


def _sharing_data(job: Job, jobs: Sequence[Job]) -> list[str]:
    """The keys of the ``jobs`` that share ``job``'s data (``data_key``), its own included."""
    return [other.key for other in jobs if data_key(other.cfg) == data_key(job.cfg)]


def run_label(jobs: Sequence[Job], job: Job) -> str:
    """How log lines and the progress display name a run of a pack: the values of seed, eraser and data_seed that vary
    among its ``jobs``."""

    def values(j: Job) -> dict[str, Any]:
        return {"seed": j.cfg.seed, "eraser": j.cfg.eraser.get("name"), "data_seed": j.cfg.data_seed}

    varying = [k for k in ("eraser", "data_seed", "seed") if len({str(values(j)[k]) for j in jobs}) > 1]
    return " ".join(f"{k} {values(job)[k]}" for k in varying) or f"seed {job.cfg.seed}"


def _fit_pack(prepared: list[PreparedRun], pack: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The prepared runs trained together (``mdl.engine.driver.train_runs``), each with its own hooks' lines
    and results; the first run's fitting, with the pack's folder and stamp for its checkpoints."""
    jobs = [p.job for p in prepared]
    log.info("pack of %d runs (%s) in one fit", len(jobs), ", ".join(job.label for job in jobs))
    cfg = jobs[0].cfg
    folder = pack_folder(jobs, pack)
    fitting = replace(prepared[0].fitting, folder=folder, stamp=pack_stamp(folder, jobs))
    require_space(
        Path(cfg.paths.store_dir),
        sum(checkpoint_bytes(p.job.cfg, p.run.model.make_model) for p in prepared),
        f"this pack's checkpoints ({len(prepared)} runs)",
        "paths.output_root",
    )  # in the pack's folder, at once
    runs = [replace(p.run, label=p.job.label, wrap=partial(owned_by, [p.job.key])) for p in prepared]
    with ExitStack() as named:
        for job in jobs:
            named.enter_context(job.disk_errors_named())
        outcomes = train_runs(runs, fitting)
        results = [owned_by([p.job.key], finish_run)(p, outcome) for p, outcome in zip(prepared, outcomes)]
    shutil.rmtree(folder, ignore_errors=True)  # every run's results are written: no resume needs the pack's checkpoint
    return results
