"""The software and hardware a run's numbers were computed with, and how two of them differ.

The same config gives other last bits under another torch build, BLAS kernel choice (the CPU capability
torch dispatches to), GPU, cuDNN or thread count. The environment is therefore recorded with every result
(results.json, the run store, W&B's config) but kept out of the config hash: the same run on two machines is
the same experiment. The store reuses a finished or partial run only where the environments match
(mdl.reuse_across_environments decides otherwise; mdl.run.experiment.Job.stored_results).
"""

from __future__ import annotations

import platform
import re
from typing import Any

ENVIRONMENT_KEY = "environment"  # its key in results.json and the store's config.json


def blas_name() -> str:
    """The BLAS torch was built against, as torch's build configuration names it (e.g. mkl, open)."""
    import torch

    match = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return match.group(1) if match else "unknown"


def current_environment(device: Any = "cpu", threads: int | None = None) -> dict[str, Any]:
    """What decides a run's last bits on ``device`` with ``threads`` CPU threads (None: torch's current count)."""
    import numpy
    import torch

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda if on_cuda else None,  # the build's CUDA matters only where the run used it
        "cudnn": torch.backends.cudnn.version() if on_cuda else None,
        "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
        "blas": blas_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads() if threads is None else int(threads),
    }


def environment_differences(stored: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """``key: stored -> current`` for every entry that differs; a record without an environment (made before
    environments were recorded) differs in everything, as ``unrecorded``."""
    if not stored:
        return ["environment: unrecorded -> recorded"]
    return [
        f"{key}: {stored.get(key)} -> {current.get(key)}"
        for key in sorted(set(stored) | set(current))
        if stored.get(key) != current.get(key)
    ]


def describe(environment: dict[str, Any] | None) -> str:
    """One short line for tables: torch, device, CPU kernels and threads."""
    if not environment:
        return "unrecorded"
    where = environment.get("gpu") or f"cpu/{environment.get('cpu_capability')}"
    return f"torch {environment.get('torch')} {where} {environment.get('threads')}t"
