"""A digest of this framework's own source files: which code computed something.

Unlike a git sha it changes with uncommitted edits and exists outside a git checkout. The run's
code version (mdl/results.py ``code_version``) digests every package; the erasure cache digests the
packages that make its files (erasure/ and datamodules/), so erased data made by older eraser code is
never served to newer code.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def source_digest(packages: tuple[str, ...]) -> str:
    """SHA-256 (hex) over the relative path and bytes of every .py file of these top-level packages."""
    h = hashlib.sha256()
    for package in packages:
        for file in sorted((ROOT / package).rglob("*.py")):
            h.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()
