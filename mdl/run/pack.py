"""Runs of a sweep that differ only in their seed, trained as members of one fit (``hydra/launcher=packed``).

``pack_key`` says which runs can share a fit: equal configs but for ``seed`` (and bookkeeping keys),
trained as one fit of all members (``mdl.members_per_fit`` all: packing keeps each run's numbers only
where its members already share a stack), without a profiler. ``run_pack`` takes every run's lock,
skips the finished ones (as ``run_experiment`` does), and trains the others together; each still gets
its own run folder, results.json, store entry and loggers, with the numbers it would have alone.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from erasure.files import sha256_hex
from mdl.engine.driver import FitSettings
from mdl.engine.checkpoints import run_identity
from mdl.engine.pack import PackedRun, train_pack
from mdl.engine.preemption import sigterm_guard
from mdl.codelength import check_paper_loss
from mdl.run.experiment import Job, PreparedRun, finish_run, prepare_run, train_alone
from mdl.run.identity import config_hash, members_per_fit
from mdl.run.storage import run_lock

log = logging.getLogger(__name__)
PACKS_DIR = "packs"  # under paths.store_dir: one folder per pack in progress (its checkpoint)


def pack_key(cfg: DictConfig) -> str | None:
    """Runs with equal keys can be trained in one fit; None: this run trains alone."""
    if members_per_fit(cfg.mdl) is not None or cfg.trainer.get("profiler"):
        return None
    unseeded = OmegaConf.merge(cfg, {"seed": 0})
    with open_dict(unseeded):
        unseeded.pop("hydra", None)  # a sweep's composed job config (mdl/sweeps/cost.py) carries Hydra's node
    return config_hash(unseeded)


def run_pack(jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """Each job's results, in order: finished runs skipped, the others trained in one fit (one alone: as usual)."""
    keys = {pack_key(job.cfg) for job in jobs}
    if len(jobs) > 1 and (None in keys or len(keys) > 1):
        raise ValueError("run_pack: these runs differ in more than their seed (or do not train all members in one fit)")
    if len({job.key for job in jobs}) < len(jobs):
        raise ValueError("run_pack: the same run twice in one pack")
    results: dict[int, dict[str, Any]] = {}
    with ExitStack() as held, sigterm_guard():
        for i in sorted(range(len(jobs)), key=lambda i: jobs[i].key):  # one lock order: packs never wait on each other in a cycle
            held.enter_context(run_lock(jobs[i].store, jobs[i].cfg.mdl.lock_lease_s))
        todo = []
        for i, job in enumerate(jobs):
            done = job.stored_results()
            if done is not None:
                results[i] = done
            else:
                todo.append(i)
        if len(todo) == 1:
            job = jobs[todo[0]]
            with job.disk_errors_named():
                results[todo[0]] = finish_run(*train_alone(prepare_run(job)))
        elif todo:
            for i, result in zip(todo, _train_together([jobs[i] for i in todo])):
                results[i] = result
    return [results[i] for i in range(len(jobs))]


def pack_folder(jobs: Sequence[Job]) -> Path:
    """The pack's own folder in the store, named by its runs (so the same runs find their checkpoint again)."""
    name = sha256_hex(" ".join(sorted(job.key for job in jobs)).encode())[:16]
    return Path(jobs[0].cfg.paths.store_dir) / PACKS_DIR / name


def _train_together(jobs: list[Job]) -> list[dict[str, Any]]:
    log.info("pack of %d runs (seeds %s) in one fit", len(jobs), ", ".join(str(job.cfg.seed) for job in jobs))
    first = prepare_run(jobs[0])
    prepared: list[PreparedRun] = [first, *(prepare_run(job, dm=first.dm) for job in jobs[1:])]
    cfg = first.job.cfg
    folder = pack_folder(jobs)
    settings = FitSettings(first.trainer_kwargs, cfg.trainer.patience, cfg.mdl.checkpoint_every_s, cfg.mdl.steps_per_group,
                           check_paper_loss(cfg.mdl.paper_loss) == "last_block", first.callbacks, identity=run_identity(folder))
    runs = [PackedRun(p.job.cfg.seed, p.job.store, p.on_block, p.on_epoch, p.final_curves) for p in prepared]
    with ExitStack() as named:
        for job in jobs:
            named.enter_context(job.disk_errors_named())
        outcomes = train_pack(first.dm, first.boundaries, first.recipe, settings, runs, folder, cfg.mdl.paper_loss)
        results = [finish_run(p, outcome) for p, outcome in zip(prepared, outcomes)]
    shutil.rmtree(folder, ignore_errors=True)  # every run's results are written: no resume needs the pack's checkpoint
    return results
