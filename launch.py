"""The one entry point: python launch.py [overrides], or python launch.py -m for sweeps."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mdl.run.config_checks import check_before_imports, retired_key_error
from mdl.run.console import one_line_warnings, show_config, summary
from mdl.run.exits import ends_like_a_run
from mdl.run.imports import imports_frozen
from mdl.run.storage import register_resolvers


register_resolvers()  # before Hydra resolves the config (job folder names)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run (or, under ``-m``, one job of a sweep): check the config before torch is imported, so a wrong
    value fails in a second, print it, then run it (or ``debug=overfit``'s check instead). Returns the paper MDL,
    which Hydra's sweepers can optimise; a user error exits 2 with one line, as every launcher's job does."""
    startup = {STARTUP[0]: time.perf_counter()}  # where start-up went, for debug=profile (mdl.run.phases)
    hc = HydraConfig.get()
    one_line_warnings()
    run_dir = Path(hc.runtime.output_dir)
    if hc.runtime.choices.get("debug") and hc.runtime.choices.get("experiment"):
        print(
            f"warning: +experiment={hc.runtime.choices['experiment']} is applied after debug={hc.runtime.choices['debug']}: "
            "the preset's values win; for a quick smoke use the preset's smoke version or set the keys on the command line",
            file=sys.stderr,
            flush=True,
        )
    try:
        check_before_imports(cfg)  # a wrong value fails in a second, not after torch's import and the data's load
    except (ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    show_config(cfg, list(hc.overrides.task), run_dir)  # first, before the seconds torch and lightning take to import
    print(f"run: {run_dir} (loading torch and lightning)", flush=True)
    startup[STARTUP[1]] = time.perf_counter()

    with imports_frozen():  # after Hydra parsed the command line
        from mdl.run.experiment import quiet_lightning, run_experiment
    from mdl.results import RESULTS_FILE

    startup[STARTUP[2]] = time.perf_counter()
    quiet_lightning()
    if cfg.get("overfit_one_batch"):  # debug=overfit: a check, not a run (mdl.run.debug_checks)
        from mdl.run.debug_checks import overfit_one_batch

        with ends_like_a_run():
            check = overfit_one_batch(cfg, cfg.overfit_one_batch)
        print(check.describe(), flush=True)
        if not check.fits:
            sys.exit(1)
        return None
    with ends_like_a_run():  # a user error: one line, exit 2; preemption: exit 143 (as every packed job ends)
        results = run_experiment(cfg, run_dir, overrides=list(hc.overrides.task), startup=startup)
    print(summary(results, run_dir / RESULTS_FILE), flush=True)
    return results["paper_mdl"]


STARTUP = (  # launch.py's start-up phases, each ending where main() stamps it
    "start-up: Python, Hydra, composing the config",
    "start-up: checking and printing the config",
    "start-up: importing torch, lightning and the framework",
)


def without_null_groups(argv: list[str]) -> list[str]:
    """``logger=null`` (the template's way to turn a group off) as Hydra 1.3 spells it, ``~logger``:
    Hydra refuses a null group choice with a ValueError."""
    return [
        f"~{a.split('=', 1)[0]}" if a.split("=", 1)[0] in NULLABLE_GROUPS and a.split("=", 1)[1:] == ["null"] else a
        for a in argv
    ]


NULLABLE_GROUPS = ("logger",)


def refuse_retired_overrides(argv: list[str]) -> None:
    """An override of a key that no longer exists (``mdl.engine=stacked``) names its replacement; Hydra would only
    say that the key is not in the config."""
    for arg in argv:
        why = retired_key_error(arg)
        if why is not None:
            print(f"error: {arg}: {why}", file=sys.stderr, flush=True)
            sys.exit(2)


def compose_once(argv: list[str]) -> None:
    """Hydra 1.3 composes the whole config twice per launch: first only to read ``hydra.mode``, then for the run.
    No file in conf/ sets ``hydra.mode`` (tests/test_cli.py checks), so unless the command line does, the first
    compose is skipped: ``-m`` or its absence decides, as Hydra decides when the mode is unset. A launch
    then starts 0.25-0.5 CPU-s sooner (one compose of the default config). A config of the user's own (``-cd``,
    ``-cn``, ``hydra.searchpath``) keeps Hydra's probe."""
    if not any(
        a.lstrip("+~").startswith(("hydra.mode", "hydra.searchpath", "--con")) or a.split("=")[0] in CONFIG_FLAGS
        for a in argv
    ):
        from hydra._internal.hydra import Hydra

        Hydra.get_mode = lambda self, config_name, overrides: None  # None: RUN, or MULTIRUN under -m


CONFIG_FLAGS = ("-cd", "-cp", "-cn")  # and --config-dir, --config-path, --config-name or any prefix of them ("--con")


if __name__ == "__main__":
    sys.argv = sys.argv[:1] + without_null_groups(sys.argv[1:])
    refuse_retired_overrides(sys.argv[1:])
    compose_once(sys.argv[1:])
    if {"--help", "-h"} & set(sys.argv[1:]):
        from mdl.run.help import print_help

        print_help()  # in a second: Hydra's own --help lists every option of every group first (seconds)
        sys.exit(0)
    if {"-sc", "--shell-completion"} & set(sys.argv):
        from mdl.run.help import complete_nested_options

        complete_nested_options()  # +experiment=paper/<TAB>
    main()
