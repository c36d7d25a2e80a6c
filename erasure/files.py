"""Files written whole or not at all, and the digests that say what made them: the project's one atomic
write (results and progress records, checkpoints, cache entries, saved erasers) and its code digest.

It sits in the bottom layer, beside the erasers, because every layer writes files (an eraser's own
``save`` too) and erasure/ may import nothing above it. Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent  # the repository: the source packages' parent


def file_mode() -> int:
    """The permissions a plain ``open`` would give (0666 less the umask): a temporary from ``mkstemp`` is
    0600, so a renamed one would keep others of a shared cache or run folder out."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temporary_sibling(path: Path) -> Path:
    """A new empty file next to ``path`` that no other writer (process or thread) uses:
    ``.<name>.<pid>.<random>.tmp`` (the pid tells a killed writer's leftovers from a live one's)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Write ``path`` through ``write(temporary)``, flushed to disk, then renamed over ``path``: a reader sees
    the old file or the new one, never a part. The temporary is removed if anything fails, and an OS error
    without a file name (a full disk fails in ``write()``) is raised again naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except OSError as err:
        if err.filename is None:
            raise type(err)(err.errno, err.strerror or str(err), str(path)) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=None)
def source_digest(packages: tuple[str, ...]) -> str:
    """SHA-256 (hex) over the relative path and bytes of every .py file of these top-level packages: which
    code made something. Unlike a git sha it changes with uncommitted edits and exists outside a git checkout.
    The run's code version (``mdl.results.code_version``) digests every package; the erasure cache
    digests the packages that make its files (erasure/ and datamodules/)."""
    h = hashlib.sha256()
    for package in packages:
        for file in sorted((ROOT / package).rglob("*.py")):
            h.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()
