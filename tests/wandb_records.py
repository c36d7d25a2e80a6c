"""Read a W&B offline run file (run-*.wandb) back: the records W&B itself writes, for tests.

The format is W&B's datastore: a 7-byte header (":W&B", 0xBEE1, version 0) and then LevelDB-log
framing in 32 KiB blocks (per chunk: CRC32C, 2-byte length, type FULL/FIRST/MIDDLE/LAST), each record
a ``wandb_internal_pb2.Record`` protobuf. wandb >= 0.2x no longer ships a Python reader for it.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7


WRITTEN_WITHIN_S = 60.0  # W&B's writer may still be writing a finished run's file: how long to wait for its end


def records(path: str | Path):
    """Records of a W&B run file (.wandb), once W&B has written them all (its last record, ``exit``, is there: a run
    closed by ``finish`` may still be written by W&B's own process for a moment, longer on a loaded machine)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while True:
        try:
            found = list(_parse(Path(path).read_bytes()))
        except DecodeError:  # a record half written: read again
            if time.monotonic() > deadline:
                raise
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return iter(found)
        time.sleep(0.2)


def _parse(raw: bytes):
    """The records of a run file's bytes: a 7-byte header, then LevelDB-log framing in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    assert raw[:4] == b":W&B", raw[:7]
    pos, pending = HEADER, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        data = raw[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def run_record(path: str | Path):
    """The run's own record (group, display name, tags, job type)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def _updates(path: str | Path, kind: str) -> dict[str, object]:
    """The last value set for every key by the run file's ``kind`` records (summary or config), less those removed."""
    values: dict[str, object] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == kind:
            for item in getattr(r, kind).update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            for item in getattr(r, kind).remove:
                values.pop(item.key or "/".join(item.nested_key), None)
    return values


def summary(path: str | Path) -> dict[str, object]:
    """The run summary as W&B accumulates it."""
    return _updates(path, "summary")


def config(path: str | Path) -> dict[str, object]:
    """The run config as W&B accumulates it (top-level keys)."""
    return _updates(path, "config")


def artifacts(path: str | Path) -> dict[str, list[str]]:
    """Logged artifacts: name -> the files in it."""
    return {
        r.artifact.name: [m.path for m in r.artifact.manifest.contents]
        for r in records(path)
        if r.WhichOneof("record_type") == "artifact"
    }


def history(path: str | Path) -> list[dict[str, object]]:
    """The run's history rows (one per ``log`` call), each key with its value, W&B's own keys (``_step``...) included."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]
