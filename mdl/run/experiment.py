"""One run from a composed config: data -> eraser -> prequential MDL -> results.json.

``run_experiment(cfg, run_dir)`` does everything ``launch.py`` does and can be called from
tests and notebooks with a config from ``hydra.compose``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from datamodules.datamodule import ErasedDataModule
from datamodules.stacked_batches import Pacing
from datamodules.timing import timed, timed_calls
from mdl.codelength import check_paper_loss
from mdl.engine.checkpoints import run_stamp
from mdl.engine.driver import train_runs
from mdl.engine.fitting import Fitting, Run
from mdl.engine.preemption import interruption, sigterm_guard
from mdl.results import (
    FAILURE_FILE,
    PROGRESS_FILE,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    DamagedRecord,
    atomic_write_json,
    capped_fits,
    code_version,
    git_sha,
    read_checked_json,
    write_checked_json,
)
from mdl.run.components import (
    make_datamodule,
    make_final_curves,
    make_model_recipe,
    make_preconditioner,
    make_profiler,
    make_user_callbacks,
    show_profile,
)
from mdl.run.config_checks import check_trainer_config, validate_config
from mdl.run.exits import launch_command
from mdl.run.environment import ENVIRONMENT_KEY, current_environment, environment_differences
from mdl.engine.members import AUTO
from mdl.run.identity import config_hash, grouping, members_per_fit, training_threads
from mdl.run.job_logs import LogFile
from mdl.run import phases
from mdl.run.loggers import live_epochs, log_block, log_results, log_stored_run, make_logger, mark_logged_to_wandb
from mdl.run.storage import no_space_error, require_space, require_writable, run_lock
from mdl.engine.protocol import LoopRules
from mdl.schedule import block_boundaries, protocol_rounding
from models.precision import check_compile, set_float32_precision, share_compile_cache

log = logging.getLogger(__name__)


def quiet_lightning() -> None:
    """Lightning announces devices and tips for every Trainer; the driver makes dozens of them."""
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch.callbacks.model_summary").setLevel(
        logging.INFO
    )  # asked for: callbacks=model_summary
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (".*srun.*", ".*LeafSpec.*", ".*does not have many workers.*", ".*litlogger.*"):
        warnings.filterwarnings("ignore", message=pattern)


def run_experiment(
    cfg: DictConfig,
    run_dir: str | os.PathLike,
    overrides: list[str] | None = None,
    startup: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run (or its stored results); with a profiler, where its time went since ``startup`` (mdl.run.phases)."""
    with phases.profiled_phases(cfg.trainer.get("profiler"), Path(run_dir) / phases.PROFILE_DIR, startup):
        with timed(phases.JOB_PHASE):
            job = Job.checked(cfg, run_dir, overrides)
        with (
            run_lock(job.store, cfg.mdl.lock_lease_s),
            sigterm_guard(),
        ):  # a second process with the same config waits, then skips or resumes;
            # SIGTERM (Slurm's preemption) checkpoints and raises Preempted (mdl.engine.preemption)
            with timed(phases.JOB_PHASE):
                done = job.stored_results()
            if done is not None:
                return done
            with job.failure_recorded(), job.disk_errors_named():
                return finish_run(*train_alone(prepare_run(job)))


@dataclass
class Job:
    """A composed config, where its run writes (``run_dir``) and its entry in the run store (``store``)."""

    cfg: DictConfig
    run_dir: Path
    overrides: list[str]
    device: torch.device
    key: str
    store: Path
    label: str = ""  # how log lines name it among the runs it trains with (a pack: mdl.run.pack.run_label)
    log_files: tuple[LogFile, ...] = ()  # its own log files, for a process that trains it with others (a pack)
    command: str | None = None  # what resumes it once interrupted (launch.py's, its overrides'); None: not launched

    @classmethod
    def checked(cls, cfg: DictConfig, run_dir: str | os.PathLike, overrides: list[str] | None = None) -> Job:
        """The config's checks (before anything heavy), its identity and writable folders."""
        validate_config(cfg)
        device = check_trainer_config(cfg)
        key = config_hash(cfg)
        store = Path(cfg.paths.store_dir) / key
        command = None if overrides is None else launch_command(overrides)
        job = cls(cfg, Path(run_dir), list(overrides or []), device, key, store, command=command)
        require_writable(job.run_dir, "paths.output_root")
        require_writable(job.store, "paths.output_root (or paths.store_dir)")
        return job

    def stored_results(self) -> dict[str, Any] | None:
        """With the run's lock held: the finished run's results if there is one (logged to the loggers once), else
        None, after recording what this store entry is (and, with skip_if_done=false, dropping any resume state)."""
        cfg, store = self.cfg, self.store
        done = finished_results(store / RESULTS_FILE) if cfg.skip_if_done else None
        if done is not None and not self.reusable(done, "finished run"):
            done = None
        elif done is None and cfg.skip_if_done and has_resume_state(store):
            from mdl.run.stored_runs import read_started  # here: a fresh run does not import the listing's module

            started, _ = read_started(store)  # None if absent or unreadable
            if started is not None and not self.reusable(started, "interrupted run's checkpoints"):
                discard_resume_state(store)
        if not cfg.skip_if_done:  # run again from scratch: nothing an earlier attempt left is resumed
            discard_resume_state(store)
        if done is not None:
            log.info("skipped: a finished run of this config exists (%s)", store / RESULTS_FILE)
            write_checked_json(
                self.run_dir / RESULTS_FILE, {**done, "skipped": True, "reused_from": str(store / RESULTS_FILE)}
            )
            logging_never_fails(log_stored_run, cfg, self.run_dir, self.overrides, done, store)
            return {**done, "skipped": True}
        # what this store entry is, for `python -m mdl.runs` while the run is partial (results.json holds it too),
        # and where this attempt writes; an earlier attempt's failure is over
        atomic_write_json(
            store / RUN_CONFIG_FILE,
            {
                "config": json_safe(OmegaConf.to_container(cfg, resolve=True)),
                "config_hash": self.key,
                "code_version": code_version(),
                ENVIRONMENT_KEY: self.environment(),
                "run_dir": str(self.run_dir.resolve()),
                "command": self.command,
            },
        )
        (store / FAILURE_FILE).unlink(missing_ok=True)
        return None

    def environment(self) -> dict[str, Any]:
        """This run's environment (mdl.run.environment), with the thread count it trains with on a CPU."""
        threads = training_threads(self.cfg) if self.device.type == "cpu" else None
        return current_environment(self.device, threads)

    def reusable(self, record: dict[str, Any], what: str) -> bool:
        """Whether a stored record (results or a started run's config) may be reused here: its environment
        matches this one, or mdl.reuse_across_environments says to mix them; said aloud either way."""
        differences = environment_differences(record.get(ENVIRONMENT_KEY), self.environment())
        if not differences:
            return True
        where = self.store / RESULTS_FILE
        if self.cfg.mdl.get("reuse_across_environments", False):
            log.warning(
                "reusing the %s of this config made in another environment (%s), as "
                "mdl.reuse_across_environments=true asks: %s",
                what,
                "; ".join(differences),
                where.parent,
            )
            return True
        log.warning(
            "the %s of this config in %s was made in another environment (%s): its numbers can differ in the "
            "last bits, so this run is computed here again (mdl.reuse_across_environments=true reuses it instead)",
            what,
            where.parent,
            "; ".join(differences),
        )
        return False

    @contextmanager
    def failure_recorded(self) -> Iterator[None]:
        """Any exception leaves its first line in the store entry (``record_failure``)."""
        try:
            yield
        except BaseException as err:
            self.record_failure(err)
            raise

    def record_failure(self, err: BaseException) -> None:
        """So that ``python -m mdl.runs`` lists the run as failed and why, not as interrupted; not for a preemption
        or a Ctrl-C (the same command resumes the run: listed as interrupted) or a run that finished (a pack's other
        runs failed)."""
        if interruption(err) is not None or (self.store / RESULTS_FILE).exists():
            return
        first_line = next(iter(str(err).strip().splitlines()), "")
        error = f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
        record = {"error": error, "time": time.time(), "run_dir": str(self.run_dir.resolve())}
        try:  # the error's type and first line, when and where, in the FAILURE_FILE (a full disk may refuse it)
            atomic_write_json(self.store / FAILURE_FILE, record)
        except OSError as write_err:
            log.warning("could not record the failure in %s (%s)", self.store, write_err)

    @contextmanager
    def disk_errors_named(self) -> Iterator[None]:
        """A disk that filled mid-run: say which, and that the checkpoints are kept."""
        try:
            yield
        except OSError as err:
            clear = no_space_error(err, (self.store, self.run_dir), "paths.output_root")
            if clear is None:
                raise
            raise clear from err


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("nan"): a bad setting is reported by the check that owns
    it (e.g. the data source), not by the JSON writer of the run store's config record."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def logging_never_fails(fn: Callable[..., None], *args: Any) -> None:
    """A logger that fails (W&B down, a full disk under its files) after the results are safe must not fail the run."""
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - results.json is written; the log can be made again (skip + logger)
        log.error("logging the results failed (%s: %s); results.json is complete", type(err).__name__, err)


def finished_results(path: Path) -> dict[str, Any] | None:
    """The stored results of a finished run, or None (a damaged file is reported and redone)."""
    if not path.exists():
        return None
    try:
        return read_checked_json(path)
    except DamagedRecord as err:
        log.warning("the stored results are damaged, so this run is done again: %s", err)
        return None


@dataclass
class PreparedRun:
    """A run ready to train: what it is (``run``) and how it is fitted (``fitting``, mdl.engine.fitting), with
    what its results record beside the numbers (its logger, profiler, preconditioning, eraser file, grouping)."""

    job: Job
    run: Run
    fitting: Fitting
    logger: Any
    profiler: Any
    preconditioning: Any
    eraser_path: str | None
    grouping: str  # mdl.run.identity.grouping: stacked, sequential, fits of k, fits by memory


@timed_calls(phases.DATA_PHASE)
def job_data(job: Job) -> ErasedDataModule:
    """The job's data module, made under its seed (as its run alone makes it; a pack makes it ahead of the run)."""
    L.seed_everything(job.cfg.seed, verbose=False)
    return make_datamodule(job.cfg, job.device)


@timed_calls(phases.PREPARE_PHASE)
def prepare_run(job: Job, dm: ErasedDataModule | None = None) -> PreparedRun:
    """Everything before training; ``dm``: a data module built for an identical data config (a pack's runs share one)."""
    cfg, run_dir, device = job.cfg, job.run_dir, job.device
    if dm is None:
        dm = job_data(job)
    else:
        L.seed_everything(cfg.seed, verbose=False)
    eraser_path = None
    if dm.eraser is not None and getattr(dm.eraser, "can_transform_new_data", True):
        eraser_path = str(dm.eraser.save(run_dir / "eraser.safetensors").resolve())

    model = make_model_recipe(cfg, dm.num_classes, dm.input_shape)
    require_space(job.store, checkpoint_bytes(cfg, model.make_model), "this run's checkpoints", "paths.output_root")

    # after the eraser fit, which uses them all; null = torch's own default, even if an earlier run in this process set another
    torch.set_num_threads(training_threads(cfg))
    set_float32_precision(cfg.trainer.matmul_precision)
    boundaries = block_boundaries(dm.num_train, cfg.mdl.num_blocks, cfg.mdl.first_block, protocol_rounding(cfg))
    logger = make_logger(cfg, run_dir, job.overrides)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer.kwargs, resolve=True)
    for key_set_by_device in ("accelerator", "devices", "precision"):
        trainer_kwargs.pop(key_set_by_device, None)  # checked above; mdl.engine.device and models.precision own them
    t = cfg.trainer
    profiler = make_profiler(t.get("profiler"), run_dir / phases.PROFILE_DIR)
    if profiler is not None:
        trainer_kwargs["profiler"] = profiler
    rules = LoopRules.of(cfg.get("protocol"))
    fits = "sequential" if rules.one_member_per_fit else grouping(cfg.mdl)  # one member per fit
    log.info(
        "run %s (fits: %s) on %s (precision %s, compile %s, channels_last %s): %d training examples in blocks %s",
        job.key,
        fits,
        device,
        t.precision,
        t.compile,
        t.channels_last,
        dm.num_train,
        boundaries,
    )
    on_block = (lambda i, b, restored=False: log_block(logger, i, b, curves=restored)) if logger is not None else None
    on_epoch = live_epochs(logger, len(boundaries) - 1) if logger is not None else None
    precondition, preconditioning = make_preconditioner(cfg, dm, model.make_model)
    final_curves = make_final_curves(cfg, dm)
    if fits != "sequential" and t.channels_last:
        log.info(
            "fits of several members: ConvNeXt's stacked form is channels-last whatever the setting; other models' "
            "stacks run under vmap, where trainer.channels_last applies to fits of one member only (mdl.members_per_fit=1)"
        )
    run = Run(
        dm,
        boundaries,
        cfg.seed,
        model,
        job.store,
        on_block=on_block,
        on_epoch=on_epoch,
        final_curves=final_curves,
        final_fit=cfg.protocol.final_fit,
        label=job.label,
    )
    fitting = Fitting(
        trainer_kwargs,
        t.patience,
        folder=job.store,
        stamp=run_stamp(job.store),
        members_per_fit=members_per_fit(cfg.mdl),
        checkpoint_every_s=cfg.mdl.checkpoint_every_s,
        pacing=Pacing(cfg.mdl.steps_per_group, cfg.mdl.min_steps_per_pass),
        paper_loss=check_paper_loss(cfg.mdl.paper_loss),
        rules=rules,
        callbacks=[*precondition, *make_user_callbacks(cfg)],
        precision=t.precision,
        channels_last=t.channels_last,
        compile_backend=check_compile(t.compile),
    )
    if fitting.compile_backend is not None:
        share_compile_cache(cfg.paths.get("compile_cache_dir"))
    return PreparedRun(job, run, fitting, logger, profiler, preconditioning, eraser_path, fits)


@timed_calls(phases.TRAINING_PHASE)
def train_alone(prepared: PreparedRun) -> tuple[PreparedRun, dict[str, Any]]:
    """The run's members, in fits of mdl.members_per_fit (mdl.engine.driver): a pack of one."""
    return prepared, train_runs([prepared.run], prepared.fitting)[0]


@timed_calls(phases.RESULTS_PHASE)
def finish_run(run: PreparedRun, outcome: dict[str, Any]) -> dict[str, Any]:
    """results.json in the run folder and the store, the resume state dropped, the results logged."""
    job, cfg = run.job, run.job.cfg
    warn_capped_fits(outcome, run.fitting.max_epochs, cfg.trainer.patience, job.label)
    if run.profiler is not None:
        show_profile(job.run_dir / phases.PROFILE_DIR)
    results = {
        **({"preconditioning": run.preconditioning} if run.preconditioning is not None else {}),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "config_hash": job.key,
        "overrides": job.overrides,
        "git_sha": git_sha(),
        "code_version": code_version(),
        "fits": run.grouping,
        "members_per_fit": 1 if run.grouping == "sequential" else members_per_fit(cfg.mdl) or "all",
        "device": str(job.device),
        ENVIRONMENT_KEY: job.environment(),
        "eraser_path": run.eraser_path,
        "data_diagnostics": run.run.data.diagnostics,
        **outcome,
    }
    curves = run.run.final_curves
    if curves is not None:  # per epoch of the final fit: maxent_probe_{accuracy,loss}_curve, val_accuracy_curve
        results |= {**curves.results(), "maxent_probes": curves.info}
    write_checked_json(job.run_dir / RESULTS_FILE, results)
    write_checked_json(job.store / RESULTS_FILE, results)
    discard_resume_state(job.store)  # finished: no resume needs the checkpoints (the final one is ~4x the model)
    if run.logger is not None:
        logging_never_fails(log_finished_run, run.logger, results, job)
    return results


def log_finished_run(logger: Any, results: dict[str, Any], job: Job) -> None:
    """The run's last numbers to its loggers; once W&B has the whole run, the store says so (a relaunched sweep that
    skips the run then logs it to the same project no second time)."""
    log_results(logger, results, job.run_dir)
    mark_logged_to_wandb(job.cfg, job.store)


# Measured (digits MLP, widths 32 and 256; tests/test_disk_full.py checks it): a single model's checkpoint
# holds 16 bytes per parameter (float32 weights, best weights and two optimizer moments), a stacked fit's
# 8 per parameter and member, and either some tens of KiB of Lightning state.
CHECKPOINT_BYTES_PER_PARAMETER = {"sequential": 16, "stacked": 8}
CHECKPOINT_OVERHEAD_BYTES = 64 * 1024


def checkpoint_bytes(cfg: DictConfig, make_model: Callable[[], Any]) -> int:
    """Room the run's checkpoints need at once: the largest checkpoint file, twice over while a new one
    is written next to the old one (a stacked fit holds every block's member in one file)."""
    model = make_model()
    parameters = sum(p.numel() for p in model.parameters())
    k = members_per_fit(cfg.mdl)  # auto: at most all of them
    members = cfg.mdl.num_blocks if k is None or k == AUTO else min(k, cfg.mdl.num_blocks)  # one member per boundary
    per_parameter = CHECKPOINT_BYTES_PER_PARAMETER["sequential" if members == 1 else "stacked"]
    largest = per_parameter * parameters * members + CHECKPOINT_OVERHEAD_BYTES
    return 2 * largest


def warn_capped_fits(outcome: dict[str, Any], max_epochs: int | None, patience: int, label: str = "") -> None:
    """Fits that ended at ``trainer.kwargs.max_epochs`` were still improving (early stopping had not
    stopped them): their code lengths are those of under-trained models. ``label``: the run's name in a pack."""
    capped = capped_fits(outcome, max_epochs)  # none without a cap (None or -1)
    if capped:
        log.warning(
            "%s%s stopped at trainer.kwargs.max_epochs=%d before early stopping (patience %d) ended them: "
            "they may still have been improving (under-trained models code longer); raise "
            "trainer.kwargs.max_epochs (or -1: until early stopping)",
            f"{label}: " if label else "",
            ", ".join(capped),
            max_epochs,
            patience,
        )


def has_resume_state(store: Path) -> bool:
    return (store / PROGRESS_FILE).exists() or (store / "checkpoints").exists()


def discard_resume_state(store: Path) -> None:
    """Remove what only a resume would read: checkpoints and the block progress of this run."""
    shutil.rmtree(store / "checkpoints", ignore_errors=True)
    (store / PROGRESS_FILE).unlink(missing_ok=True)
