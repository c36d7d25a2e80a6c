"""The one definition of the settings that say where or how a run is done, not what it computes.

They are left out of a run's identity (its config hash, ``config_hash`` below, which decides
skip-if-done and resume) and, for ``data.options``, out of the erasure cache keys (mdl/run/components.py
``make_datamodule``), the report does not split cells on them (mdl/report/runs.py), and W&B
run names leave them out (mdl/run/loggers.py). Hydra's job folder names leave the same ones out
(``hydra.job.config.override_dirname.exclude_keys`` in conf/config.yaml; tests/test_identity.py checks
the two agree). Light: no torch, so the report and the sweep tools import it cheaply.

Not among them: how members are grouped into fits (``mdl.members_per_fit``, or ``mdl.engine`` naming it:
the modes' numbers differ in the last bits; ``canonical_fit_mode`` writes it one way), and on a CPU
the thread count (``cpu_threads`` is added to the identity: 1 and 2 threads reduce sums in other orders).
"""

from __future__ import annotations

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
    "data.cache_dir",
    # where and how a data set is fetched (not what it holds)
    "data.options.root",
    "data.options.download",
    # how fast or how often
    "mdl.checkpoint_every_s",
    "mdl.default_engine",
    "mdl.steps_per_group",
    "mdl.lock_lease_s",
    "mdl.pack_data_fraction",
    "mdl.reuse_across_environments",
    "trainer.torch_threads",
    "trainer.threads_by_engine",
    "trainer.profiler",
    # a table looked up once: the optimizer.lr it sets is what counts (an lr search's answers, +lr=best)
    "lr_search",
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


# --- how many members a fit trains: mdl.members_per_fit, and mdl.engine as a name for it ---------------

ENGINES = {"stacked": None, "sequential": 1}  # mdl.engine: a name for mdl.members_per_fit (None = all)


def members_per_fit(mdl: Any) -> int | str | None:
    """``mdl.members_per_fit`` (``all``, ``auto`` or an integer >= 1), or, when it is null, what ``mdl.engine``
    names; None means all members in one fit. ``mdl`` is the config's ``mdl`` node or a plain dict."""
    value = mdl.get("members_per_fit")
    if value is None:
        engine = mdl.get("engine")
        if engine not in ENGINES:
            raise ValueError(
                f"unknown engine mdl.engine={engine!r}; choose one of {tuple(ENGINES)} "
                f"(or set mdl.members_per_fit=all|auto|1|k)"
            )
        return ENGINES[engine]
    if value == "all":
        return None
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"mdl.members_per_fit={value!r}: must be all, auto, or an integer >= 1 (1 = one model per "
            f"fit, as mdl.engine=sequential; all = every member in one fit, as mdl.engine=stacked; auto = "
            f"as many as fit in the device's memory)"
        )
    return value


def engine_name(mdl: Any) -> str:
    """``stacked`` (all members in one fit), ``sequential`` (one per fit), ``fits of k`` or ``fits by memory``."""
    k = members_per_fit(mdl)
    if k == AUTO:
        return "fits by memory"
    if (
        k is None or k >= mdl["num_blocks"]
    ):  # a run has num_blocks members (one per boundary; the last is the final fit)
        return "stacked"
    return "sequential" if k == 1 else f"fits of {k}"


def canonical_fit_mode(mdl: dict[str, Any]) -> None:
    """In a plain config dict's ``mdl`` (changed in place), say how members are grouped in one way, so a run
    keeps its identity however it was asked for: ``mdl.engine=stacked`` and ``mdl.members_per_fit=all``
    are the same run, and so are runs made before ``members_per_fit`` existed."""
    k = members_per_fit(mdl)
    name = engine_name(mdl)
    mdl.pop("members_per_fit", None)
    several = name.startswith("fits ")
    mdl["engine"] = "stacked" if several else name
    if several:
        mdl["members_per_fit"] = k


# --- the learning rate's default: optimizer.lr_by_data, which conf/data held before ------------------

# Keys that only say where optimizer.lr came from (the lr a run trained with is optimizer.lr itself):
# the defaults table, and data.lr of runs made before the table moved from conf/data to conf/optimizer.
LR_SOURCES = ("optimizer.lr_by_data", "data.lr")


def canonical_lr_source(config: dict[str, Any]) -> None:
    """In a plain config dict (changed in place), put the data set's default lr back where runs made before
    the move had it (``data.lr``) and drop the table, so every run keeps its identity
    (tests/test_identity.py compares with the hashes of that code)."""
    by_data = (config.get("optimizer") or {}).pop("lr_by_data", None)
    data = config.get("data")
    if isinstance(by_data, dict) and isinstance(data, dict) and "lr" not in data and data.get("source") in by_data:
        data["lr"] = by_data[data["source"]]


MAP_ERASERS = (
    "leace",
    "qleace",
    "alf_qleace",
)  # fitted on the training split alone before eraser.fit_scope applied to them


def canonical_fit_scope(config: dict[str, Any]) -> None:
    """In a plain config dict (changed in place), drop ``eraser.fit_scope=split`` of an eraser in ``MAP_ERASERS``: that
    fit (the training split alone) is what runs made before the key existed did, so they keep their identity."""
    eraser = config.get("eraser")
    if isinstance(eraser, dict) and eraser.get("name") in MAP_ERASERS and eraser.get("fit_scope") == "split":
        eraser.pop("fit_scope")


def canonical_drop_path(config: dict[str, Any]) -> None:
    """In a plain config dict (changed in place), drop ``model.options.drop_path_rate`` when it is 0 (no stochastic
    depth): what ConvNeXt and Swin runs made before the option existed did, so they keep their identity."""
    options = (config.get("model") or {}).get("options")
    if isinstance(options, dict) and options.get("drop_path_rate") == 0:
        options.pop("drop_path_rate")


def canonical_swin_variant(config: dict[str, Any]) -> None:
    """In a plain config dict (changed in place), drop Swin's ``model.options.variant=timm`` and ``heads=null``: the
    model runs made before the keys existed built, so they keep their identity."""
    model = config.get("model") or {}
    options = model.get("options")
    if model.get("name") == "swin" and isinstance(options, dict) and options.get("variant") == "timm":
        options.pop("variant")
        if options.get("heads", "absent") is None:
            options.pop("heads")


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


OPTIONAL_KEYS = {"data": ("balance", "transform"), "optimizer": ("precondition",)}


def training_threads(cfg: DictConfig) -> int:
    """The CPU threads a run trains with: trainer.torch_threads, or the CPUs allocated to this process."""
    return int(cfg.trainer.get("torch_threads") or DEFAULT_THREADS)


def config_hash(cfg: DictConfig) -> str:
    """A short hash of the resolved config minus bookkeeping keys: the identity of a run. A run that
    trains on a CPU also carries its thread count: 1 and 2 threads give different numbers (sums are
    reduced in another order), so a run resumed or skipped with another count would mix them."""
    data = OmegaConf.to_container(cfg, resolve=True)
    if _trains_on_cpu(cfg):
        data["cpu_threads"] = training_threads(cfg)
    without_bookkeeping(data)  # where and how, not what
    canonical_fit_mode(data["mdl"])  # mdl.engine=stacked and mdl.members_per_fit=all: one run
    canonical_lr_source(data)  # the lr defaults table, where conf/data held it
    if not (data.get("probes") or {}).get("enabled", False):
        data.pop("probes", None)  # probes off: the hash runs had before the probes group existed
    if not data.get("callbacks"):
        data.pop("callbacks", None)  # none: the hash runs had before the callbacks group existed
    canonical_fit_scope(data)  # eraser.fit_scope=split of a map eraser: the runs made before the key existed
    canonical_swin_variant(data)  # the default Swin (timm): the runs made before model.options.variant existed
    canonical_drop_path(data)  # model.options.drop_path_rate=0: the runs made before the option existed
    if (data.get("protocol") or {}).get("name", "sound") == "sound":
        data.pop("protocol", None)  # the default loop: the hash runs had before the protocol group existed
    for group, keys in OPTIONAL_KEYS.items():
        for key in keys:
            if (data.get(group) or {}).get(key, "absent") is None:
                data[group].pop(key)  # off: the hash runs had before the option existed
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
