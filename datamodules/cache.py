"""On-disk cache of fitted erasers and erased splits, shared by every job of a sweep.

Files are named by a hash of what determines their content (source config, split, eraser
config, format version and the code of erasure/ and datamodules/; see ``cache_key``). Each file is one safetensors file whose metadata
holds a checksum of its tensors and of the rest of its metadata (a flipped bit in the header could
otherwise rename an eraser's field); a file that fails to load or to match its checksum is reported
and rebuilt. Writers take a per-key file lock and write to a temporary name then rename, so
concurrent jobs build each key once and a reader never sees half a file. (If the lock is not
honoured, e.g. on some network file systems, the rename still keeps every file whole; at worst
two jobs build the same key.)

Temporary names carry the writer's pid and a random part (``.<file>.<pid>.<random>.tmp``; safetensors
writes its own ``.tmpXXXXXX`` inside that). A job killed while writing leaves its temporary behind (as
large as the erased data set): the next access removes temporaries older than ``stale_after_s`` whose key
is not locked, and safetensors' own at once when no key of the folder is locked (else once as old). A folder that
cannot be written (read-only, no permission, disk full) stops the run with one message naming
it and the settings that move or disable the cache; partial files are removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
import warnings
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor

from erasure.files import source_digest
from erasure import Eraser, load_eraser
from erasure.base import save_safetensors

CACHE_FORMAT_VERSION = 2  # 2: the checksum covers the metadata, not only the tensors


STALE_AFTER_S = 3600.0  # a temporary this old whose key is unlocked belongs to a dead writer
# .<key>.<kind>.safetensors.<pid>.<random>.tmp (older versions: .<name>.<random>.tmp / .raw)
TEMPORARY = re.compile(r"^\.+(?P<target>[0-9a-f]{32}\.(?:eraser|data|partial)\.safetensors)\..*\.(?:tmp|raw)$")
# safetensors' own temporary (``save_file`` writes ``.tmpXXXXXX`` next to its target, then renames it): no key in its name
SAFETENSORS_TEMPORARY = re.compile(r"^\.tmp[A-Za-z0-9_]{6}$")


class CorruptCacheFile(Exception):
    """A cache file that cannot be trusted (truncated, bit rot, other format version)."""


class CacheWriteError(OSError):
    """The cache folder cannot be written; the message names it and how to move or disable it."""


FIX = (
    "set data.cache_dir=/a/writable/folder to move the cache (or paths.cache_dir / $SLOWING_CACHE_DIR), "
    "or data.cache_dir=null to run without it"
)


@contextmanager
def cache_writes(folder: Path) -> Iterator[None]:
    """Turn an OS error while writing into the cache folder into one message with the fix."""
    try:
        yield
    except CacheWriteError:
        raise
    except OSError as err:
        what = {
            errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
        }.get(err.errno or -1, err.strerror or str(err))
        culprit = getattr(err, "filename", None)
        where = f" ({culprit})" if culprit and Path(culprit) != folder else ""
        raise CacheWriteError(
            f"erasure cache: cannot write to {folder}: {what}{where}. To fix it: {FIX}. Partial files were removed."
        ) from err


def remove_stale_temporaries(folder: Path, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete temporaries older than ``stale_after_s`` whose key no writer holds locked (their
    writer was killed); return what was removed. Errors are ignored: this is housekeeping."""
    from filelock import FileLock, Timeout

    removed: list[Path] = []
    now = time.time()
    idle = None  # whether no writer holds any key of the folder (then safetensors' temporaries are dead, whatever their age)
    with suppress(OSError):
        for entry in os.scandir(folder):
            match = TEMPORARY.match(entry.name)
            with suppress(OSError):
                if SAFETENSORS_TEMPORARY.match(entry.name) and entry.is_file():
                    idle = _no_writer(folder) if idle is None else idle
                    if idle or now - entry.stat().st_mtime >= stale_after_s:
                        os.unlink(entry.path)
                        removed.append(Path(entry.path))
                    continue
                if match is None or not entry.is_file() or now - entry.stat().st_mtime < stale_after_s:
                    continue
                try:
                    owner = match["target"].replace(
                        ".partial.", ".eraser."
                    )  # a partial fit is written under its eraser's lock
                    with FileLock(str(folder / f"{owner}.lock"), timeout=0):
                        os.unlink(entry.path)
                        removed.append(Path(entry.path))
                except Timeout:
                    continue  # a live writer holds the key: its temporary is in use
    if removed:
        warnings.warn(
            f"erasure cache: removed {len(removed)} temporary file(s) left in {folder} by killed jobs",
            RuntimeWarning,
            stacklevel=3,
        )
    return removed


def _no_writer(folder: Path) -> bool:
    """Whether no process holds any key's lock in ``folder`` (each lock tried without waiting)."""
    from filelock import FileLock, Timeout

    for lock in folder.glob("*.lock"):
        try:
            with FileLock(str(lock), timeout=0):
                pass
        except Timeout:
            return False
    return True


# The code that makes the cached files: eraser fits and the splits they are fitted on and applied to.
ERASURE_CODE_PACKAGES = ("erasure", "datamodules")


def cache_key(**parts: Any) -> str:
    """Stable hash of JSON-able parts (dict order does not matter), the cache format version and the
    digest of the code that makes the files (an edit to an eraser gives new keys, not stale data)."""
    payload = json.dumps(
        {"cache_format_version": CACHE_FORMAT_VERSION, "erasure_code": source_digest(ERASURE_CODE_PACKAGES), **parts},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def file_checksum(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> str:
    """blake2b over the tensors' names, dtypes, shapes and bytes, in name order, then over the
    metadata (every entry but the checksum itself), in key order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    described = {k: v for k, v in metadata.items() if k != "checksum"}
    digest.update(json.dumps(described, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def write_checked(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """Write tensors and metadata with their checksum, atomically (erasure.files); an OS error (full disk, read-only
    folder) becomes ``CacheWriteError``."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {**metadata, "cache_format_version": str(CACHE_FORMAT_VERSION)}
    meta["checksum"] = file_checksum(tensors, meta)
    with cache_writes(path.parent):  # a full disk: OSError (save_file_as_oserror), so cache_writes explains it
        save_safetensors(path, tensors, meta)


def read_checked(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Load a file written by ``write_checked``; raise ``CorruptCacheFile`` if it cannot be trusted."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise CorruptCacheFile(f"cannot read {path}: {err}") from err
    if meta.get("cache_format_version") != str(CACHE_FORMAT_VERSION):
        raise CorruptCacheFile(
            f"{path} has cache format {meta.get('cache_format_version')}, expected {CACHE_FORMAT_VERSION}"
        )
    if file_checksum(tensors, meta) != meta.get("checksum"):
        raise CorruptCacheFile(f"{path}: checksum mismatch (file damaged)")
    return tensors, meta


@dataclass
class CacheStats:
    hits: int = 0
    builds: int = 0
    rebuilt_corrupt: int = 0


class ErasureCache:
    """Get-or-build for fitted erasers and erased tensors under ``directory`` (None: no caching)."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        lock_timeout_s: float = 6 * 3600,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.directory = Path(os.path.expanduser(str(directory))).absolute() if directory else None
        self.lock_timeout_s = lock_timeout_s
        self.stale_after_s = stale_after_s
        self.stats = CacheStats()
        self._swept = False

    def eraser_path(self, key: str) -> Path | None:
        return self.directory / f"{key}.eraser.safetensors" if self.directory else None

    def data_path(self, key: str) -> Path | None:
        return self.directory / f"{key}.data.safetensors" if self.directory else None

    def partial_path(self, key: str) -> Path | None:
        """Where a resumable fit of the eraser ``key`` keeps its state until the eraser is stored
        (datamodules.fit_progress); written only under the eraser's lock."""
        return self.directory / f"{key}.partial.safetensors" if self.directory else None

    def eraser(self, key: str, fit: Callable[[], Eraser], describe: Mapping[str, Any] | None = None) -> Eraser:
        """The eraser cached under ``key``, fitted by ``fit()`` (once, across processes) if absent."""
        path = self.eraser_path(key)
        if path is None:
            self.stats.builds += 1
            return fit()

        def load() -> Eraser:
            read_checked(path)  # checksum first: load_eraser alone would accept flipped bits (in data or header)
            return load_eraser(path)

        def build() -> Eraser:
            eraser = fit()
            tensors, meta = eraser.serialized()
            meta["describe"] = json.dumps(describe or {}, sort_keys=True, default=str)
            write_checked(path, tensors, meta)
            partial = self.partial_path(key)
            assert partial is not None
            with cache_writes(path.parent):
                partial.unlink(missing_ok=True)  # the fit's partial state: done with once the eraser is stored
            return eraser

        return self._get_or_build(path, load, build)

    def tensors(
        self,
        key: str,
        build: Callable[[], tuple[Mapping[str, Tensor], Mapping[str, Any]]],
        describe: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(tensors on the CPU, JSON info) cached under ``key``; ``build()`` runs (once) if absent."""
        path = self.data_path(key)
        if path is None:
            self.stats.builds += 1
            tensors, info = build()
            return dict(tensors), dict(info)

        def load() -> tuple[dict[str, Tensor], dict[str, Any]]:
            tensors, meta = read_checked(path)
            return tensors, json.loads(meta.get("info", "{}"))

        def make() -> tuple[dict[str, Tensor], dict[str, Any]]:
            built, info = build()
            tensors = {k: v.detach().cpu().contiguous() for k, v in built.items()}
            meta = {"describe": json.dumps(describe or {}, sort_keys=True, default=str), "info": json.dumps(dict(info))}
            write_checked(path, tensors, meta)
            return tensors, dict(info)

        return self._get_or_build(path, load, make)

    def _get_or_build(self, path: Path, load: Callable[[], Any], build: Callable[[], Any]) -> Any:
        from filelock import FileLock, Timeout

        self._sweep(path.parent)
        if path.exists():  # fast path: a complete file never needs the lock (writes are renames)
            try:
                result = load()
                self.stats.hits += 1
                return result
            except CorruptCacheFile as err:
                warnings.warn(f"erasure cache: {err}; rebuilding it", RuntimeWarning, stacklevel=3)
        lock = FileLock(str(path) + ".lock", timeout=self.lock_timeout_s)
        try:
            with cache_writes(path.parent):  # checked before the (long) build: the lock file is a write
                path.parent.mkdir(parents=True, exist_ok=True)
                lock.acquire()
        except Timeout as err:
            raise CacheWriteError(
                f"erasure cache: waited {self.lock_timeout_s:.0f} s for {lock.lock_file}, held by another job "
                f"building the same entry; if no job is running, delete that file, or {FIX}"
            ) from err
        try:
            if path.exists():  # another job may have built (or rebuilt) it while we waited
                try:
                    result = load()
                    self.stats.hits += 1
                    return result
                except CorruptCacheFile:
                    with cache_writes(path.parent):
                        path.unlink()
                    self.stats.rebuilt_corrupt += 1
            result = build()
            self.stats.builds += 1
            return result
        finally:
            lock.release()

    def _sweep(self, folder: Path) -> None:
        """Remove dead writers' temporaries, once per cache object (see the module docstring)."""
        if not self._swept:
            self._swept = True
            if folder.is_dir():
                remove_stale_temporaries(folder, self.stale_after_s)
