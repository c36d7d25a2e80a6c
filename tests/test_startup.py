"""``python launch.py`` prints its first line before torch, lightning or matplotlib is imported: every step launch.py
takes before that line (its own imports, the resolvers, the config checks, the config shown) imports none of them,
for a single run and for a packed sweep's config. Each case runs in a fresh interpreter, whose ``sys.modules`` holds
only what these steps imported (this one's holds torch: conftest imports it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONF, REPO, python_path, run_python

HEAVY = ("torch", "lightning", "matplotlib")  # each takes seconds to import; none is needed to check a config

# What launch.py does before its first line, on a config composed as conftest.compose_config composes it (not
# imported here: conftest imports torch).
BEFORE_THE_FIRST_LINE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import launch  # its module-level imports and register_resolvers()
    from hydra import compose, initialize_config_dir
    from mdl.run.config_checks import check_before_imports
    from mdl.run.console import one_line_warnings, show_config

    conf, run_dir, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    one_line_warnings()
    check_before_imports(cfg)
    show_config(cfg, overrides, run_dir)
    print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
    """
)


@pytest.mark.parametrize("overrides", [[], ["hydra/launcher=packed"]], ids=["default", "packed"])
def test_the_config_is_checked_and_shown_without_torch_lightning_or_matplotlib(
    overrides: list[str], tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BEFORE_THE_FIRST_LINE, str(CONF), str(tmp_path / "run"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *shown, modules = proc.stdout.strip().splitlines()
    assert any(line.startswith("config: ") for line in shown), proc.stdout
    imported = set(json.loads(modules))
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


# launch.py --help with Hydra's help listing made to fail: Hydra's app_help lists every option of every config group
# (3 s on a quiet machine) for template fields the help does not show, before it renders the help.
HELP_WITHOUT_GROUP_LISTING = textwrap.dedent(
    """
    import runpy, sys
    import hydra._internal.hydra as hydra_internal

    def listed(*args, **kwargs):
        raise AssertionError("Hydra listed every config group")

    hydra_internal.Hydra.format_config_groups = listed
    sys.argv = ["launch.py", *sys.argv[1:]]
    runpy.run_path("launch.py", run_name="__main__")
    """
)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_printed_without_hydra_listing_every_config_group(flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_GROUP_LISTING, flag],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path()},
    )
    assert proc.returncode == 0 and "listed every config group" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.startswith("python launch.py [group=option ...]") and "submitit_slurm" in proc.stdout


# The training code's import as launch.py and the packed launcher make it (mdl.run.imports.imports_frozen), then the
# availability checks and the packages themselves, in a fresh interpreter.
TRAINING_IMPORT = textwrap.dedent(
    """
    import json, sys
    from mdl.run.imports import imports_frozen

    with imports_frozen():
        from mdl.run.experiment import run_experiment
    imported = sorted(name for name in ("matplotlib", "scipy", "torchvision") if name in sys.modules)
    from lightning_utilities.core.imports import RequirementCache, package_available

    from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE  # asked during lightning's import

    truth = [package_available("scipy"), bool(RequirementCache("matplotlib")), bool(RequirementCache("torchvision>=0.1"))]
    truth.append(bool(_TORCHVISION_AVAILABLE))
    import matplotlib.pyplot, scipy.stats, torchvision.models

    print(json.dumps({"imported": imported, "truth": truth}))
    """
)


def test_the_training_code_imports_without_torchmetrics_extras_and_they_import_afterwards() -> None:
    """lightning imports torchmetrics whole, which imports scipy.signal, torchvision.models and matplotlib.pyplot for
    metrics this framework never computes (1-2.5 CPU-s of every process's start-up on 2 cores); they stay out of the
    training code's import, and afterwards every availability check answers the truth and they import as usual."""
    proc = run_python(TRAINING_IMPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"imported": [], "truth": [True, True, True, True]}, seen


def test_the_original_schedule_is_solved_without_importing_scipy() -> None:
    """protocol=original's chunk ratio (mdl.schedule.brent_root) costs no scipy.optimize import, about 0.6 CPU-s of
    every run's start-up."""
    code = "import sys; from mdl.schedule import block_boundaries; b = block_boundaries(1197, 5, 128, 'oric'); "
    proc = run_python(code + "print(b, sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[128, 297, 519, 812, 1197] []", proc.stdout
