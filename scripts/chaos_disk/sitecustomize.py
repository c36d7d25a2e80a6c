"""The chaos run's stand-in for a full disk where no small tmpfs can be mounted (scripts/chaos_sweep.py, without
root): in every Python process started with this folder on PYTHONPATH and ``CHAOS_DISK_FULL_FLAG`` set, while the
flag file exists, the project's one atomic write (erasure.files.atomic_write: results, progress, checkpoints, cache
entries, erasers) under ``CHAOS_DISK_ROOT`` raises ENOSPC, and ``shutil.disk_usage`` reports no free space there,
as a quota that is used up does. Standard library only; does nothing without the variable."""

from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import os
import shutil
import sys

FLAG = os.environ.get("CHAOS_DISK_FULL_FLAG")
ROOT = os.environ.get("CHAOS_DISK_ROOT", "/")


def _full(path: object) -> bool:
    return bool(FLAG) and os.path.exists(FLAG) and os.path.abspath(str(path)).startswith(ROOT)


def _patch_atomic_write(module) -> None:
    real = module.atomic_write

    def atomic_write(path, write):
        if _full(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, write)

    module.atomic_write = atomic_write


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``erasure.files`` as soon as it is executed, before any module imports its names."""

    def find_spec(self, name, path, target=None):
        if name != "erasure.files":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_atomic_write(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if FLAG:
    sys.meta_path.insert(0, _AfterImport())
    _real_usage = shutil.disk_usage

    def disk_usage(path):
        usage = _real_usage(path)
        return usage._replace(free=0) if _full(path) else usage

    shutil.disk_usage = disk_usage
