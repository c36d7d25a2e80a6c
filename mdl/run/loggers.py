"""What a run sends to its logger (CSV, W&B, TensorBoard): one place for the series, the summary and
the W&B extras, for runs that train and for runs skipped as already done.

- every prequential block's training and validation loss as its own series, numbered from 1
  (``block03/val_loss``), and the final fit's (``final/val_loss``), each against its own epoch (the step of
  every logger, and ``epoch``) so they overlay in one chart, logged live at each epoch's end by both kinds of fit;
- the numbers a reader compares (paper MDL, online code, every erasure diagnostic, and each fit's
  ``<block or final>/best_val_loss`` (the kept weights') and ``/last_val_loss`` (the last epoch's)) as
  metrics, and in W&B as the run *summary* (one value per run, not a one-point chart; the per-epoch
  series have none there, since W&B's would be their last epoch);
- W&B only: tags from the config (data, model, eraser, preset, debug), a readable group (the preset or the
  swept keys, then the sweep's date and time; ``debug`` first for a debug run), a name made of the job's
  own overrides, a table of the blocks, the run's panel of Figure 1 (images as given and erased) as an
  image, and results.json and the fitted eraser as artifacts. A run skipped because it already finished is
  logged to W&B from its stored results, once per project (a marker in its run-store folder).

Every run has loggers of its own (its own W&B run, CSV file, TensorBoard log), also where one process trains
several runs at once (a pack, mdl.run.pack): each holds that run's series only.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from mdl.run.identity import grouping, is_bookkeeping
from mdl.results import BlockResult, atomic_write_json, read_json

log = logging.getLogger(__name__)
SUMMARY_KEYS = (
    "paper_mdl",
    "paper_mdl_last_block",
    "paper_mdl_val_min",
    "online_codelength_bits",
    "online_bits_per_example",
)  # the run's numbers; a fit's own are named by fit_summary
SERIES = ("val_loss", "train_loss", "val_accuracy")  # per epoch of every fit, as <block or final>/<series>
WANDB_MARKER = "wandb_logged.json"  # in the run store: the W&B projects a finished run has been logged to


def logger_configs(cfg: DictConfig) -> dict[str, DictConfig]:
    """The chosen loggers' settings by name: ``logger=csv`` one, ``logger=[csv,wandb]`` several, ``logger=null`` none
    (each conf/logger/<name>.yaml nests its settings under its name, so a list of them composes)."""
    node = cfg.get("logger")
    if node is None:
        return {}
    found = {str(name): sub for name, sub in node.items() if OmegaConf.is_dict(sub) and "_target_" in sub}
    stray = [str(name) for name in node if str(name) not in found]
    if stray:
        raise ValueError(
            f"logger.{stray[0]}: not a logger (each logger's settings sit under its name, e.g. "
            f"logger.wandb.project=...; choose loggers with logger=csv or logger=[csv,wandb])"
        )
    return found


def _is_wandb(node: DictConfig) -> bool:
    return "WandbLogger" in str(node._target_)


def wandb_config(cfg: DictConfig) -> DictConfig | None:
    """The W&B logger's settings, if W&B is among the chosen loggers."""
    return next((c for c in logger_configs(cfg).values() if _is_wandb(c)), None)


def is_wandb(cfg: DictConfig) -> bool:
    return wandb_config(cfg) is not None


class LoggerGroup:
    """The run's loggers as one: every metric goes to each; W&B's run (summary, media, artifacts) is the W&B one's.

    The step (TensorBoard's x, the CSV's ``step`` column, W&B's ``trainer/global_step``) of a fit's per-epoch row is
    that fit's own epoch (``epoch``, logged beside it), so each block's curves lie against its own epochs, from 0, in
    every logger: the blocks of a stacked fit train at once, and a shared count of rows interleaved them. Any other
    row (a block's code length, the run's numbers) gets the next of a count of such rows. Lightning's loggers left
    alone put every TensorBoard event at step 0 and restart the CSV's count at each flush."""

    def __init__(self, loggers: list[Any], wandb: Any = None, run_images: str | None = None) -> None:
        self.loggers = loggers
        self.wandb = wandb  # the W&B logger among them, if any
        self.run_images = run_images  # the W&B logger's run_images function (a dotted name), if any
        self.step = 0  # the next step of a row that is not a fit's epoch

    def log_metrics(self, metrics: dict[str, Any], loggers: list[Any] | None = None, step: int | None = None) -> None:
        """One row at ``step`` (None: the next of the count), to every logger (or to ``loggers`` among them)."""
        if step is None:
            step, self.step = self.step, self.step + 1
        for logger in self.loggers if loggers is None else loggers:
            logger.log_metrics(metrics, step=step)

    def finalize(self, status: str) -> None:
        for logger in self.loggers:
            logger.finalize(status)

    @property
    def wandb_run(self) -> Any:
        """The W&B run of the group's W&B logger, or None."""
        return None if self.wandb is None else self.wandb.experiment


def hydra_choice(group: str) -> str | None:
    """This Hydra job's choice in ``group`` (``experiment``: ``paper/appendix_c``; ``debug``: ``fast``), if any."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except (ValueError, AttributeError):  # not inside a Hydra job (tests, scripts)
        return None


MAX_GROUP_WHAT = 80  # characters of the swept keys in a group's name (W&B takes 128 in all)


def wandb_group(run_dir: Path, preset: str | None, debug: str | None) -> str:
    """What the runs have in common and when: the preset, or a sweep's swept keys (``eraser x seed``), then the
    sweep's date and time (a single run: ``runs`` and the day); ``debug`` first for a debug run, so it never
    shares a group with real ones."""
    from mdl.run.sweep_jobs import planned_jobs, sweep_dimensions

    folder = run_dir.parent
    jobs = planned_jobs(folder)  # None: a single run (runs/<date>/<time>), or a sweeper that cannot be replayed
    if (folder / "multirun.yaml").is_file():
        swept = " x ".join(key.lstrip("+~") for key, _ in sweep_dimensions(jobs or []))[:MAX_GROUP_WHAT]
        what, when = preset or swept or "sweep", f"{folder.parent.name} {folder.name}"
    else:
        what, when = preset or "runs", folder.name
    return " ".join(filter(None, ("debug" if debug else None, what, when)))


def run_name(overrides: list[str], run_dir: Path) -> str:
    """The job's own overrides, without those that do not change what it computes (logger=wandb, paths...)."""

    def kept(override: str) -> bool:
        key = override.split("=", 1)[0].lstrip("+~")
        return not is_bookkeeping(key.split("/")[0]) and key.split("/")[0] not in ("experiment", "report")

    return ",".join(o for o in overrides if kept(o)) or run_dir.name


def wandb_settings(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """The W&B run's group, job type, name, tags and config for this run (what the dashboard groups and filters
    by); offline unless an API key or WANDB_MODE is set."""
    if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") is None:
        os.environ["WANDB_MODE"] = "offline"
    preset, debug = hydra_choice("experiment"), hydra_choice("debug")  # +experiment=paper/appendix_c: its preset
    wandb = wandb_config(cfg)
    tags = [
        f"data:{cfg.data.source}",
        f"model:{cfg.model.name}",
        f"eraser:{cfg.eraser.name}",
        f"fits:{grouping(cfg.mdl)}",
        *([f"preset:{preset}"] if preset else []),
        *([f"debug:{debug}"] if debug else []),
    ]
    return {
        "group": wandb.group or wandb_group(run_dir, preset, debug),
        "job_type": wandb.job_type or cfg.eraser.name,
        "name": wandb.name or run_name(overrides, run_dir),
        "tags": [*(cfg.get("tags") or []), *(wandb.get("tags") or []), *tags],
        "config": OmegaConf.to_container(cfg, resolve=True),
        # a W&B run of its own, also beside others open in this process (a pack logs its runs at once): without it
        # W&B hands every later logger the first run, and closing that one leaves the others writing to a finished run
        "reinit": "create_new",
    }


def check_logger(cfg: DictConfig) -> None:
    """A logger whose package is missing fails here, before the data are loaded, not after the eraser fit."""
    import importlib.util

    targets = [str(c._target_) for c in logger_configs(cfg).values()]
    if any("TensorBoardLogger" in t for t in targets) and not any(
        importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")
    ):
        raise ImportError(
            "logger=tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' "
            "(or choose logger=csv, logger=wandb or logger=null)"
        )
    images = (wandb_config(cfg) or {}).get("run_images")
    module = str(images).rpartition(".")[0]
    if images is not None and not (module and importlib.util.find_spec(module)):
        raise ValueError(
            f"logger.wandb.run_images={images}: no such module {module!r}; name a function by its dotted path "
            "(mdl.report.figure1.run_panel) or set logger.wandb.run_images=null"
        )


def make_logger(cfg: DictConfig, run_dir: Path, overrides: list[str], only_wandb: bool = False) -> LoggerGroup | None:
    """The chosen loggers (``only_wandb``: the W&B one alone), or None when there are none."""
    loggers, wandb_logger, images = [], None, None
    for node in logger_configs(cfg).values():
        wandb = _is_wandb(node)
        if only_wandb and not wandb:
            continue
        params = OmegaConf.to_container(node, resolve=True)
        params["save_dir"] = node.get("save_dir") or str(run_dir)
        if wandb:
            images = params.pop("run_images", None)  # ours, not WandbLogger's
            params |= wandb_settings(cfg, run_dir, overrides)
        params |= {"_recursive_": False, "_convert_": "all"}
        loggers.append(instantiate(params))  # a dict, since 'config' is also instantiate's own argument name
        wandb_logger = loggers[-1] if wandb else wandb_logger
    return LoggerGroup(loggers, wandb_logger, images) if loggers else None


def series_name(member: int, num_blocks: int) -> str:
    """``block03`` (numbered from 1, as the log lines' "block 3/9") or ``final``."""
    return "final" if member == num_blocks else f"block{member + 1:02d}"


def share_epoch_axis(logger: LoggerGroup) -> None:
    """W&B: every block's and the final fit's series against one ``epoch`` axis, so they overlay in one chart, and
    without a summary of their own (W&B's would be the last epoch, read as the fit's result): the summary holds
    ``best_`` and ``last_`` values under the same names (``fit_summary``)."""
    run = logger.wandb_run
    if run is not None:
        run.define_metric("epoch")
        for pattern in ("block*", "final/*"):
            run.define_metric(pattern, step_metric="epoch", summary="none")


def drop_series_summaries(run: Any) -> None:
    """W&B: no per-epoch series in the summary (``final/val_loss``: the last epoch's, read as the fit's result);
    Lightning's own ``*`` metric definition puts some back in spite of ``summary="none"``."""
    for key in list(run.summary.keys()):
        if key.startswith(("block", "final/")) and key.rsplit("/", 1)[-1] in SERIES:
            del run.summary[key]


def fit_summary(name: str, val_loss_curve: list[float], best_val_loss: float | None) -> dict[str, float]:
    """A fit's losses as the summary names them: ``<name>/best_val_loss`` (the kept weights') and
    ``<name>/last_val_loss`` (the last epoch's)."""
    values = {
        f"{name}/best_val_loss": best_val_loss,
        f"{name}/last_val_loss": val_loss_curve[-1] if val_loss_curve else None,
    }
    return {k: v for k, v in values.items() if v is not None}


def update_summary(logger: LoggerGroup, values: dict[str, Any]) -> None:
    """W&B: ``values`` in the run summary (one value per run, not one-point charts); other loggers: one row of them."""
    if logger.wandb_run is not None:
        logger.wandb_run.summary.update(values)
    logger.log_metrics(values, [m for m in logger.loggers if m is not logger.wandb])


def log_epoch(
    logger: LoggerGroup, name: str, epoch: int, train_loss: float, val_loss: float, val_accuracy: float | None = None
) -> None:
    metrics = {f"{name}/val_loss": val_loss, f"{name}/train_loss": train_loss, "epoch": epoch}
    if val_accuracy is not None:
        metrics[f"{name}/val_accuracy"] = val_accuracy
    logger.log_metrics(metrics, step=epoch)


def live_epochs(logger: LoggerGroup, num_blocks: int) -> Callable[..., None]:
    """The fits' per-epoch hook (member, epoch, train loss, val loss, val accuracy): logged as it
    happens, so a multi-hour fit shows its curves live."""
    share_epoch_axis(logger)
    return lambda member, epoch, train, val, accuracy=None: log_epoch(
        logger, series_name(member, num_blocks), epoch, train, val, accuracy
    )


def log_block(logger: LoggerGroup, index: int, block: BlockResult, curves: bool = False) -> None:
    """A finished block's code length; with ``curves`` also its loss curves (a block restored from an
    interrupted attempt, or a stored run: their epochs were not logged live by this process)."""
    prefix = f"block{index + 1:02d}"
    if curves:
        share_epoch_axis(logger)
        accuracy = block.val_accuracy_curve or [None] * len(block.val_loss_curve)  # absent in older records
        for epoch, (train, val, right) in enumerate(zip(block.train_loss_curve, block.val_loss_curve, accuracy)):
            log_epoch(logger, prefix, epoch, train, val, right)
    best = block.val_bits_per_example * math.log(2)  # bits -> nats, as the curves
    update_summary(
        logger,
        {
            f"{prefix}/eval_bits_per_example": block.eval_bits / block.n_eval,
            f"{prefix}/n_train": block.n_train,
            **fit_summary(prefix, block.val_loss_curve, best),
        },
    )


def log_results(logger: LoggerGroup, results: dict[str, Any], run_dir: Path, live: bool = True) -> None:
    """The final fit's curves (without the losses logged ``live``), the summary numbers and (W&B) the
    block table and artifacts; then close the run. A logger that fails here (W&B down) still leaves the
    others' files complete: CSV and TensorBoard write their last rows when closed."""
    try:
        run = _log_final(logger, results, run_dir, live)
    finally:
        logger.finalize("success")
    if run is not None:  # W&B: close the run so every job of a sweep gets its own, complete run
        run.finish()


def _log_final(logger: LoggerGroup, results: dict[str, Any], run_dir: Path, live: bool) -> Any:
    """log_results' series and numbers; the W&B run, if any, still open."""
    share_epoch_axis(logger)
    curves = {k.removesuffix("_curve"): v for k, v in results.items() if k.endswith("_curve") and isinstance(v, list)}
    for name, curve in curves.items():
        if live and name in ("val_loss", "train_loss", "val_accuracy"):
            continue
        for epoch, value in enumerate(curve):
            if value is not None:
                logger.log_metrics({f"final/{name}": value, "epoch": epoch}, step=epoch)
    numbers = {k: results[k] for k in SUMMARY_KEYS if results.get(k) is not None}
    erasure = {
        f"erasure/{k}": v
        for k, v in (results.get("data_diagnostics") or {}).get("erasure", {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    final = fit_summary("final", results.get("val_loss_curve") or [], results.get("final_val_loss"))
    update_summary(logger, {**numbers, **final, **erasure})
    run = logger.wandb_run
    if run is not None:
        run.config.update({"environment": results.get("environment")}, allow_val_change=True)  # what computed it
        drop_series_summaries(run)
        _wandb_extras(run, results, run_dir, run_images(logger, run_dir))
    return run


def _wandb_extras(experiment: Any, results: dict[str, Any], run_dir: Path, images: list[tuple[Path, str]]) -> None:
    import wandb

    columns = ["block", "n_train", "n_eval", "eval_bits_per_example", "epochs", "best_after_epochs", "last_block_bits"]
    table = wandb.Table(columns=columns)
    for i, b in enumerate(results.get("blocks", [])):
        table.add_data(
            i + 1,
            b["n_train"],
            b["n_eval"],
            b["eval_bits"] / b["n_eval"],
            b["epochs"],
            b.get("best_after_epochs"),
            b.get("heldout_bits_per_example"),
        )
    experiment.log({"blocks": table})
    artifact = wandb.Artifact(f"results-{results.get('config_hash', 'run')}", type="results")
    for path in (run_dir / "results.json", Path(results["eraser_path"]) if results.get("eraser_path") else None):
        if path is not None and path.is_file():
            artifact.add_file(str(path))
    experiment.log_artifact(artifact)
    for path, caption in images:
        experiment.log({"erased_images": wandb.Image(str(path), caption=caption)})


def run_images(logger: LoggerGroup, run_dir: Path) -> list[tuple[Path, str]]:
    """The images W&B shows for this run: what the W&B logger's ``run_images`` function (a dotted name in
    conf/logger/wandb.yaml, drawn by the report's code) writes for ``run_dir``; none when it is null or fails."""
    if logger.run_images is None:
        return []
    try:
        return get_method(logger.run_images)(run_dir)
    except Exception as err:  # noqa: BLE001 - a picture must never fail a finished run
        log.warning("no run images for W&B (%s: %s)", type(err).__name__, err)
        return []


def log_stored_run(cfg: DictConfig, run_dir: Path, overrides: list[str], results: dict[str, Any], store: Path) -> None:
    """A run skipped as already finished is logged to W&B from its stored results, once per project, so a
    sweep re-launched with ``logger=wandb`` after CSV runs shows every run of it in the dashboard."""
    if not is_wandb(cfg):
        return
    if str(wandb_config(cfg).get("project")) in wandb_projects(store):
        return
    logger = make_logger(cfg, run_dir, overrides, only_wandb=True)
    for i, block in enumerate(results.get("blocks", [])):
        log_block(logger, i, BlockResult(**block), curves=True)
    log_results(logger, results, run_dir, live=False)
    mark_logged_to_wandb(cfg, store)
    log.info("logged the stored results of this finished run to W&B project %s", wandb_config(cfg).get("project"))


def wandb_projects(store: Path) -> list[str]:
    """The W&B projects the finished run stored in ``store`` has been logged to (its marker)."""
    marker = store / WANDB_MARKER
    return read_json(marker).get("projects", []) if marker.is_file() else []


def mark_logged_to_wandb(cfg: DictConfig, store: Path) -> None:
    """Record that the run in ``store`` is in its W&B project (with logger=wandb; else nothing), live or from the store,
    so a relaunched sweep that skips it does not log it again."""
    if not is_wandb(cfg):
        return
    project, logged = str(wandb_config(cfg).get("project")), wandb_projects(store)
    if project not in logged:
        atomic_write_json(store / WANDB_MARKER, {"projects": [*logged, project]})
