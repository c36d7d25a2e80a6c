"""One run from a composed config: data -> eraser -> prequential MDL -> results.json.

``run_experiment(cfg, run_dir)`` does everything ``launch.py`` does and can be called from
tests and notebooks with a config from ``hydra.compose``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from datamodules.datamodule import ErasedDataModule
from datamodules.maxent_probes import maxent_probe_set
from erasure import available_erasers
from mdl.device import training_device
from mdl.codelength import check_paper_loss
from mdl.final_fit_curves import FinalFitCurves
from mdl.preemption import sigterm_guard
from mdl.engine import ModelRecipe, run_prequential
from mdl.results import (
    PROGRESS_FILE, RESULTS_FILE, RUN_CONFIG_FILE, BlockResult, DamagedRecord, atomic_write_json, code_version, git_sha,
    read_checked_json, write_checked_json,
)
from mdl.identity import canonical_fit_mode, engine_name, members_per_fit, without_bookkeeping
from mdl.run_logging import check_logger, live_epochs, log_block, log_results, log_stored_run, make_logger
from mdl.storage import no_space_error, require_space, require_writable, run_lock
from mdl.schedule import block_boundaries
from models import Classifier, available_models, create_model, depth_scaled_lr
from models.losses import SpectralDecoupling, loss_from_options
from models.precision import CompiledModel, check_compile, check_precision

log = logging.getLogger(__name__)

# Keys that say where or how a run is recorded or its data is fetched, not what it computes.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
def allocated_cpus() -> int:
    """The CPU threads a run trains with by default: the CPUs Slurm allocated to the task
    (SLURM_CPUS_PER_TASK, capped by the process's CPU affinity), which no other job uses; elsewhere 1.

    On a machine whose cores other work shares (a login node, CI, a workstation) more threads than one
    only fight that work: the default run took 18.1 s with 2 spinning threads and 13.0 s with 2 sleeping
    ones against 10.1 s with one, while 2 busy processes ran on 2 cores (benchmarks/bench_threads.py; on a
    quiet machine 2 threads saved 7%). The thread count is part of a CPU run's identity, so it must not
    depend on the load of the moment: set trainer.torch_threads=N where N cores are yours."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if not (slurm.isdigit() and int(slurm) > 0):
        return 1
    count = int(slurm)
    if hasattr(os, "sched_getaffinity"):
        count = min(count, len(os.sched_getaffinity(0)))
    return max(count, 1)


DEFAULT_THREADS = allocated_cpus()  # trainer.torch_threads=null: the CPUs allocated to this task (1 outside Slurm)
OPTIONAL_KEYS = {"data": ("balance", "transform"), "optimizer": ("precondition",)}
DATA_KEYS_READ_ELSEWHERE = ("lr", "first_block")  # conf/data values read through optimizer.lr and mdl.first_block


def quiet_lightning() -> None:
    """Lightning announces devices and tips for every Trainer; the driver makes dozens of them."""
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (".*srun.*", ".*LeafSpec.*", ".*does not have many workers.*", ".*litlogger.*"):
        warnings.filterwarnings("ignore", message=pattern)


def training_threads(cfg: DictConfig) -> int:
    """The CPU threads a run trains with: trainer.torch_threads, or the CPUs allocated to this process."""
    return int(cfg.trainer.get("torch_threads") or DEFAULT_THREADS)


def config_hash(cfg: DictConfig) -> str:
    """A short hash of the resolved config minus bookkeeping keys: the identity of a run. A run that
    trains on a CPU also carries its thread count: 1 and 2 threads give different numbers (sums are
    reduced in another order), so a run resumed or skipped with another count would mix them."""
    data = OmegaConf.to_container(cfg, resolve=True)
    if _trains_on_cpu(cfg):
        data["cpu_threads"] = training_threads(cfg)
    without_bookkeeping(data)  # mdl/identity.py: where and how, not what
    canonical_fit_mode(data["mdl"])  # mdl.engine=stacked and mdl.members_per_fit=all: one run
    if not (data.get("probes") or {}).get("enabled", False):
        data.pop("probes", None)  # probes off: the hash runs had before the probes group existed
    for group, keys in OPTIONAL_KEYS.items():
        for key in keys:
            if (data.get(group) or {}).get(key, "absent") is None:
                data[group].pop(key)  # off: the hash runs had before the option existed
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def refuse_unknown_keys(cfg: DictConfig, group: str) -> None:
    """A key added to ``group`` on the command line (``+trainer.patiense=1``) that none of the group's
    config files defines would be ignored silently: refuse it, naming the nearest known key."""
    import difflib

    known = set().union(*(OmegaConf.load(path).keys() for path in (CONF_DIR / group).glob("*.yaml"))) - {"defaults"}
    for key in cfg.get(group) or {}:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(map(str, known)), n=1)
            hint = f"did you mean {group}.{near[0]}? " if near else ""
            raise ValueError(f"{group}.{key}: unknown setting, it would be ignored; {hint}"
                             f"{group} takes {', '.join(sorted(map(str, known)))}")


def _trains_on_cpu(cfg: DictConfig) -> bool:
    """Whether the run's device resolves to the CPU here (a device that cannot be resolved is reported
    by check_trainer_config, not here)."""
    try:
        return training_device(cfg.device, cfg.data.get("device")).type == "cpu"
    except ValueError:
        return False


def validate_config(cfg: DictConfig) -> None:
    """Fail before any data is loaded or any eraser fitted (minutes on CIFAR-10) on names that do
    not exist and sizes that cannot work, with the setting, the smallest value that works and a usual one."""
    from datamodules import available_sources
    from datamodules.datamodule import check_data_settings
    from datamodules.sources import check_source_options

    def require_int(key: str, low: int, usual: str, allowed: tuple[Any, ...] = ()) -> None:
        value = OmegaConf.select(cfg, key)
        if value in allowed and not isinstance(value, bool):
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            also = "".join(f" or {'null' if v is None else v}" for v in allowed)
            raise ValueError(f"{key}={value!r}: must be an integer >= {low}{also}; e.g. {key}={usual}")

    if cfg.eraser.name not in available_erasers():
        raise ValueError(f"unknown eraser {cfg.eraser.name!r}; choose one of {available_erasers()} with eraser=<name>")
    members_per_fit(cfg.mdl)  # a known engine name, or members_per_fit all or >= 1
    check_paper_loss(cfg.mdl.paper_loss)
    check_precision(cfg.trainer.precision)
    check_compile(cfg.trainer.compile)
    check_logger(cfg)
    if OmegaConf.select(cfg, "trainer.profiler") not in (None, *PROFILERS):
        raise ValueError(f"trainer.profiler={cfg.trainer.profiler!r}: choose one of {PROFILERS} or null")
    for group in ("trainer", "mdl", "data"):
        refuse_unknown_keys(cfg, group)
    if cfg.model.name not in available_models():
        raise ValueError(f"unknown model {cfg.model.name!r}; choose one of {available_models()} with model=<name>")
    if cfg.data.source not in available_sources():
        raise ValueError(
            f"unknown data source {cfg.data.source!r} (data.source); choose one of {available_sources()} with data=<name>"
        )
    check_source_options(cfg.data.source, cfg.data.get("options") or {})
    for key, low, usual in (("seed", 0, "0"), ("data_seed", 0, "0"), ("width", 1, "128"), ("depth", 1, "2"),
                            ("mdl.num_blocks", 2, "10"), ("mdl.first_block", 1, "1024"),
                            ("trainer.patience", 0, "30"), ("model.base_depth", 1, "2"), ("mdl.steps_per_group", 1, "16")):
        require_int(key, low, usual)
    every = cfg.mdl.checkpoint_every_s
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
        raise ValueError(f"mdl.checkpoint_every_s={every!r}: must be a finite number of seconds >= 0 (0 = every epoch); "
                         f"e.g. mdl.checkpoint_every_s=30")
    lease = cfg.mdl.get("lock_lease_s")
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not math.isfinite(lease) or lease <= 0:
        raise ValueError(f"mdl.lock_lease_s={lease!r}: must be a finite number of seconds > 0; e.g. mdl.lock_lease_s=300")
    require_int("model.base_width", 1, "128", allowed=(None,))
    require_int("trainer.kwargs.max_epochs", 1, "200", allowed=(-1, None))  # -1: until early stopping
    lr = cfg.optimizer.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"optimizer.lr={lr!r} (data.lr by default): must be a positive number; e.g. data.lr=5e-4")
    d = cfg.data
    check_data_settings(d.val_size, d.test_size, d.batch_size, d.eval_batch_size, d.qda_regularization, d.padding_fraction)
    if probes_enabled(cfg):
        require_int("probes.n_per_class", 1, "200", allowed=(None,))


def probes_enabled(cfg: DictConfig) -> bool:
    """Whether the max-ent probes (conf/probes) are on; a config without the group has them off."""
    return bool(OmegaConf.select(cfg, "probes.enabled", default=False))


def make_final_curves(cfg: DictConfig, dm: ErasedDataModule) -> FinalFitCurves | None:
    """The max-ent probe set next to the real validation split, evaluated every epoch of the final fit."""
    if not probes_enabled(cfg):
        return None
    probe = maxent_probe_set(dm, OmegaConf.select(cfg, "probes.n_per_class"))
    return FinalFitCurves(
        {"maxent_probe": (probe.x, probe.y), "val": (dm.val_set.x, dm.val_set.y)}, dm.eval_batch_size,
        with_loss=("maxent_probe",), info=probe.info,
    )


def check_trainer_config(cfg: DictConfig) -> torch.device:
    """The training device and speed settings, checked before any data is loaded."""
    kwargs = cfg.trainer.kwargs
    if kwargs.get("precision") not in (None, 32, "32", "32-true"):
        raise ValueError(
            f"trainer.kwargs.precision={kwargs.precision} is not used: mixed precision has one switch, "
            f"trainer.precision=bf16 (or fp32). Remove trainer.kwargs.precision."
        )
    if kwargs.get("devices") not in (None, 1):
        raise ValueError(f"trainer.kwargs.devices={kwargs.devices}: a run trains on one device; pick it with device=cuda:N")
    check_precision(cfg.trainer.precision)
    check_compile(cfg.trainer.compile)
    return training_device(cfg.device, cfg.data.get("device"), kwargs.get("accelerator"))


def make_model_factory(cfg: DictConfig, num_classes: int, input_shape: tuple[int, ...]) -> Callable[[], nn.Module]:
    """A function returning a freshly initialised (muP) model of the configured architecture.

    The config is read here, once: resolving its interpolations costs milliseconds, and a run makes
    a model per block (the stacked engine one per member)."""
    m = cfg.model
    options = OmegaConf.to_container(m.options, resolve=True) or {}
    name, width, depth, base_width = m.name, cfg.width, cfg.depth, m.base_width
    return lambda: create_model(name, width, depth, num_classes, input_shape, base_width=base_width, **options)


def run_lr(cfg: DictConfig) -> float:
    """The learning rate at this depth (muP transfers it across width; depth needs the exponent)."""
    return depth_scaled_lr(cfg.optimizer.lr, cfg.depth, cfg.model.base_depth, cfg.model.lr_depth_exponent)


def make_optimizer(cfg: DictConfig) -> Callable[..., torch.optim.Optimizer]:
    params = OmegaConf.to_container(cfg.optimizer, resolve=True)
    params.pop("precondition", None)  # ours, not the optimizer's (make_preconditioner)
    return instantiate(params, _convert_="all")  # plain lists: checkpoints load with weights_only


def make_preconditioner(cfg: DictConfig, dm: ErasedDataModule) -> tuple[list[L.Callback], dict[str, Any] | None]:
    """``optimizer.precondition={p, eps}``: the first layer's gradient times c^2 Sigma^p, Sigma the
    (erased) training covariance (models/preconditioning.py); the callback and its spectrum summary."""
    setting = cfg.optimizer.get("precondition")
    if setting is None:
        return [], None
    from erasure.covariance_power import fit_covariance_power
    from models.preconditioning import PreconditionFirstLayer, first_layer_weight

    unknown = set(setting) - {"p", "eps"}
    if unknown or "p" not in setting or "eps" not in setting:
        raise ValueError(f"optimizer.precondition={dict(setting)}: give exactly p and eps, e.g. optimizer.precondition={{p:-1,eps:1.0e-6}}")
    transform = fit_covariance_power(dm.train_set.x, float(setting.p), float(setting.eps))
    features = int(math.prod(dm.input_shape))
    name = first_layer_weight(make_model_factory(cfg, dm.num_classes, dm.input_shape)(), features)
    matrix = transform.matrix.to(dm.device)
    return [PreconditionFirstLayer((matrix @ matrix).float(), name)], {"parameter": name, **transform.summary()}


def make_loss(cfg: DictConfig, num_classes: int) -> SpectralDecoupling | None:
    """The training-loss setting (conf/loss): None for plain cross-entropy. Code lengths, validation
    and early stopping are plain cross-entropy whatever it is (models/losses.py)."""
    options = cfg.get("loss")
    return loss_from_options(None if options is None else OmegaConf.to_container(options, resolve=True), num_classes)


def make_module_factory(cfg: DictConfig, num_classes: int, input_shape: tuple[int, ...]):
    """A function returning a freshly initialised Classifier: one per prequential block.

    With ``trainer.compile`` the first model is compiled and every later block's fresh weights
    are loaded into it (models/precision.py: CompiledModel), so compilation happens once per run.
    """
    t = cfg.trainer
    make_model = make_model_factory(cfg, num_classes, input_shape)
    lr, optimizer = run_lr(cfg), make_optimizer(cfg)
    backend = check_compile(t.compile)
    compiled = CompiledModel(backend) if backend else None
    loss = make_loss(cfg, num_classes)
    options = {"mup": cfg.model.base_width is not None, "precision": t.precision, "channels_last": t.channels_last}

    def make() -> Classifier:
        model = make_model()
        if compiled is not None:
            model = compiled.adopt(model)
        return Classifier(model, optimizer, lr=lr, loss=loss, **options)

    return make


def run_experiment(cfg: DictConfig, run_dir: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, Any]:
    run_dir = Path(run_dir)
    overrides = list(overrides or [])
    validate_config(cfg)
    device = check_trainer_config(cfg)
    key = config_hash(cfg)
    store = Path(cfg.paths.store_dir) / key
    require_writable(run_dir, "paths.output_root")
    require_writable(store, "paths.output_root (or paths.store_dir)")
    with run_lock(store, cfg.mdl.lock_lease_s), sigterm_guard():  # a second process with the same config waits, then skips or resumes;
        # SIGTERM (Slurm's preemption) checkpoints and raises Preempted (mdl/preemption.py)
        done = finished_results(store / RESULTS_FILE) if cfg.skip_if_done else None
        if not cfg.skip_if_done:  # run again from scratch: nothing an earlier attempt left is resumed
            discard_resume_state(store)
        if done is not None:
            log.info("skipped: a finished run of this config exists (%s)", store / RESULTS_FILE)
            write_checked_json(run_dir / RESULTS_FILE, {**done, "skipped": True, "reused_from": str(store / RESULTS_FILE)})
            logging_never_fails(log_stored_run, cfg, run_dir, overrides, done, store)
            return {**done, "skipped": True}
        # what this store entry is, for `python -m mdl.runs` while the run is partial (results.json holds it too)
        atomic_write_json(store / RUN_CONFIG_FILE, {"config": json_safe(OmegaConf.to_container(cfg, resolve=True)),
                                                     "config_hash": key, "code_version": code_version()})
        try:
            return _run(cfg, run_dir, overrides, device, key, store)
        except OSError as err:  # a disk that filled mid-run: say which, and that the checkpoints are kept
            clear = no_space_error(err, (store, run_dir), "paths.output_root")
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


def make_datamodule(cfg: DictConfig, device: torch.device | None = None) -> ErasedDataModule:
    """The run's data module, set up (split, eraser fitted or read from the cache, splits erased),
    its splits on ``device`` (None: where ``data.device`` says)."""
    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    for key in DATA_KEYS_READ_ELSEWHERE:  # a data set's defaults for the optimizer and the block schedule
        data_options.pop(key, None)
    if device is not None:
        data_options["device"] = str(device)
    dm = ErasedDataModule(
        eraser=OmegaConf.to_container(cfg.eraser, resolve=True), data_seed=cfg.data_seed, seed=cfg.seed,
        **data_options,
    )
    dm.setup()
    return dm


def _run(cfg: DictConfig, run_dir: Path, overrides: list[str], device: torch.device, key: str, store: Path) -> dict[str, Any]:
    L.seed_everything(cfg.seed, verbose=False)
    dm = make_datamodule(cfg, device)
    eraser_path = None
    if dm.eraser is not None and getattr(dm.eraser, "can_transform_new_data", True):
        eraser_path = str(dm.eraser.save(run_dir / "eraser.safetensors").resolve())

    require_space(store, checkpoint_bytes(cfg, dm), "this run's checkpoints", "paths.output_root")

    # after the eraser fit, which uses them all; null = torch's own default, even if an earlier run in this process set another
    torch.set_num_threads(training_threads(cfg))
    torch.set_float32_matmul_precision(cfg.trainer.matmul_precision)
    boundaries = block_boundaries(dm.num_train, cfg.mdl.num_blocks, cfg.mdl.first_block)
    logger = make_logger(cfg, run_dir, overrides)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer.kwargs, resolve=True)
    for key_set_by_device in ("accelerator", "devices", "precision"):
        trainer_kwargs.pop(key_set_by_device, None)  # checked above; mdl/device.py and models/precision.py own them
    t = cfg.trainer
    profiler = make_profiler(t.get("profiler"), run_dir / "profile")
    if profiler is not None:
        trainer_kwargs["profiler"] = profiler
    engine = engine_name(cfg.mdl)
    log.info(
        "run %s, %s engine, on %s (precision %s, compile %s, channels_last %s): %d training examples in blocks %s",
        key, engine, device, t.precision, t.compile, t.channels_last, dm.num_train, boundaries,
    )
    on_block = (lambda i, b, restored=False: log_block(logger, i, b, curves=restored)) if logger is not None else None
    on_epoch = live_epochs(logger, len(boundaries) - 1) if logger is not None else None
    precondition, preconditioning = make_preconditioner(cfg, dm)
    final_curves = make_final_curves(cfg, dm)
    if engine != "sequential" and (t.compile or t.channels_last):
        log.info("fits of several members run their stack under vmap: trainer.compile and trainer.channels_last "
                 "apply to fits of one member only (mdl.members_per_fit=1)")
    recipe = ModelRecipe(
        make_module_factory(cfg, dm.num_classes, dm.input_shape), make_model_factory(cfg, dm.num_classes, dm.input_shape),
        make_optimizer(cfg), run_lr(cfg), t.precision, loss=make_loss(cfg, dm.num_classes),
    )
    outcome = run_prequential(
        dm, boundaries, recipe, trainer_kwargs, t.patience, cfg.seed, store, members_per_fit=members_per_fit(cfg.mdl),
        on_block=on_block, checkpoint_every_s=cfg.mdl.checkpoint_every_s, final_curves=final_curves,
        callbacks=precondition, steps_per_group=cfg.mdl.steps_per_group, paper_loss=cfg.mdl.paper_loss,
        on_epoch=on_epoch,
    )
    warn_capped_fits(outcome, trainer_kwargs.get("max_epochs"), t.patience)
    if profiler is not None:
        show_profile(run_dir / "profile")
    results = {
        **({"preconditioning": preconditioning} if preconditioning is not None else {}),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "config_hash": key,
        "overrides": overrides,
        "git_sha": git_sha(),
        "code_version": code_version(),
        "engine": engine,
        "members_per_fit": members_per_fit(cfg.mdl) or "all",
        "device": str(device),
        "eraser_path": eraser_path,
        "data_diagnostics": dm.diagnostics,
        **outcome,
    }
    if final_curves is not None:  # per epoch of the final fit: maxent_probe_{accuracy,loss}_curve, val_accuracy_curve
        results |= {**final_curves.results(), "maxent_probes": final_curves.info}
    write_checked_json(run_dir / RESULTS_FILE, results)
    write_checked_json(store / RESULTS_FILE, results)
    discard_resume_state(store)  # finished: no resume needs the checkpoints (the final one is ~4x the model)
    if logger is not None:
        logging_never_fails(log_results, logger, results, run_dir)
    return results


# Measured (digits MLP, widths 32 and 256; tests/test_disk_full.py checks it): a single model's checkpoint
# holds 16 bytes per parameter (float32 weights, best weights and two optimizer moments), a stacked fit's
# 8 per parameter and member, and either some tens of KiB of Lightning state.
CHECKPOINT_BYTES_PER_PARAMETER = {"sequential": 16, "stacked": 8}
CHECKPOINT_OVERHEAD_BYTES = 64 * 1024


def checkpoint_bytes(cfg: DictConfig, dm: ErasedDataModule) -> int:
    """Room the run's checkpoints need at once: the largest checkpoint file, twice over while a new one
    is written next to the old one (a stacked fit holds every block's member in one file)."""
    model = make_model_factory(cfg, dm.num_classes, dm.input_shape)()
    parameters = sum(p.numel() for p in model.parameters())
    members = min(members_per_fit(cfg.mdl) or cfg.mdl.num_blocks, cfg.mdl.num_blocks)  # one member per boundary
    per_parameter = CHECKPOINT_BYTES_PER_PARAMETER["sequential" if members == 1 else "stacked"]
    largest = per_parameter * parameters * members + CHECKPOINT_OVERHEAD_BYTES
    return 2 * largest


PROFILERS = ("simple", "advanced", "pytorch")


def make_profiler(name: str | None, folder: Path) -> Any:
    """Lightning's profiler writing every fit's report into ``folder`` (appended, one file per kind)."""
    if name is None:
        return None
    if name not in PROFILERS:
        raise ValueError(f"trainer.profiler={name!r}: choose one of {PROFILERS} or null")
    from lightning.pytorch import profilers

    kind = {"simple": profilers.SimpleProfiler, "advanced": profilers.AdvancedProfiler,
            "pytorch": profilers.PyTorchProfiler}[name]
    return kind(dirpath=str(folder), filename="profile")


def show_profile(folder: Path, lines: int = 25) -> None:
    """The head of the profiler's report (its slowest actions first), and where the rest is."""
    reports = sorted(folder.glob("*.txt"))
    if not reports:
        return
    head = reports[0].read_text().splitlines()[:lines]
    print(f"profile ({reports[0]}, first {lines} lines):\n" + "\n".join(head), flush=True)


def warn_capped_fits(outcome: dict[str, Any], max_epochs: int | None, patience: int) -> None:
    """Fits that ended at ``trainer.kwargs.max_epochs`` were still improving (early stopping had not
    stopped them): their code lengths are those of under-trained models."""
    if max_epochs is None or max_epochs < 0:
        return
    capped = [f"block {i + 1}" for i, b in enumerate(outcome["blocks"]) if b["epochs"] >= max_epochs]
    if outcome.get("final_epochs", 0) >= max_epochs:
        capped.append("the final fit")
    if capped:
        log.warning("%s stopped at trainer.kwargs.max_epochs=%d before early stopping (patience %d) ended them: "
                    "they may still have been improving (under-trained models code longer); raise "
                    "trainer.kwargs.max_epochs (or -1: until early stopping)", ", ".join(capped), max_epochs, patience)


def discard_resume_state(store: Path) -> None:
    """Remove what only a resume would read: checkpoints and the block progress of this run."""
    shutil.rmtree(store / "checkpoints", ignore_errors=True)
    (store / PROGRESS_FILE).unlink(missing_ok=True)


def summary(results: dict[str, Any], path: Path) -> str:
    k = results["num_classes"]
    estimate = results.get("paper_loss", "val_min")  # runs made before mdl.paper_loss existed measured val_min
    other = {"last_block": "val_min", "val_min": "last_block"}[estimate]
    also = f"; {other}: {results[f'paper_mdl_{other}']:.4f}" if f"paper_mdl_{other}" in results else ""
    return (
        f"paper MDL: {results['paper_mdl']:.4f} bits/example ({estimate}, mdl.paper_loss{also}; "
        f"chance {math.log2(k) * sum(results['boundaries'][1:]) / results['boundaries'][-1]:.3f})\n"
        f"online code length: {results['online_codelength_bits']:.1f} bits = "
        f"{results['online_bits_per_example']:.4f} bits/example (uniform code {math.log2(k):.3f})\n"
        f"final val loss: {results['final_val_loss']:.4f} nats\n"
        f"engine: {results.get('engine', 'sequential')} (mdl.members_per_fit, or mdl.engine naming it)\n"
        f"results: {path}"
    )
