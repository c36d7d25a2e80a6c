"""Where data sets live on disk, and the errors a user sees when one is missing or unreadable.

The default root is set in ``conf/data/*.yaml`` (``SLOWING_DATA_ROOT`` or
``~/.cache/slowing-learning/data``); Python only checks what it was given, so the message can
name the exact folder or file it looked at and how to fix it. Three kinds of failure, each a
subclass of the builtin error a caller would expect, so ``launch.py`` can print them as one
paragraph: missing (``FileNotFoundError``), unreadable (``PermissionError``) and read but wrong
(``ValueError``: truncated, wrong shape, labels out of range).
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DATA_ROOT_ENV = "SLOWING_DATA_ROOT"
OTHER_FOLDER = (
    f"To use another folder: set paths.data_root=/path/to/data (or data.options.root) on the command line or the "
    f"environment variable {DATA_ROOT_ENV}."
)


class MissingDataError(FileNotFoundError):
    """A data set is not where the configuration says; the message says how to get it."""


class UnreadableDataError(PermissionError):
    """A data file or folder exists but this process may not read it; the message names it."""


class BadDataError(ValueError):
    """A data file was read but holds something else than the format promises (truncated, wrong
    shape or dtype, labels out of range); the message names the file and how to replace it."""


class ChecksumError(BadDataError, RuntimeError):
    """Files that differ from the official MD5 sums (a RuntimeError too, as torchvision's own)."""


def data_root(root: str | os.PathLike | None, source: str) -> Path:
    """The configured data root as an absolute path (``~`` expanded)."""
    if root is None or str(root) == "":
        raise ValueError(
            f"data source {source!r} needs a data root: set paths.data_root=/path/to/data or the "
            f"environment variable {DATA_ROOT_ENV}"
        )
    return Path(os.path.expanduser(str(root))).absolute()


def missing_data(source: str, looked_in: Path, wanted: str, how: str) -> MissingDataError:
    """Build the error for a data set that is not on disk."""
    return MissingDataError(
        f"{source}: data set not found in {looked_in} (looked for {wanted}).\nTo get it: {how}\n{OTHER_FOLDER}"
    )


def bad_data(source: str, path: Path, problem: str, fix: str) -> BadDataError:
    """Build the error for a data file whose content is wrong."""
    return BadDataError(f"{source}: {path} {problem}. To fix it: {fix}.")


@contextmanager
def reading(source: str, path: Path, fix: str) -> Iterator[None]:
    """Turn operating-system errors raised while reading ``path`` into messages naming the file
    (``err.filename`` when the OS says which one) and ``fix``; our own errors pass through."""
    try:
        yield
    except (MissingDataError, UnreadableDataError, BadDataError):
        raise
    except OSError as err:
        culprit = Path(err.filename) if getattr(err, "filename", None) else path
        reason = err.strerror or str(err)
        if isinstance(err, PermissionError) or err.errno in (errno.EACCES, errno.EPERM):
            raise UnreadableDataError(
                f"{source}: cannot read {culprit} ({reason}). To fix it: give this user read access "
                f"(e.g. `chmod -R a+rX {culprit}`), or copy the data set to a folder you can read. {OTHER_FOLDER}"
            ) from err
        if isinstance(err, FileNotFoundError):
            raise MissingDataError(
                f"{source}: {culprit} disappeared while reading ({reason}). To fix it: {fix}."
            ) from err
        if isinstance(err, IsADirectoryError) or os.path.isdir(culprit):
            raise bad_data(source, culprit, "is a folder, expected a file", fix) from err
        raise bad_data(source, culprit, f"could not be read ({reason})", fix) from err


@contextmanager
def downloading(source: str, what: str, by_hand: str) -> Iterator[None]:
    """Turn a failed download (no network, DNS, proxy, HTTP error: ``data.options.download=true``)
    into a MissingDataError that says what was fetched from where and how to put the files by hand."""
    try:
        yield
    except (MissingDataError, UnreadableDataError, BadDataError):
        raise
    except Exception as err:  # urllib's URLError, requests' and huggingface_hub's errors: no common base
        if not _looks_like_network(err):
            raise
        raise MissingDataError(
            f"{source}: data.options.download=true could not fetch {what} ({type(err).__name__}: {err}). "
            f"This machine may have no network access (compute nodes often have none).\n"
            f"To get it by hand: {by_hand}; then run without data.options.download=true.\n{OTHER_FOLDER}"
        ) from err


def _looks_like_network(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a network failure rather than a bug or a disk error."""
    import urllib.error

    network_names = ("ConnectionError", "Timeout", "HTTPError", "LocalEntryNotFoundError", "OfflineModeIsEnabled")
    while err is not None:
        if isinstance(err, (urllib.error.URLError, ConnectionError, TimeoutError)):
            return True
        if any(name in type(err).__name__ for name in network_names):
            return True
        err = err.__cause__ or err.__context__
    return False
