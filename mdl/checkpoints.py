"""How a run's resumable checkpoints are written and read.

One ``RunCheckpointIO`` per fit (a Lightning CheckpointIO plugin):

- loads onto the run's training device (``map_location``): a checkpoint written on a GPU resumes on
  that GPU, and one written on a CPU resumes on whatever device the run uses now;
- writes atomically, through a temporary file whose name is unique to the writer, then a rename:
  a kill leaves either the old file or the new one, and two writers never share a temporary;
- stores a SHA-256 of the payload in a short header and checks it on every read, so a truncated or
  bit-flipped checkpoint is detected (``is_intact``) and never silently changes a result.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

MAGIC = b"MDLCKPT1"
DIGEST_LEN = 64  # hex SHA-256


class DamagedCheckpoint(RuntimeError):
    """A checkpoint file whose checksum or header does not match its contents."""


def unique_temporary(path: Path) -> Path:
    """A sibling temporary name no other writer (process or thread) will use."""
    return path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def write_checksummed(path: Path, payload: bytes) -> None:
    """header (magic + SHA-256) + payload, written to a unique temporary and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_checksummed(path: Path) -> bytes:
    """The payload of a checksummed file; DamagedCheckpoint if the header or the digest is wrong."""
    blob = Path(path).read_bytes()
    head = len(MAGIC) + DIGEST_LEN
    if len(blob) < head or not blob.startswith(MAGIC):
        raise DamagedCheckpoint(f"{path}: not a checkpoint of this framework (missing header); it was truncated or written by another program")
    digest, payload = blob[len(MAGIC):head].decode(errors="replace"), blob[head:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise DamagedCheckpoint(f"{path}: checksum mismatch ({len(payload)} bytes); the file is damaged")
    return payload


def is_intact(path: Path) -> bool:
    try:
        read_checksummed(path)
    except (DamagedCheckpoint, OSError):
        return False
    return True


class RunCheckpointIO(TorchCheckpointIO):
    """Checksummed, atomic checkpoints loaded onto the training device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_checksummed(Path(path), buffer.getvalue())

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        payload = read_checksummed(Path(path))
        return torch.load(io.BytesIO(payload), map_location=self.device, weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        Path(path).unlink(missing_ok=True)
