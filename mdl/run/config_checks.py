"""Checks of a composed config before anything is loaded: unknown names and keys, sizes that cannot
work, trainer settings the device cannot honour; each error names the setting and a value that works.

Two stages: ``check_before_imports`` needs no torch, so ``launch.py`` refuses a wrong value in about a second
instead of after the seconds torch and lightning take to import; ``validate_config`` adds what only the code
can say (its registries, a data source's options, the compile backends) and runs before any data is loaded.
"""

from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from mdl.codelength import check_paper_loss
from mdl.run.identity import members_per_fit
from mdl.run.loggers import check_logger

if TYPE_CHECKING:
    import torch

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Values that a model's builder or the trainer refuses, known here without importing torch so that a wrong one fails
# at once; tests/test_config_checks.py keeps each equal to its owner's (named beside it).
MODEL_OPTION_VALUES = {
    ("mlp", "activation"): ("relu", "gelu", "swiglu"),  # models.mlp.ACTIVATIONS
    ("lenet", "activation"): ("relu", "gelu"),  # models.lenet.ACTIVATIONS
    ("lenet", "variant"): ("original", "dense_stack"),  # models.lenet.VARIANTS
    ("swin", "head_scaling"): ("width", "paper"),  # models.swin.HEAD_SCALINGS
}
CHOICES = {  # config key -> the values the code behind it takes
    "trainer.precision": ("fp32", "bf16"),  # models.precision.PRECISIONS
    "trainer.profiler": (None, "simple", "advanced", "pytorch"),  # mdl.run.components.make_profiler (null: off)
    "data.augment_order": ("erase_then_augment", "augment_then_erase"),  # datamodules.settings.AUGMENT_ORDERS
    "data.balance": (None, "suby", "rwy"),  # datamodules.settings.BALANCE_METHODS (null: off)
    "data.eval_labels": (True, "predicted"),  # datamodules.settings.check_erasure_settings
    "eraser.fit_scope": ("split", "pool"),  # datamodules.settings.FIT_SCOPES (absent: split)
    # switches: read as booleans, where any other value (``=foo``) would count as true
    "mdl.reuse_across_environments": (False, True),  # mdl.run.experiment Job.reusable
    "skip_if_done": (True, False),  # mdl.run.experiment
    "print_config": ("overrides", "full", True, False),  # mdl.run.console.show_config (true: full)
}
# The names a config group's files give (conf/<group>/*.yaml): what the command line can choose; the code's
# registries hold the same (tests/test_config_checks.py), checked again by validate_config.
NAMED_BY_GROUP = {"eraser.name": "eraser", "model.name": "model", "data.source": "data"}


# Keys that no longer exist, with what replaced them: refused on the command line (launch.py) and in a config.
RETIRED_KEYS = {
    "mdl.engine": "mdl.engine is gone: mdl.members_per_fit alone says how members are grouped; use "
    "mdl.members_per_fit=all (was mdl.engine=stacked) or mdl.members_per_fit=1 (was mdl.engine=sequential)",
    "mdl.default_engine": "mdl.default_engine is gone: each conf/model/<name>.yaml sets the default of "
    "mdl.members_per_fit; override it with mdl.members_per_fit=all or mdl.members_per_fit=1",
    "trainer.threads_by_engine": "trainer.threads_by_engine is gone: trainer.threads_by_members_per_fit holds the "
    "default thread counts; or set trainer.torch_threads=N",
    "mdl.pack_data_fraction": "mdl.pack_data_fraction is gone: a packed sweep's packs are sized when it is launched, "
    "by the data their sources declare, against mdl.pack_data_gb (GB of data per pack, e.g. mdl.pack_data_gb=40)",
}


def retired_key_error(override: str) -> str | None:
    """The message for a command-line override of a retired key (``mdl.engine=stacked``, ``+mdl.engine=...``)."""
    key = override.split("=", 1)[0].lstrip("+~")
    return next((why for old, why in RETIRED_KEYS.items() if key == old or key.startswith(old + ".")), None)


def refuse_retired_keys(cfg: DictConfig) -> None:
    """A retired key in a config (added with ``+``, or from a preset of one's own) names its replacement."""
    absent = object()
    for key, why in RETIRED_KEYS.items():
        if OmegaConf.select(cfg, key, default=absent, throw_on_missing=False) is not absent:
            raise ValueError(why)


def probes_enabled(cfg: DictConfig) -> bool:
    """Whether the max-ent probes (conf/probes) are on; a config without the group has them off."""
    return bool(OmegaConf.select(cfg, "probes.enabled", default=False))


@functools.cache
def conf_file(path: Path) -> DictConfig:
    """A config file, read once per process and read-only: the checks read each group's files several times (what
    they name, the keys they define), and every load of all of them took a tenth of a second before the first line."""
    node = OmegaConf.load(path)
    OmegaConf.set_readonly(node, True)
    return node


def group_file(group: str, name: str) -> DictConfig:
    """What conf/<group>/<name>.yaml gives its group: the file, or the ``<group>`` node of a file in the global
    package (a model's file also sets its mdl.members_per_fit)."""
    path = CONF_DIR / group / f"{name}.yaml"
    node = conf_file(path)
    if path.read_text().startswith("# @package _global_"):
        return node.get(group) or OmegaConf.create({})
    return node


def known_keys(group: str) -> set[str]:
    """The keys the files of ``group`` define, and those the model files set in it (mdl.members_per_fit)."""
    files = [conf_file(path) for path in (CONF_DIR / group).glob("*.yaml")]
    by_models = [conf_file(path).get(group) or {} for path in (CONF_DIR / "model").glob("*.yaml")]
    return set().union(*(node.keys() for node in files), *(node.keys() for node in by_models)) - {"defaults"}


def refuse_unknown_keys(cfg: DictConfig, group: str) -> None:
    """A key added to ``group`` on the command line (``+trainer.patiense=1``) that none of the group's
    config files defines would be ignored silently: refuse it, naming the nearest known key."""
    known = known_keys(group)
    for key in cfg.get(group) or {}:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(map(str, known)), n=1)
            hint = f"did you mean {group}.{near[0]}? " if near else ""
            raise ValueError(
                f"{group}.{key}: unknown setting, it would be ignored; {hint}"
                f"{group} takes {', '.join(sorted(map(str, known)))}"
            )


def conf_names(key: str) -> list[str]:
    """The values of ``key`` (``eraser.name``) that the files of its config group set."""
    group, leaf = NAMED_BY_GROUP[key], key.split(".", 1)[1]
    files = (group_file(group, path.stem) for path in (CONF_DIR / group).glob("*.yaml"))
    return sorted({str(v) for node in files if (v := node.get(leaf)) is not None})


def check_before_imports(cfg: DictConfig) -> None:
    """Every check that needs no torch, names against the config groups' files: launch.py runs it first."""
    for key, group in NAMED_BY_GROUP.items():
        value, known = OmegaConf.select(cfg, key), conf_names(key)
        if value not in known:
            near = difflib.get_close_matches(str(value), known, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"unknown {group} {value!r} ({key}); {hint}choose one of {known} with {group}=<name>")
    check_config(cfg)


def check_model_options(cfg: DictConfig) -> None:
    """Model options the model's config file does not define (ignored, or refused by the builder after the data are
    loaded), and option values its builder refuses."""
    model, options = cfg.model.name, cfg.model.get("options") or {}
    path = CONF_DIR / "model" / f"{model}.yaml"
    known = sorted(map(str, (group_file("model", model).get("options") or {}).keys())) if path.is_file() else None
    for key, value in options.items():
        if known is not None and key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean model.options.{near[0]}? " if near else ""
            raise ValueError(
                f"model.options.{key}: model {model!r} takes no such option; {hint}it takes {', '.join(known) or 'none'}"
            )
        allowed = MODEL_OPTION_VALUES.get((model, str(key)))
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"model.options.{key}={value!r}: model {model!r} takes one of {list(allowed)}; "
                f"e.g. model.options.{key}={allowed[0]}"
            )


def validate_config(cfg: DictConfig) -> None:
    """Fail before any data is loaded or any eraser fitted (minutes on CIFAR-10) on names that do
    not exist and sizes that cannot work, with the setting, the smallest value that works and a usual one."""
    from datamodules import available_sources
    from datamodules.settings import check_data_settings, check_eraser_options
    from datamodules.sources import check_source_options
    from erasure import available_erasers
    from models import available_models
    from models.precision import check_compile

    if cfg.eraser.name not in available_erasers():
        raise ValueError(f"unknown eraser {cfg.eraser.name!r}; choose one of {available_erasers()} with eraser=<name>")
    if cfg.model.name not in available_models():
        raise ValueError(f"unknown model {cfg.model.name!r}; choose one of {available_models()} with model=<name>")
    if cfg.data.source not in available_sources():
        raise ValueError(
            f"unknown data source {cfg.data.source!r} (data.source); choose one of {available_sources()} with data=<name>"
        )
    check_config(cfg)
    check_compile(cfg.trainer.compile)
    check_source_options(cfg.data.source, cfg.data.get("options") or {})
    check_eraser_options(cfg.eraser.name, cfg.eraser.get("options") or {})
    d = cfg.data
    check_data_settings(
        d.val_size, d.test_size, d.batch_size, d.eval_batch_size, d.qda_regularization, d.padding_fraction
    )


def check_config(cfg: DictConfig) -> None:
    """The checks of validate_config that need no torch (no registry, no data module)."""

    def require_int(key: str, low: int, usual: str, allowed: tuple[Any, ...] = ()) -> None:
        value = OmegaConf.select(cfg, key)
        if value in allowed and not isinstance(value, bool):
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            also = "".join(f" or {'null' if v is None else v}" for v in allowed)
            raise ValueError(f"{key}={value!r}: must be an integer >= {low}{also}; e.g. {key}={usual}")

    refuse_retired_keys(cfg)
    members_per_fit(cfg.mdl)  # all, auto or an integer >= 1
    check_paper_loss(cfg.mdl.paper_loss)
    for key, values in CHOICES.items():
        value = OmegaConf.select(cfg, key, default=values[0])
        if not any(value is v if isinstance(v, bool) or v is None else value == v for v in values):
            shown = ", ".join(
                "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in values
            )
            raise ValueError(f"{key}={value!r}: choose one of {shown}")
    check_logger(cfg)
    for name, spec in (cfg.get("callbacks") or {}).items():
        if not (isinstance(spec, DictConfig) and spec.get("_target_")):
            raise ValueError(
                f"callbacks.{name}={spec!r}: a callback needs a class to build; "
                f"e.g. +callbacks.{name}._target_=lightning.pytorch.callbacks.ModelSummary"
            )
    for group in ("trainer", "mdl", "data"):
        refuse_unknown_keys(cfg, group)
    check_model_options(cfg)
    for key, low, usual in (
        ("seed", 0, "0"),
        ("data_seed", 0, "0"),
        ("width", 1, "128"),
        ("depth", 1, "2"),
        ("mdl.num_blocks", 2, "10"),
        ("mdl.first_block", 1, "1024"),
        ("trainer.patience", 0, "30"),
        ("model.base_depth", 1, "2"),
        ("mdl.steps_per_group", 1, "16"),
        ("mdl.min_steps_per_pass", 1, "128"),
    ):
        require_int(key, low, usual)
    for key, zero, says in (  # finite numbers >= 0 (``zero``: 0 allowed) or > 0
        (
            "mdl.checkpoint_every_s",
            True,
            "must be a finite number of seconds >= 0 (0 = every pass); e.g. mdl.checkpoint_every_s=30",
        ),
        ("mdl.lock_lease_s", False, "must be a finite number of seconds > 0; e.g. mdl.lock_lease_s=300"),
        # used only by packed sweeps, refused in any run: one rule
        (
            "mdl.pack_data_gb",
            False,
            "give the most GB of data one pack of hydra/launcher=packed holds, a number > 0; e.g. mdl.pack_data_gb=40",
        ),
    ):
        value = OmegaConf.select(cfg, key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (number and (value >= 0 if zero else value > 0)):
            raise ValueError(f"{key}={value!r}: {says}")
    require_int("model.base_width", 1, "128", allowed=(None,))
    require_int("trainer.kwargs.max_epochs", 1, "200", allowed=(-1, None))  # -1: until early stopping
    lr = cfg.optimizer.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        why = ""
        if lr is None and cfg.get("lr_search") is not None:  # +lr=best (mdl.report.lr.write_best_lrs)
            why = (
                f" (the lr search's table, +lr=best, has none for data {cfg.data.source}, model {cfg.model.name}, "
                f"eraser {cfg.eraser.name}: search with these, or leave +lr=best out)"
            )
        elif lr is None:
            why = f" (no default for data.source={cfg.data.source!r} in optimizer.lr_by_data)"
        raise ValueError(f"optimizer.lr={lr!r}{why}: must be a positive number; e.g. optimizer.lr=5e-4")
    if probes_enabled(cfg):
        require_int("probes.n_per_class", 1, "200", allowed=(None,))
        if not OmegaConf.select(cfg, "protocol.final_fit", default=True):
            raise ValueError(
                "probes=maxent scores every epoch of the final fit, which protocol.final_fit=false does not train "
                f"(protocol={cfg.protocol.name}): set protocol.final_fit=true, or leave probes=none"
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
        raise ValueError(
            f"trainer.kwargs.devices={kwargs.devices}: a run trains on one device; pick it with device=cuda:N"
        )
    from mdl.engine.device import training_device
    from models.precision import check_precision

    check_precision(cfg.trainer.precision)  # trainer.compile: validate_config, which every caller runs first
    return training_device(cfg.device, cfg.data.get("device"), kwargs.get("accelerator"))
