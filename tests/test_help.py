"""``python launch.py --help`` lists the groups a user chooses from (a line each, with their options) and the presets,
without importing torch; shell completion offers the presets in subfolders (``+experiment=paper/<TAB>``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import CONF, REPO, python_path
from mdl.run.help import GROUPS, INTERNAL_GROUPS


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path(), **(env or {})},
    )


def test_help_lists_the_groups_a_line_each_and_the_presets_without_torch() -> None:
    proc = launch("-X", "importtime", "launch.py", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    for group in GROUPS:
        assert f"\n  {group.ljust(15)}{GROUPS[group]}\n" in text, group
    assert "digits*" in text and "leace*" in text  # the defaults marked
    for preset in ("lr_search", "paper/table16", "paper/mlp_width"):
        assert f"\n  {preset} " in text, preset
    # the lr example says where the default comes from (it suggested 5e-4, where digits runs use 3e-3)
    assert "optimizer.lr=LR (default: the data set's" in text and "optimizer.lr=5e-4" not in text
    assert "optimizer.lr_by_data: cifar10 0.0005, cifarnet 0.0005, digits 0.003," in text
    for internal in ("_base", "common", "paths:", "cost:", "epoch_times", "== Config =="):
        assert internal not in text, internal
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time")
    }
    assert not imported & {"torch", "lightning", "erasure", "models", "datamodules"}  # what made it take 9 s


def test_every_config_group_is_described_or_internal() -> None:
    folders = {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"}
    assert folders == (set(GROUPS) | set(INTERNAL_GROUPS)) - {"hydra/launcher"}


def complete(line: str) -> list[str]:
    proc = launch("launch.py", "-sc", "query=bash", env={"COMP_LINE": line})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


@pytest.mark.slow
def test_presets_in_subfolders_tab_complete() -> None:
    assert "+experiment=paper/" in complete("python launch.py +experiment=")
    assert "+experiment=paper/table16" in complete("python launch.py +experiment=paper/t")
    assert complete("python launch.py +experiment=paper/table16/") == ["+experiment=paper/table16/smoke"]
    assert not [c for c in complete("python launch.py +experiment=paper/") if "common" in c]
    assert complete("python launch.py eraser=le") == ["eraser=leace"]  # Hydra's own completion unchanged


def test_the_help_page_is_built_only_when_asked(monkeypatch) -> None:
    """OmegaConf resolves ``hydra.help.template`` whenever Hydra composes a config: a run does not build the page
    (it reads every config group, about 0.09 CPU-s); ``--help`` and ``-h`` do."""
    from mdl.run import help, storage

    built = []
    monkeypatch.setattr(help, "help_text", lambda: built.append(sys.argv[1]) or "the page")
    for argv in (
        ["launch.py", "seed=1"],
        ["launch.py", "--help"],
        ["launch.py", "-m", "seed=1,2"],
        ["launch.py", "-h"],
    ):
        storage._help_text.cache_clear()
        monkeypatch.setattr(sys, "argv", argv)
        storage._help_text()
    storage._help_text.cache_clear()
    assert built == ["--help", "-h"]
