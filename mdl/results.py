"""Run records: the results.json schema and atomic writes (an interrupted sweep loses nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"


@dataclass
class BlockResult:
    """One prequential step: a model fit on the first n_train examples, scored on the next n_eval."""

    n_train: int
    n_eval: int
    eval_bits: float  # -sum log2 p(y) over the next block
    val_bits_per_example: float  # mean held-out cross-entropy in bits (the paper's L(c_i))
    epochs: int
    val_loss_curve: list[float] = field(default_factory=list)  # nats per epoch
    train_loss_curve: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write JSON to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def git_sha(repo: str | os.PathLike | None = None) -> str | None:
    """The code version of this run (with a '-dirty' suffix for uncommitted changes), or None."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")
