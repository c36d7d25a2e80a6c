"""The one definition of the settings that say where or how a run is done, not what it computes.

They are left out of a run's identity (its config hash: mdl/experiment.py ``config_hash``, which
decides skip-if-done and resume), the report does not split cells on them (mdl/report_runs.py), and W&B
run names leave them out (mdl/run_logging.py). Hydra's job folder names leave the same ones out
(``hydra.job.config.override_dirname.exclude_keys`` in conf/config.yaml; tests/test_identity.py checks
the two agree). Light: no torch, so the report and the sweep tools import it cheaply.

Not among them: the resolved ``mdl.engine`` (the engines' numbers differ in the last bits), and on a CPU
the thread count (``cpu_threads`` is added to the identity: 1 and 2 threads reduce sums in other orders).
"""

from __future__ import annotations

from typing import Any

BOOKKEEPING_KEYS = (
    # where things go and how they are recorded
    "paths", "logger", "hydra", "skip_if_done", "print_config", "data.cache_dir",
    # where and how a data set is fetched (not what it holds)
    "data.options.root", "data.options.download",
    # how fast or how often
    "mdl.checkpoint_every_s", "mdl.default_engine", "mdl.steps_per_group", "mdl.lock_lease_s",
    "trainer.torch_threads", "trainer.threads_by_engine", "trainer.profiler",
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
