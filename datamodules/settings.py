"""The data settings a run may give, and their checks: each error names the setting and a value that works."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable

import torch

from erasure.base import eraser_class, eraser_options


AUGMENT_ORDERS = ("erase_then_augment", "augment_then_erase")


# Source options that do not change the data (only how it is fetched or decoded).


ERASE_CHUNK = 8192  # rows erased at once (bounds the float64 temporaries of the erasers)


BALANCE_METHODS = ("suby", "rwy")


TRANSFORMS = ("covariance_power",)


TRANSFORM_ORDERS = ("before_eraser", "after_eraser")


FIT_SCOPES = ("split", "pool")


TRANSFORM_EXAMPLE = "data.transform='{name:covariance_power,p:-0.5,eps:1.0e-6,order:before_eraser}'"


def resolve_device(name: str, setting: str = "data.device") -> torch.device:
    """auto | cpu | cuda | cuda:N -> a device that exists here (``setting`` names the key in errors)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"{setting}={name!r} is not a device; use auto, cpu, cuda or cuda:N") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{setting}={name!r}: only cpu and cuda devices are supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{setting}={name} asks for a GPU but torch sees none here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}); run with {setting}=cpu or {setting}=auto, or on a GPU node"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{setting}={name}: only {torch.cuda.device_count()} GPU(s) visible here; use cuda:0..")
    return device


def check_balance(balance: Any) -> str | None:
    if balance is not None and balance not in BALANCE_METHODS:
        raise ValueError(
            f"data.balance={balance!r}: use null (no balancing), suby (subsample every class to the smallest "
            f"class's count) or rwy (draw each epoch's batches with replacement, probability inversely proportional "
            f"to class frequency)"
        )
    return balance


def check_transform(transform: Any) -> dict[str, Any] | None:
    """The ``data.transform`` setting as a plain dict with every key checked (None = off)."""
    if transform is None:
        return None
    if not isinstance(transform, dict):
        raise ValueError(f"data.transform={transform!r}: use null or a mapping, e.g. {TRANSFORM_EXAMPLE}")
    cfg = dict(transform)
    missing = [k for k in ("name", "p", "eps", "order") if k not in cfg]
    unknown = sorted(set(cfg) - {"name", "p", "eps", "order"})
    if missing or unknown:
        raise ValueError(
            f"data.transform: missing keys {missing}, unknown keys {unknown}; it takes name, p, eps and order, "
            f"e.g. {TRANSFORM_EXAMPLE}"
        )
    if cfg["name"] not in TRANSFORMS:
        raise ValueError(f"data.transform.name={cfg['name']!r}: choose one of {list(TRANSFORMS)}")
    if cfg["order"] not in TRANSFORM_ORDERS:
        raise ValueError(f"data.transform.order={cfg['order']!r}: choose one of {list(TRANSFORM_ORDERS)}")
    from erasure.covariance_power import check_transform_options

    check_transform_options(cfg["p"], cfg["eps"])
    return cfg


# erasers whose conf/eraser/<name>.yaml fits them on the training and validation splits (fit_scope: pool)
POOLED_ERASERS = ("leace", "qleace", "alf_qleace")


def default_options(name: str) -> dict[str, Any]:
    """An eraser's options at their code defaults (conf/eraser/<name>.yaml repeats them), so a
    ``rank_from`` fit shares its cache entry with a run of that eraser at its config defaults."""
    cls = eraser_class(name)
    params = [p for p in inspect.signature(cls.fit).parameters.values() if p.name in eraser_options(cls)]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {"zscore": False, **{k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}}


RANK_FROM_OPTIONS = (
    "rank_from",
    "rank_from_options",
)  # eraser=random: its rank from another eraser's (ErasedDataModule)


def check_eraser_options(name: str, options: dict[str, Any]) -> None:
    """An option the eraser does not take (``+eraser.options.shrinkge=0.1``), refused with the nearest before the data
    are loaded (fit_eraser would refuse it only when it fits, after them)."""
    known = sorted([*default_options(name), *(RANK_FROM_OPTIONS if name == "random" else ())])
    refuse_unknown(options, known, "eraser.options", f"eraser {name!r} takes no such option")


def refuse_unknown(given: Iterable[Any], known: list[str], setting: str, refusal: str, takes: str = "it takes") -> None:
    """A key of ``given`` not in ``known`` would be ignored silently (``+data.options.n_tset=0``): refuse it as
    ``setting.<key>: <refusal>``, naming the nearest known key and every known one."""
    for key in given:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {setting}.{near[0]}? " if near else ""
            raise ValueError(f"{setting}.{key}: {refusal}; {hint}{takes} {', '.join(known) or 'none'}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_data_settings(
    val_size: Any, test_size: Any, batch_size: Any, eval_batch_size: Any, qda_regularization: Any, padding_fraction: Any
) -> None:
    """Refuse sizes that cannot work before anything is loaded or fitted, naming the setting."""
    minimums = {  # key: (value, smallest that works, what it is, a usual value)
        "val_size": (val_size, 1, "early stopping and the paper MDL score every model on it", "300 (the paper: 2048)"),
        "test_size": (test_size, 0, "held out when the source has no official test split; 0 = none", "300"),
        "batch_size": (batch_size, 1, "examples per training step", "128"),
        "eval_batch_size": (eval_batch_size, 1, "examples per evaluation step", "1024"),
    }
    for key, (value, low, what, usual) in minimums.items():
        if not _is_int(value) or value < low:
            raise ValueError(f"data.{key}={value!r}: must be an integer >= {low} ({what}); e.g. data.{key}={usual}")
    if isinstance(qda_regularization, bool) or not (
        isinstance(qda_regularization, (int, float)) and qda_regularization > 0
    ):
        raise ValueError(
            f"data.qda_regularization={qda_regularization!r}: must be > 0 (it ridges singular covariances), e.g. 1e-3"
        )
    if isinstance(padding_fraction, bool) or not (
        isinstance(padding_fraction, (int, float)) and 0 <= padding_fraction < 1
    ):
        raise ValueError(
            f"data.padding_fraction={padding_fraction!r}: must lie in [0, 1) (crop padding / image side), e.g. 0.125"
        )


ZSCORE_AFTER = (
    "after_eraser"  # data.zscore: standardise the erased splits (the original's --normalize of an erased copy)
)


def check_erasure_settings(
    augment_order: str,
    eval_labels: bool | str,
    zscore: Any,
    transform_cfg: dict[str, Any] | None,
    fit_scope: str,
    pooled: bool,
) -> None:
    """Settings of how the data is erased and evaluated, and the combinations that cannot work. ``pooled``: the
    eraser is fitted once on training + validation (fit_scope pool, for an eraser that edits its own fitting data)."""
    if augment_order not in AUGMENT_ORDERS:
        raise ValueError(f"data.augment_order must be one of {AUGMENT_ORDERS}, got {augment_order!r}")
    if not (eval_labels is True or eval_labels == "predicted"):
        raise ValueError(
            f"data.eval_labels must be true (erase val/test with their true labels, as the paper did) "
            f"or predicted (labels from a QDA fitted on the training split), got {eval_labels!r}"
        )
    if not (isinstance(zscore, bool) or zscore == ZSCORE_AFTER):
        raise ValueError(
            f"data.zscore={zscore!r}: use true (standardise every pixel and channel with the training "
            f"split's mean and std before erasure, as Figure 16), {ZSCORE_AFTER} (the same, fitted on the "
            f"erased training split, after erasure) or false"
        )
    if zscore == ZSCORE_AFTER and augment_order == "augment_then_erase":
        raise ValueError(
            "data.zscore=after_eraser standardises the stored erased splits, but "
            "data.augment_order=augment_then_erase erases each augmented batch later; use "
            "data.augment_order=erase_then_augment, or data.zscore=true"
        )
    if transform_cfg is not None and augment_order == "augment_then_erase":
        raise ValueError(
            "data.transform is applied to the stored splits, but data.augment_order=augment_then_erase keeps "
            "the training images raw and erases each augmented batch; use data.augment_order=erase_then_augment "
            "with a transform"
        )
    if fit_scope not in FIT_SCOPES:
        raise ValueError(
            f"eraser.fit_scope={fit_scope!r}: choose one of {list(FIT_SCOPES)} (split: fitted on "
            f"each split it edits; pool: once on the training and validation splits together)"
        )
    if pooled and eval_labels != True:  # noqa: E712 (eval_labels is True or "predicted")
        raise ValueError(
            "eraser.fit_scope=pool edits the validation split with its true labels (as the original); "
            "it cannot be combined with data.eval_labels=predicted: use eraser.fit_scope=split"
        )
