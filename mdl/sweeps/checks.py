"""Checks that stop a sweep before any job is submitted, with a message that says what to fix.

Hydra already rejects an unknown key under ``hydra.launcher`` when it is given as an override
(``hydra.launcher.gpus=1``) or in a YAML file extending ``submitit_slurm`` (structured-config
error, before anything runs). It does not reject ``+hydra.launcher.gpus=1``, a launcher YAML
without the typed defaults, bad values from environment variables (seen only when the launcher
is built) or a missing ``sbatch`` (seen only when the first job is submitted, after the sweep
directory is made). ``LauncherChecks`` is a Hydra callback that runs in the launching process
(``on_multirun_start``, before the sweeper and launcher exist) and catches all of these; with
``sbatch`` present it also asks Slurm (``sbatch --test-only``) whether the requested resources
can ever be granted, so an impossible request fails now instead of pending forever.

Hydra 1.3 turns an exception raised in a callback into a warning and carries on
(hydra/_internal/callbacks.py, ``_notify``), so the callback ends the process with
``SystemExit(message)`` instead: exit status 1, the message on stderr, nothing submitted.

Register it in conf/config.yaml::

    hydra:
      callbacks:
        launcher_checks:
          _target_: mdl.sweeps.checks.LauncherChecks
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
LOCAL_LAUNCHER = (
    "hydra_plugins.mdl_local.local_launcher.LocalLauncher"  # hydra/launcher=local: the plugin's, ending as a run
)
PLUGIN_LOCAL_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
PACKED_LAUNCHER = "hydra_plugins.mdl_packed.packed_launcher.PackedLauncher"  # hydra/launcher=packed
PACKED_SLURM_LAUNCHER = (
    "hydra_plugins.mdl_packed.packed_slurm_launcher.PackedSlurmLauncher"  # =packed_slurm: slurm's keys
)
PACKING_LAUNCHERS = (PACKED_LAUNCHER, PACKED_SLURM_LAUNCHER)

# Plugin keys consumed by the launcher itself rather than passed to sbatch.
_NOT_SBATCH_KEYS = {"_target_", "submitit_folder", "max_num_timeout"}

LOCAL_CLUSTER_HINT = "sudo bash scripts/slurm_local.sh start"


class SweepSetupError(ValueError):
    """A sweep that cannot be submitted as configured."""


def _queue_conf(target: str) -> type | None:
    """The plugin's config dataclass for a launcher target, or None for other launchers."""
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

    return {
        SLURM_LAUNCHER: SlurmQueueConf,
        PACKED_SLURM_LAUNCHER: SlurmQueueConf,
        LOCAL_LAUNCHER: LocalQueueConf,
        PLUGIN_LOCAL_LAUNCHER: LocalQueueConf,
    }.get(target)


def accepted_keys(target: str) -> list[str]:
    """Keys the released plugin's dataclass accepts for this launcher target."""
    conf = _queue_conf(target)
    return sorted(f.name for f in dataclasses.fields(conf)) if conf is not None else []


def check_launcher(launcher: DictConfig, *, test_submission: bool = True) -> None:
    """Raise SweepSetupError when ``hydra.launcher`` cannot submit a sweep; no-op for others.

    ``launcher`` is ``cfg.hydra.launcher`` of a composed config (with its ``_target_``).
    """
    target = str(launcher.get("_target_", ""))
    if _queue_conf(target) is None:
        return
    kind = "local" if target in (LOCAL_LAUNCHER, PLUGIN_LOCAL_LAUNCHER) else "slurm"
    _check_keys(launcher, target, kind)
    params = _resolve(launcher, kind)
    if kind != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise SweepSetupError(
            "hydra/launcher=slurm submits jobs with `sbatch`, which is not on PATH: Slurm's client "
            "commands are missing on this machine. Run the sweep from a Slurm login node, or start "
            f"the single-node test cluster with `{LOCAL_CLUSTER_HINT}`, or run the sweep here with "
            "hydra/launcher=local (submitit, all jobs at once) or without hydra/launcher (one job "
            "after another). Nothing was submitted."
        )
    if test_submission:
        _test_submission(params)


def _check_keys(launcher: DictConfig, target: str, kind: str) -> None:
    accepted = accepted_keys(target)
    unknown = sorted(set(launcher.keys()) - set(accepted))
    if unknown:
        hint = (
            " Options sbatch knows but the plugin does not go in additional_parameters, e.g. "
            "'hydra.launcher.additional_parameters={mail-type: END}'."
            if kind == "slurm"
            else ""
        )
        raise SweepSetupError(
            f"hydra/launcher={kind}: unknown option(s) {', '.join(map(repr, unknown))} under "
            f"hydra.launcher. hydra-submitit-launcher accepts: {', '.join(accepted)}.{hint} "
            "Nothing was submitted."
        )


def _resolve(launcher: DictConfig, kind: str) -> dict[str, Any]:
    """Resolve every launcher value now (env interpolations included) and name any that fail."""
    params: dict[str, Any] = {}
    for key in launcher.keys():
        if key in ("submitit_folder", "name"):  # refer to per-job Hydra state, resolved later
            continue
        try:
            value = launcher[key]
            params[str(key)] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception as err:  # OmegaConf's message names the key, the value and the type
            raise SweepSetupError(
                f"hydra/launcher={kind}: hydra.launcher.{key} is invalid: {str(err).splitlines()[0]}. Fix the value or "
                f"the environment variable it reads (see conf/hydra/launcher/{kind}.yaml). "
                "Nothing was submitted."
            ) from None
    return params


def sbatch_flags(params: dict[str, Any]) -> dict[str, Any]:
    """Plugin keys -> submitit's sbatch parameters, as the plugin and submitit translate them."""
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem

    renames = SlurmExecutor._equivalence_dict()
    flags = {renames.get(k, k): v for k, v in params.items() if k not in _NOT_SBATCH_KEYS and v is not None}
    if "mem" in flags:
        flags["mem"] = _convert_mem(flags["mem"])
    return flags


def _test_submission(params: dict[str, Any]) -> None:
    """Ask Slurm whether one job of this sweep could ever run (``sbatch --test-only``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    with tempfile.TemporaryDirectory(prefix="sweep-check-") as folder:
        script = _make_sbatch_string(command="true", folder=folder, **sbatch_flags(params))
        try:
            proc = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise SweepSetupError(
                "`sbatch --test-only` did not answer within 60 s: is the Slurm controller up? "
                f"(for the local test cluster: `{LOCAL_CLUSTER_HINT}`). Nothing was submitted."
            ) from None
    if proc.returncode != 0:
        requested = ", ".join(
            f"{k}={v}" for k, v in sorted(params.items()) if k in _RESOURCE_KEYS and v not in (None, {}, [])
        )
        raise SweepSetupError(
            "Slurm rejects the sweep's job request (`sbatch --test-only`): "
            f"{(proc.stderr or proc.stdout).strip()}\nRequested: {requested}.\n"
            "Adjust them with MDL_SLURM_* environment variables or hydra.launcher.<key>=... "
            "(see conf/hydra/launcher/slurm.yaml; on a cluster without GPUs set "
            "MDL_SLURM_GPUS_PER_NODE=0). Nothing was submitted."
        )


_RESOURCE_KEYS = {
    "partition",
    "account",
    "qos",
    "gpus_per_node",
    "gpus_per_task",
    "gres",
    "cpus_per_task",
    "cpus_per_gpu",
    "mem_gb",
    "mem_per_cpu",
    "mem_per_gpu",
    "timeout_min",
    "nodes",
    "tasks_per_node",
    "constraint",
    "exclude",
    "additional_parameters",
}


def sweep_summary(sweep_dir: Path) -> str:
    """One line on what a finished sweep did: jobs, results written, skipped (already done)."""
    job_dirs = sorted(p.parent for p in sweep_dir.glob("*/.hydra"))
    finished = skipped = 0
    for job_dir in job_dirs:
        results = job_dir / "results.json"
        if not results.exists():
            continue
        finished += 1
        try:
            skipped += bool(json.loads(results.read_text()).get("skipped", False))
        except (OSError, ValueError):
            pass
    missing = len(job_dirs) - finished
    return (
        f"sweep {sweep_dir}: {len(job_dirs)} jobs, {finished - skipped} run, {skipped} skipped "
        f"(a finished run of the same config existed), {missing} without results.json"
    )


class LauncherChecks(Callback):
    """Hydra callback: validate the launcher in the launching process, before submission."""

    def __init__(self, test_submission: bool = True) -> None:
        self.test_submission = test_submission

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_launcher(config.hydra.launcher, test_submission=self.test_submission)
        except SweepSetupError as err:
            raise SystemExit(f"Error: {err}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        log.info(sweep_summary(Path(str(config.hydra.sweep.dir))))

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = str(config.hydra.launcher.get("_target_", ""))
        if _queue_conf(target) is not None:
            log.warning(
                "hydra/launcher only applies to multiruns: add -m to submit through %s; "
                "this run executes here, in this process.",
                target.rsplit(".", 1)[-1],
            )
