"""What a run prints before it trains: its config as the overrides that made it and a path to all of it
(``print_config=full`` prints it all, ``false`` nothing), and Python warnings as one line each, each once.
Light (no torch): launch.py calls it before the heavy imports."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mdl.run.identity import grouping

CONFIG_FILE = "config.yaml"  # the resolved config, in the run folder


def show_config(cfg: DictConfig, overrides: list[str], run_dir: Path) -> None:
    """The resolved config written to ``run_dir``/config.yaml, and printed as ``print_config`` says."""
    mode = cfg.get("print_config", "overrides")
    if mode is False:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    OmegaConf.save(cfg, path, resolve=True)
    if mode in (True, "full"):
        print(
            f"config ({path}; print_config=overrides shortens it, false hides it):\n{OmegaConf.to_yaml(cfg, resolve=True)}",
            flush=True,
        )
    else:
        print(
            f"config: {' '.join(overrides) or 'the defaults'} (all of it: {path}; print_config=full prints it)",
            flush=True,
        )


def one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    return f"warning: {message} ({category.__name__})\n"


HIDDEN_BY_DEFAULT = (
    DeprecationWarning,
    PendingDeprecationWarning,
    ImportWarning,
    ResourceWarning,
)  # Python's own choice


def one_line_warnings() -> None:
    """Warnings as ``warning: <message> (<category>)``, without the file, line and source line, and each message
    once per process (a sweep's jobs repeat them); those Python hides by default stay hidden, and ``python -W ...``
    keeps its own filters."""
    warnings.formatwarning = one_line_warning
    if not sys.warnoptions:
        warnings.simplefilter("once")
        for category in HIDDEN_BY_DEFAULT:
            warnings.simplefilter("ignore", category)


def final_line(results: dict[str, Any]) -> str:
    """The summary's line on the final fit (none under ``protocol.final_fit=false``)."""
    if results.get("final_val_loss") is None:
        return "final fit: none (protocol.final_fit=false: the blocks' fits only)"
    return f"final val loss: {results['final_val_loss']:.4f} nats"


def summary(results: dict[str, Any], path: Path) -> str:
    k = results["num_classes"]
    estimate = results.get("paper_loss", "val_min")  # a results.json without paper_loss measured val_min
    other = {"last_block": "val_min", "val_min": "last_block"}[estimate]
    fits = results.get("fits") or grouping(results["config"]["mdl"])  # a record written before it was named fits
    also = f"; {other}: {results[f'paper_mdl_{other}']:.4f}" if f"paper_mdl_{other}" in results else ""
    return (
        f"paper MDL: {results['paper_mdl']:.4f} bits/example ({estimate}, mdl.paper_loss{also}; "
        f"chance {math.log2(k) * sum(results['boundaries'][1:]) / results['boundaries'][-1]:.3f})\n"
        f"online code length: {results['online_codelength_bits']:.1f} bits = "
        f"{results['online_bits_per_example']:.4f} bits/example (uniform code {math.log2(k):.3f})\n"
        f"{final_line(results)}\n"
        f"fits: {fits} (mdl.members_per_fit={results.get('members_per_fit', 1)})\n"
        f"results: {path}"
    )
