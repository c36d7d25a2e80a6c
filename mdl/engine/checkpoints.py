"""How a run's resumable checkpoints are written and read.

One ``RunCheckpointIO`` per fit (a Lightning CheckpointIO plugin):

- loads onto the run's training device (``map_location``): a checkpoint written on a GPU resumes on
  that GPU, and one written on a CPU resumes on whatever device the run uses now;
- writes atomically, through a temporary file whose name is unique to the writer, then a rename:
  a kill leaves either the old file or the new one, and two writers never share a temporary;
- stores a SHA-256 of the payload in a short header and checks it on every read, so a truncated or
  bit-flipped checkpoint is detected (``read_checksummed`` raises ``DamagedCheckpoint``) and never silently changes a result;
- records in that header a stamp of what wrote it (the code version and the run's config hash,
  ``run_stamp``): a checkpoint left by other code or another run is never resumed (``resumable``).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from erasure.files import atomic_write_bytes, sha256_hex

log = logging.getLogger(__name__)
MAGIC = b"MDLCKPT2"  # MDLCKPT1 files (no stamp) were written by older code: never resumed
DIGEST_LEN = 64  # hex SHA-256
IDENTITY_LEN_BYTES = 4


class DamagedCheckpoint(RuntimeError):
    """A checkpoint file whose checksum or header does not match its contents."""


def write_checksummed(path: Path, payload: bytes, stamp: str = "") -> None:
    """magic + SHA-256 + stamp + payload (the digest covers both), written atomically (erasure.files)."""
    ident = stamp.encode()
    body = len(ident).to_bytes(IDENTITY_LEN_BYTES, "big") + ident + payload
    atomic_write_bytes(path, MAGIC + sha256_hex(body).encode() + body)


def read_checksummed(path: Path) -> bytes:
    """The payload of a checksummed file; DamagedCheckpoint if the header or the digest is wrong."""
    return _read(path)[1]


def read_stamp(path: Path) -> str:
    """The stamp a checksummed file was written with (DamagedCheckpoint if it is damaged)."""
    return _read(path)[0]


def _read(path: Path) -> tuple[str, bytes]:
    blob = Path(path).read_bytes()
    head = len(MAGIC) + DIGEST_LEN
    if len(blob) < head + IDENTITY_LEN_BYTES or not blob.startswith(MAGIC):
        raise DamagedCheckpoint(
            f"{path}: not a checkpoint of this version of the framework (missing header); it was "
            f"truncated, written by another program or by older code"
        )
    digest, body = blob[len(MAGIC) : head].decode(errors="replace"), blob[head:]
    if sha256_hex(body) != digest:
        raise DamagedCheckpoint(f"{path}: checksum mismatch ({len(body)} bytes); the file is damaged")
    n = int.from_bytes(body[:IDENTITY_LEN_BYTES], "big")
    return body[IDENTITY_LEN_BYTES : IDENTITY_LEN_BYTES + n].decode(), body[IDENTITY_LEN_BYTES + n :]


def run_stamp(run_dir: Path) -> str:
    """What a run's checkpoints must have been written by: this code version and this run (the run
    directory in the store is named by the config hash)."""
    from mdl.results import code_version

    return f"code {code_version()} run {Path(run_dir).name}"


def resumable(checkpoint: Path, stamp: str) -> str | None:
    """The checkpoint to resume from, if there is an intact one written with ``stamp``; a damaged
    one, or one written by other code or another run, is removed with a warning (the fit starts over).
    Temporaries of killed writes of this checkpoint (``erasure.files.temporary_sibling``) are removed first: the caller
    holds the run's lock (mdl.run.storage.run_lock), so no other writer of them can be alive."""
    stale = sorted(checkpoint.parent.glob(f".{checkpoint.name}.*.tmp"))
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    if stale:
        log.warning("removed %d temporary file(s) of killed checkpoint writes next to %s", len(stale), checkpoint)
    if not checkpoint.exists():
        return None
    try:
        written_by = read_stamp(checkpoint)
    except (DamagedCheckpoint, OSError) as err:
        log.warning("discarding damaged checkpoint %s (%s); this fit starts over", checkpoint, err)
        checkpoint.unlink(missing_ok=True)
        return None
    if written_by != stamp:
        log.warning(
            "discarding checkpoint %s: it was written by %s, this is %s; this fit starts over",
            checkpoint,
            written_by or "unknown code",
            stamp,
        )
        checkpoint.unlink(missing_ok=True)
        return None
    log.info("resuming fit from %s", checkpoint)
    return str(checkpoint)


class RunCheckpointIO(TorchCheckpointIO):
    """Checksummed, atomic checkpoints loaded onto the training device, stamped with ``stamp``."""

    def __init__(self, device: torch.device | str, stamp: str = "") -> None:
        self.device = torch.device(device)
        self.stamp = stamp

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_checksummed(Path(path), buffer.getvalue(), self.stamp)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        payload = read_checksummed(Path(path))
        return torch.load(io.BytesIO(payload), map_location=self.device, weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        Path(path).unlink(missing_ok=True)
