"""Where data sets live on disk, and the error a user sees when one is missing.

The default root is set in ``conf/data/*.yaml`` (``SLOWING_DATA_ROOT`` or
``~/.cache/slowing-learning/data``); Python only checks what it was given, so the message can
name the exact folder it looked in and how to fill it.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ROOT_ENV = "SLOWING_DATA_ROOT"


class MissingDataError(FileNotFoundError):
    """A data set is not where the configuration says; the message says how to get it."""


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
        f"{source}: data set not found in {looked_in} (looked for {wanted}).\n"
        f"To get it: {how}\n"
        f"To use another folder: set paths.data_root=/path/to/data (or data.options.root) on the command line or the environment "
        f"variable {DATA_ROOT_ENV}."
    )
