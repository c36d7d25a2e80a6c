"""``hydra/launcher=packed``: a multirun whose runs differ only in seed, eraser or data seed trains them as
members of one fit.

    python launch.py -m seed=0,1,2,3,4 eraser=none,leace width=64,128 hydra/launcher=packed

Every job is composed and checked first (its folder, .hydra/ files and callbacks as with Hydra's basic
launcher); then the jobs are grouped into packs by ``mdl.run.pack.plan_packs`` (equal configs but for ``seed``, ``eraser``
and ``data_seed``, all members in one fit, at most ``mdl.pack_data_gb`` of data each) and each pack is trained
(mdl.run.pack): the sweep above is 2 packs (one per width) of 10 runs each, each one fit (or fits of
``mdl.members_per_fit``). A job that cannot be packed runs alone. Each job
still gets its own results.json, store entry and loggers, with the numbers it has alone. Jobs run in this
process, one pack after another; their log lines go to this process's log, labelled by what varies, and each job's
to its own folder's log file, which ends with its summary.

A job ends as it does through launch.py alone (mdl.run.exits): a setting or file to change stops the sweep
with one ``error:`` line and exit status 2 (checked before any pack trains); a SIGTERM anywhere in the sweep
checkpoints the pack in training, starts no further pack and exits 143 with the ``preempted:`` line.
"""

import logging
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from mdl.engine.preemption import sigterm_guard, stop_if_requested
from mdl.run.exits import ends_like_a_run

log = logging.getLogger(__name__)


@dataclass
class PackedLauncherConf:
    _target_: str = "hydra_plugins.mdl_packed.packed_launcher.PackedLauncher"  # mdl.sweeps.checks.PACKED_LAUNCHER


ConfigStore.instance().store(group="hydra/launcher", name="packed", node=PackedLauncherConf, provider="mdl")


def checked_job(cfg: DictConfig) -> Any:
    """The task of the first pass: the job's checks and identity (mdl.run.experiment.Job) and its log file (the
    pack writes the job's lines there), no training."""
    from mdl.run.imports import imports_frozen
    from mdl.run.job_logs import current_log_files

    with imports_frozen():
        from mdl.run.experiment import Job

    hc = HydraConfig.get()
    with ends_like_a_run():  # Hydra's run_job would record the error as a failed job and re-raise it later
        return replace(Job.checked(cfg, hc.runtime.output_dir, list(hc.overrides.task)), log_files=current_log_files())


def check_job(
    hydra_context: HydraContext, config: DictConfig, overrides: Sequence[str], idx: int, job_id: str
) -> JobReturn:
    """Compose one job as Hydra's launchers do, make its folder and .hydra/ files, and check it (no training)."""
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = job_id
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    log.info("\t#%d : %s", idx, " ".join(overrides))
    ret = run_job(
        hydra_context=hydra_context,
        task_function=checked_job,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)  # off the job's log file, as Hydra's basic launcher
    return ret


def check_jobs(
    hydra_context: HydraContext, config: DictConfig, jobs: Sequence[tuple[Sequence[str], int, str]]
) -> list[JobReturn]:
    """Every job (overrides, number, id) checked: a job that launch.py would refuse stops the sweep here, before any
    pack trains, with launch.py's message and exit status."""
    checked = [check_job(hydra_context, config, overrides, idx, job_id) for overrides, idx, job_id in jobs]
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)  # off the last checked job's log file
    stop_if_requested("while the sweep's jobs were checked")  # Hydra's run_job caught it as a job's error
    return checked


def train_checked(checked: list[JobReturn]) -> list[JobReturn]:
    """One pack's checked jobs trained together; each job's return: its paper MDL, as launch.py's main returns. A
    preemption or user error ends the process as launch.py ends it (mdl.run.exits); a bug fails the pack's jobs."""
    from mdl.run.experiment import quiet_lightning
    from mdl.run.pack import run_pack

    quiet_lightning()
    try:
        with ends_like_a_run(), lines_named_as_in_a_job(checked[0].hydra_cfg):
            results = run_pack([ret.return_value for ret in checked])
    except Exception as err:  # noqa: BLE001 - a bug: every job of the pack failed with it, as Hydra reports a job's error
        log.error("pack of %d jobs failed: %s: %s", len(checked), type(err).__name__, err)
        for ret in checked:
            ret.return_value.record_failure(err)  # python -m mdl.runs: failed, and why
        return [replace(ret, status=JobStatus.FAILED, _return_value=err) for ret in checked]
    return [replace(ret, status=JobStatus.COMPLETED, _return_value=r["paper_mdl"]) for ret, r in zip(checked, results)]


@contextmanager
def lines_named_as_in_a_job(hydra_cfg: DictConfig | None) -> Iterator[None]:
    """While a pack trains, this process's lines look as a job's do (Hydra's ``job_logging``: the logger's name and
    level, ``[datamodules.datamodule][INFO] - ...``), not as the launcher's own (``hydra_logging``: ``[HYDRA] ...``,
    which the jobs' checks leave configured); then the launcher's again. The jobs' log files are the pack's
    (mdl.run.job_logs), so ``job_logging``'s own file handlers are left out. No Hydra config (a job made outside
    Hydra): the logging as it is."""
    if hydra_cfg is None:
        yield
        return
    hydra = hydra_cfg.hydra
    configure_log(console_only(hydra.job_logging), hydra.verbose)
    try:
        yield
    finally:
        configure_log(hydra.hydra_logging, hydra.verbose)


def console_only(log_config: DictConfig | None) -> DictConfig | None:
    """A logging config (``logging.config.dictConfig``'s schema) without its handlers that write to a file (those
    naming a ``filename``), resolved where it stands (a job's config: its interpolations of ``hydra.*``)."""
    if log_config is None:
        return None
    files = {name for name, handler in (log_config.get("handlers") or {}).items() if "filename" in handler}
    plain: dict[str, Any] = {}
    for key, value in log_config.items():
        if key == "handlers":
            plain[key] = {n: OmegaConf.to_container(h, resolve=True) for n, h in value.items() if n not in files}
        else:
            plain[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    for logger in [plain.get("root") or {}, *(plain.get("loggers") or {}).values()]:
        if logger.get("handlers"):
            logger["handlers"] = [name for name in logger["handlers"] if name not in files]
    return OmegaConf.create(plain)


class PackedLauncher(Launcher):
    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Hydra's entry: check every job first (a refused job stops the sweep before any training), group
        the checked ones into packs and train the packs one after another in this process. One SIGTERM guard spans
        the whole sweep, so a preemption checkpoints the pack in training and starts no other."""
        from mdl.run.pack import packs_line, plan_packs

        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        with ends_like_a_run(), sigterm_guard():  # one SIGTERM request for the whole sweep: no pack starts after it
            jobs = [
                (overrides, initial_job_idx + i, f"job_id_for_{initial_job_idx + i}")
                for i, overrides in enumerate(job_overrides)
            ]
            checked = check_jobs(self.hydra_context, self.config, jobs)
            ok = [i for i, ret in enumerate(checked) if ret.status == JobStatus.COMPLETED]
            packs = [[ok[j] for j in pack] for pack in plan_packs([checked[i].return_value.cfg for i in ok])]
            log.info("packed launcher: %s", packs_line(len(job_overrides), len(packs)))
            done = list(checked)
            for members in packs:
                for i, ret in zip(members, train_checked([checked[i] for i in members])):
                    done[i] = ret
        return done
