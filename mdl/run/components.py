"""The parts of a run built from its config: data module, model and module factories, optimizer, loss,
preconditioner, the final fit's probe curves, the profiler. Hydra's ``instantiate`` where the config
names a class; nothing here trains."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions
from datamodules.maxent_probes import maxent_probe_set
from mdl.engine.final_fit_curves import FinalFitCurves
from mdl.engine.fitting import ModelRecipe
from mdl.run.config_checks import probes_enabled
from mdl.run.identity import is_bookkeeping
from models import create_model, depth_scaled_lr
from models.losses import SpectralDecoupling, loss_from_options

log = logging.getLogger(__name__)

DATA_KEYS_READ_ELSEWHERE = ("first_block",)  # conf/data values read through mdl.first_block


def make_final_curves(cfg: DictConfig, dm: ErasedDataModule) -> FinalFitCurves | None:
    """The max-ent probe set next to the real validation split, evaluated every epoch of the final fit."""
    if not probes_enabled(cfg):
        return None
    probe = maxent_probe_set(dm, OmegaConf.select(cfg, "probes.n_per_class"))
    return FinalFitCurves(
        {"maxent_probe": (probe.x, probe.y), "val": (dm.val_set.x, dm.val_set.y)},
        dm.eval_batch_size,
        with_loss=("maxent_probe",),
        info=probe.info,
    )


def make_model_factory(cfg: DictConfig, num_classes: int, input_shape: tuple[int, ...]) -> Callable[[], nn.Module]:
    """A function returning a freshly initialised (muP) model of the configured architecture.

    The config is read here, once: resolving its interpolations costs milliseconds, and a run makes
    a model per block (a stacked fit: one per member)."""
    m = cfg.model
    options = OmegaConf.to_container(m.options, resolve=True) or {}
    name, width, depth, base_width = m.name, cfg.width, cfg.depth, m.base_width
    init = m.get("init", "mup")  # absent: muP's (the paper presets: original, models.mup_setup)
    return lambda: create_model(
        name, width, depth, num_classes, input_shape, base_width=base_width, init=init, **options
    )


def run_lr(cfg: DictConfig) -> float:
    """The learning rate at this depth (muP transfers it across width; depth needs the exponent)."""
    return depth_scaled_lr(cfg.optimizer.lr, cfg.depth, cfg.model.base_depth, cfg.model.lr_depth_exponent)


def make_optimizer(cfg: DictConfig) -> Callable[..., torch.optim.Optimizer]:
    params = OmegaConf.to_container(cfg.optimizer, resolve=True)
    params.pop("precondition", None)  # ours, not the optimizer's (make_preconditioner)
    params.pop("lr_by_data", None)  # ours: where optimizer.lr's default comes from
    return instantiate(params, _convert_="all")  # plain lists: checkpoints load with weights_only


def make_preconditioner(
    cfg: DictConfig, dm: ErasedDataModule, make_model: Callable[[], nn.Module]
) -> tuple[list[L.Callback], dict[str, Any] | None]:
    """``optimizer.precondition={p, eps}``: the first layer's gradient times c^2 Sigma^p, Sigma the
    (erased) training covariance (models.preconditioning), on the first layer of the run's model (``make_model``,
    the run's one factory); the callback and its spectrum summary."""
    setting = cfg.optimizer.get("precondition")
    if setting is None:
        return [], None
    from erasure.covariance_power import fit_covariance_power
    from models.preconditioning import PreconditionFirstLayer, first_layer_weight

    unknown = set(setting) - {"p", "eps"}
    if unknown or "p" not in setting or "eps" not in setting:
        raise ValueError(
            f"optimizer.precondition={dict(setting)}: give exactly p and eps, e.g. optimizer.precondition={{p:-1,eps:1.0e-6}}"
        )
    transform = fit_covariance_power(dm.train_set.x, float(setting.p), float(setting.eps))
    features = int(math.prod(dm.input_shape))
    name = first_layer_weight(make_model(), features)
    matrix = transform.matrix.to(dm.device)
    return [PreconditionFirstLayer((matrix @ matrix).float(), name)], {"parameter": name, **transform.summary()}


def make_loss(cfg: DictConfig, num_classes: int) -> SpectralDecoupling | None:
    """The training-loss setting (conf/loss): None for plain cross-entropy. Code lengths, validation
    and early stopping are plain cross-entropy whatever it is (models.losses)."""
    options = cfg.get("loss")
    return loss_from_options(None if options is None else OmegaConf.to_container(options, resolve=True), num_classes)


def make_model_recipe(cfg: DictConfig, num_classes: int, input_shape: tuple[int, ...]) -> ModelRecipe:
    """The run's model, optimizer, learning rate and training loss, each built once from the config."""
    return ModelRecipe(
        make_model_factory(cfg, num_classes, input_shape),
        make_optimizer(cfg),
        run_lr(cfg),
        loss=make_loss(cfg, num_classes),
    )


def make_datamodule(cfg: DictConfig, device: torch.device | None = None) -> ErasedDataModule:
    """The run's data module, set up (split, eraser fitted or read from the cache, splits erased),
    its splits on ``device`` (None: where ``data.device`` says)."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key in DATA_KEYS_READ_ELSEWHERE:  # a data set's defaults for the optimizer and the block schedule
        data.pop(key, None)
    if device is not None:
        data["device"] = str(device)
    not_data = tuple(k for k in data.get("options") or {} if is_bookkeeping(f"data.options.{k}"))
    eraser = OmegaConf.to_container(cfg.eraser, resolve=True)
    dm = ErasedDataModule(DataOptions.from_config(data, eraser, cfg.data_seed, not_data), seed=cfg.seed)
    dm.setup()
    return dm


def make_profiler(name: str | None, folder: Path) -> Any:
    """Lightning's profiler writing every fit's report into ``folder`` (appended, one file per kind)."""
    if name is None:
        return None
    from lightning.pytorch import profilers

    kind = {
        "simple": profilers.SimpleProfiler,
        "advanced": profilers.AdvancedProfiler,
        "pytorch": profilers.PyTorchProfiler,
    }[name]
    return kind(dirpath=str(folder), filename="profile")


def show_profile(folder: Path, lines: int = 25) -> None:
    """The head of the profiler's report (its slowest actions first), and where the rest is."""
    reports = sorted(folder.glob("*.txt"))
    if not reports:
        return
    head = reports[0].read_text().splitlines()[:lines]
    print(f"profile ({reports[0]}, first {lines} lines):\n" + "\n".join(head), flush=True)


def make_user_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """The Lightning callbacks of the ``callbacks`` group (conf/callbacks/), joining every fit."""
    made = []
    for name, spec in (cfg.get("callbacks") or {}).items():
        try:
            callback = instantiate(spec)
        except Exception as err:  # an import or argument error of the user's class: name the entry
            raise ValueError(
                f"callbacks.{name}: cannot build {spec.get('_target_')!r} ({type(err).__name__}: {err}); "
                f"fix its _target_ or arguments, or drop it with ~callbacks.{name}"
            ) from err
        if not isinstance(callback, L.Callback):
            raise ValueError(
                f"callbacks.{name}: {spec.get('_target_')!r} made a {type(callback).__name__}, not a lightning.Callback"
            )
        made.append(callback)
    return made
