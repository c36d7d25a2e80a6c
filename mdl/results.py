"""Run records: the results.json schema, atomic checksummed writes, the code version of a run.

An interrupted sweep loses nothing: every record is written to a temporary file and renamed into
place. Records the framework reads back to decide what to do (progress.json, the run store's
results.json) carry a SHA-256 of their content, so a truncated or edited one is detected and
redone instead of silently steering a resumed run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
RUN_CONFIG_FILE = "config.json"  # a run store entry's resolved config, written when the run starts
PROGRESS_FILE = "progress.json"  # a run store entry's finished blocks (mdl.engine.progress.write_progress)
FAILURE_FILE = (
    "failed.json"  # a run store entry's last attempt's error, until an attempt starts again (mdl.run.experiment)
)


@dataclass
class BlockResult:
    """One prequential step: a model fit on the first n_train examples, scored on the next n_eval."""

    n_train: int
    n_eval: int
    eval_bits: float  # -sum log2 p(y) over the next block
    val_bits_per_example: float  # lowest mean validation cross-entropy in bits (L(c_i) of paper_loss=val_min)
    epochs: int
    val_loss_curve: list[float] = field(default_factory=list)  # nats per epoch
    train_loss_curve: list[float] = field(default_factory=list)
    # the same weights' mean cross-entropy in bits on the last block (L(c_i) of paper_loss=last_block)
    heldout_bits_per_example: float | None = None
    best_after_epochs: int | None = None  # epochs of training behind the kept weights (0: the untrained model)
    val_accuracy_curve: list[float] = field(default_factory=list)  # fraction of validation right, per epoch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CHECKSUM_KEY = "sha256"
SOURCE_PACKAGES = ("erasure", "models", "datamodules", "mdl")


def recorded_epoch_cap(results: dict[str, Any]) -> int | None:
    """The epoch cap of a run's fits (config trainer.kwargs.max_epochs); None when there is none (or -1)."""
    kwargs = ((results.get("config") or {}).get("trainer") or {}).get("kwargs") or {}
    cap = kwargs.get("max_epochs")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def capped_fits(results: dict[str, Any], max_epochs: int | None = None) -> list[str]:
    """The fits of a run (``blocks`` and the final fit of results.json) that ended at the epoch cap rather than
    by early stopping: they may still have been improving, so their code lengths are those of under-trained
    models. ``max_epochs``: the cap, else read from the run's config."""
    cap = max_epochs if max_epochs is not None else recorded_epoch_cap(results)
    if cap is None or cap < 0:
        return []
    capped = [f"block {i + 1}" for i, b in enumerate(results.get("blocks") or []) if b.get("epochs", 0) >= cap]
    if (results.get("final_epochs") or 0) >= cap:
        capped.append("the final fit")
    return capped


class DamagedRecord(ValueError):
    """A JSON record that cannot be read or whose checksum does not match its content."""


def _digest(payload: dict[str, Any]) -> str:
    body = {k: v for k, v in payload.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def write_checked_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """``atomic_write_json`` with a SHA-256 of the content stored under ``"sha256"``."""
    return atomic_write_json(path, {**payload, CHECKSUM_KEY: _digest(payload)})


def read_checked_json(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``write_checked_json``; DamagedRecord if unreadable or altered."""
    try:
        payload = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedRecord(f"{path}: unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(payload, dict) or payload.get(CHECKSUM_KEY) != _digest(payload):
        raise DamagedRecord(f"{path}: checksum missing or wrong (truncated, edited or from an older version)")
    return payload


def code_version() -> str:
    """A short hash of the framework's own source files: what computed a result (erasure.files)."""
    from erasure.files import (
        source_digest,
    )  # here, not above: erasure's package imports torch, this module's readers need not

    return source_digest(SOURCE_PACKAGES)[:12]


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    """JSON (no NaN or infinity: they are not JSON), written atomically (erasure.files)."""
    from erasure.files import atomic_write

    text = json.dumps(payload, indent=2, allow_nan=False)
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def git_sha(repo: str | os.PathLike | None = None) -> str | None:
    """The code version of this run (with a '-dirty' suffix for uncommitted changes), or None."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")
