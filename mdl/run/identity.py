"""The one definition of the settings that say where or how a run is done, not what it computes.

They are left out of a run's identity (its config hash, ``config_hash`` below, which decides
skip-if-done and resume) and, for ``data.options``, out of the erasure cache keys (mdl.run.components
``make_datamodule``), the report does not split cells on them (mdl.report.sweep), and W&B
run names leave them out (mdl.run.loggers). Hydra's job folder names leave the same ones out
(``hydra.job.config.override_dirname.exclude_keys`` in conf/config.yaml; tests/test_identity.py checks
the two agree). Light: no torch, so the report and the sweep tools import it cheaply.

Not among them: how members are grouped into fits (``mdl.members_per_fit``: the groupings' numbers differ in
the last bits), and on a CPU the thread count (``cpu_threads`` is added to the identity: 1 and 2 threads reduce
sums in other orders).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mdl.engine.members import AUTO

BOOKKEEPING_KEYS = (
    # where things go and how they are recorded
    "paths",
    "logger",
    "tags",
    "hydra",
    "skip_if_done",
    "print_config",
    "debug_run",  # debug=fast|profile: a label; the settings they change are in the identity
    "data.cache_dir",
    # where and how a data set is fetched (not what it holds)
    "data.options.root",
    "data.options.download",
    # how fast or how often
    "mdl.checkpoint_every_s",
    "eraser.checkpoint_every_s",
    "mdl.steps_per_group",
    "mdl.min_steps_per_pass",
    "mdl.lock_lease_s",
    "mdl.pack_data_gb",
    "mdl.reuse_across_environments",
    "trainer.torch_threads",
    "trainer.threads_by_members_per_fit",
    "trainer.profiler",
    # tables looked up once: the optimizer.lr they set is what counts (an lr search's answers, +lr=best; the
    # data sets' default learning rates)
    "lr_search",
    "optimizer.lr_by_data",
)


def is_bookkeeping(key: str) -> bool:
    """Whether a dotted config key (or an override's key, ``+``/``~`` allowed) is or lies under one of them."""
    key = key.lstrip("+~")
    return any(key == k or key.startswith(k + ".") for k in BOOKKEEPING_KEYS)


def without_bookkeeping(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a plain nested dict, changed in place and returned) without the bookkeeping keys."""
    for dotted in BOOKKEEPING_KEYS:
        *parents, last = dotted.split(".")
        node: Any = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return config


# --- how many members a fit trains: mdl.members_per_fit ----------------------------------------------


def members_per_fit(mdl: Any) -> int | str | None:
    """``mdl.members_per_fit`` (``all``, ``auto`` or an integer >= 1); None means all members in one fit.
    ``mdl`` is the config's ``mdl`` node or a plain dict."""
    value = mdl.get("members_per_fit")
    if value is None:
        raise ValueError(
            "mdl.members_per_fit is not set: each conf/model/<name>.yaml sets its default (mdl: members_per_fit: "
            "all or 1); set it there or on the command line, e.g. mdl.members_per_fit=all"
        )
    if value == "all":
        return None
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"mdl.members_per_fit={value!r}: must be all, auto, or an integer >= 1 (1 = one model per fit; all = "
            f"every member in one stacked fit; auto = as many as fit in the device's memory)"
        )
    return value


def members_per_fit_as_trained(config: dict[str, Any]) -> int | str | None:
    """``mdl.members_per_fit`` as the run's fits are made, so that two values that train alike are one identity:
    1 under a protocol that backtracks or validates per batch as the original (every fit one member:
    mdl.engine.memory.one_per_fit_if_backtracking), and
    ``all`` for a k of at least the run's mdl.num_blocks members (mdl.engine.protocol.fits_of: one fit)."""
    mdl, protocol = config["mdl"], config.get("protocol")
    value = mdl.get("members_per_fit")
    if isinstance(protocol, dict) and (protocol.get("backtrack") or protocol.get("batch_mean_validation")):
        return 1
    blocks = mdl.get("num_blocks")
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(blocks, int) and value >= blocks:
        return "all"
    return value


def grouping(mdl: Any) -> str:
    """How a run's members are grouped, in words for people: ``stacked`` (all in one fit), ``sequential`` (one per
    fit), ``fits of k`` or ``fits by memory``."""
    k = members_per_fit(mdl)
    if k == AUTO:
        return "fits by memory"
    if (
        k is None or k >= mdl["num_blocks"]
    ):  # a run has num_blocks members (one per boundary; the last is the final fit)
        return "stacked"
    return "sequential" if k == 1 else f"fits of {k}"


# --- a run's identity: the config hash ----------------------------------------------------------


def allocated_cpus() -> int:
    """The CPU threads a run trains with by default: the CPUs Slurm allocated to the task
    (SLURM_CPUS_PER_TASK, capped by the process's CPU affinity), which no other job uses; elsewhere 1.

    On a machine whose cores other work shares (a login node, CI, a workstation) more threads than one
    only fight that work: the default run took 18.1 s with 2 spinning threads and 13.0 s with 2 sleeping
    ones against 10.1 s with one, while 2 busy processes ran on 2 cores (benchmarks/bench_threads.py; on a
    quiet machine 2 threads saved 7%). The thread count is part of a CPU run's identity, so it must not
    depend on the load of the moment: set trainer.torch_threads=N where N cores are yours."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if not (slurm.isdigit() and int(slurm) > 0):
        return 1
    count = int(slurm)
    if hasattr(os, "sched_getaffinity"):
        count = min(count, len(os.sched_getaffinity(0)))
    return max(count, 1)


DEFAULT_THREADS = allocated_cpus()  # trainer.torch_threads=null: the CPUs allocated to this task (1 outside Slurm)


def training_threads(cfg: DictConfig) -> int:
    """The CPU threads a run trains with: trainer.torch_threads, or the CPUs allocated to this process."""
    return int(cfg.trainer.get("torch_threads") or DEFAULT_THREADS)


def config_hash(cfg: DictConfig) -> str:
    """A short hash of the resolved config minus bookkeeping keys: the identity of a run. A run that
    trains on a CPU also carries its thread count: 1 and 2 threads give different numbers (sums are
    reduced in another order), so a run resumed or skipped with another count would mix them."""
    cpu_threads = training_threads(cfg) if _trains_on_cpu(cfg) else None
    return identity_hash(OmegaConf.to_container(cfg, resolve=True), cpu_threads)


def identity_hash(config: dict[str, Any], cpu_threads: int | None) -> str:
    """``config_hash`` of a resolved config as a plain dict (a stored run's, scripts/rehash_store.py), with the CPU thread
    count it trains with (None: it trains on a GPU)."""
    data = without_bookkeeping(copy.deepcopy(config))  # where and how, not what
    if isinstance(data.get("mdl"), dict) and "members_per_fit" in data["mdl"]:
        data["mdl"]["members_per_fit"] = members_per_fit_as_trained(data)
    if cpu_threads is not None:
        data["cpu_threads"] = cpu_threads
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _trains_on_cpu(cfg: DictConfig) -> bool:
    """Whether the run's device resolves to the CPU here (a device that cannot be resolved is reported
    by check_trainer_config, not here)."""
    from mdl.engine.device import training_device  # torch: only when a hash is made, not when the report imports this

    try:
        return training_device(cfg.device, cfg.data.get("device")).type == "cpu"
    except ValueError:
        return False
