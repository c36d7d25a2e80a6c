"""progress.json: the blocks a run has finished, so a re-launched job continues where it stopped.

One schema for every way of training: the block schedule and code version the blocks belong to,
and each finished block with its index (members may finish in any order in a stacked fit).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from mdl.results import DamagedRecord, code_version, read_checked_json, write_checked_json

log = logging.getLogger(__name__)


def finished_blocks(progress_path: Path, boundaries: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Blocks (index -> record) an earlier attempt of this run finished, if they can be trusted; else none.

    A damaged progress file, another block schedule or another code version means starting over
    (with a warning): a result is always computed by one version of the code. Checkpoints of the
    discarded attempt are removed with it.
    """
    if not progress_path.exists():
        return {}
    try:
        saved = read_checked_json(progress_path)
    except DamagedRecord as err:
        reason = str(err)
    else:
        if saved.get("boundaries") != list(boundaries):
            reason = f"its block schedule {saved.get('boundaries')} differs from {list(boundaries)}"
        elif saved.get("code_version") != code_version():
            reason = f"it was made by code version {saved.get('code_version')}, this is {code_version()}"
        else:
            done = dict(zip(saved["block_index"], saved["blocks"]))
            if done:
                log.info("resuming: %d of %d blocks already done", len(done), len(boundaries) - 1)
            return done
    log.warning("discarding the earlier progress of this run (%s); starting it over", reason)
    progress_path.unlink(missing_ok=True)
    for stale in progress_path.parent.glob("checkpoints/*.ckpt"):
        stale.unlink(missing_ok=True)
    return {}


def write_progress(path: Path, boundaries: Sequence[int], blocks: dict[int, dict[str, Any]]) -> None:
    """Record the finished blocks (index -> record), in block order."""
    order = sorted(blocks)
    write_checked_json(
        path,
        {
            "boundaries": list(boundaries),
            "code_version": code_version(),
            "block_index": order,
            "blocks": [blocks[i] for i in order],
        },
    )
