"""The LightningDataModule: load a source, split it by data_seed, fit the eraser, serve batches.

Erasure happens once, in ``setup``, and its results are cached on disk (``datamodules.cache``):
the fitted eraser under a key of (source, split, eraser config), the erased splits under that key
plus the evaluation-label mode and augmentation order. Every job of a sweep that shares those
reuses them; a cache hit does not even load the source. Afterwards every split is one tensor on
the training device and batches come from ``DeviceBatches``. The training split is stored in its
(seeded) shuffled order, which is also the prequential order: ``use_prefix(n)`` makes the
loaders serve its first n examples.

Label-dependent erasers (``requires_labels``, e.g. qleace) need a class for every example they
map; an eraser that only edits the data it was fitted on (gradient) is fitted again on the
validation and on the test split, with labels chosen the same way. The training split always uses its true labels (it is the data being learned, and the
prequential blocks are scored on it as erased). Validation and test use ``eval_labels``:
``true`` (the paper's choice: their true labels, which leaks label information into
evaluation) or ``predicted`` (the class a quadratic discriminant fitted on the training split's
moments assigns: no evaluation label is used).

Two optional steps around the eraser (both off by default, both part of the cache keys):
``balance`` (the gradient-starvation thesis, ch. 8): suby subsamples the training split by class before
it is stored, so before the prequential order; rwy keeps it and draws every epoch's training batches
class-balanced (datamodules/loader.py); validation and test are untouched.
``transform`` (covariance_power, the preconditioning abstract) maps every split with
x -> mu + c Sigma^{p/2} (x - mu), Sigma the training covariance, either before the eraser (the
eraser is then fitted on transformed data) or after it (fitted on the erased training split).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import warnings
from typing import Any, Callable

import lightning as L
import torch
from torch import Tensor

from datamodules.cache import ErasureCache, cache_key
from datamodules.loader import BatchTransform, DeviceBatches, GroupedBatches
from datamodules.qda import QuadraticDiscriminant
from datamodules.stacked_batches import StackedBatches
from datamodules.sources import ImageSet, ImageSource, load_source
from erasure import CovariancePower, erasure_report, Eraser, class_moments, fit_covariance_power, fit_eraser
from erasure.diagnostics import erasure_shortfall, probe_shortfall
from erasure.base import FORMAT_VERSION as ERASER_FORMAT_VERSION
from erasure.base import eraser_class

log = logging.getLogger(__name__)

AUGMENT_ORDERS = ("erase_then_augment", "augment_then_erase")
# Source options that do not change the data (only how it is fetched or decoded).
NON_DATA_OPTIONS = ("download", "decode_batch_size")
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


def seeded_split(n: int, sizes: list[int], data_seed: int) -> list[Tensor]:
    """A random permutation of range(n) cut into consecutive pieces; the remainder comes last."""
    if sum(sizes) >= n:
        raise ValueError(f"split sizes {sizes} leave no training data out of {n} examples; lower val_size/test_size")
    g = torch.Generator().manual_seed(data_seed)
    perm = torch.randperm(n, generator=g)
    pieces, start = [], 0
    for size in sizes:
        pieces.append(perm[start : start + size])
        start += size
    pieces.append(perm[start:])
    return pieces


def check_balance(balance: Any) -> str | None:
    if balance is not None and balance not in BALANCE_METHODS:
        raise ValueError(
            f"data.balance={balance!r}: use null (no balancing), suby (subsample every class to the smallest "
            f"class's count) or rwy (draw each epoch's batches with replacement, probability inversely proportional "
            f"to class frequency)"
        )
    return balance


def balance_indices(y: Tensor, method: str, data_seed: int) -> Tensor:
    """Positions into the training labels ``y`` (already in their seeded order) that make the stored
    training split, in its stored (prequential) order.

    suby: every class keeps its first m examples in that order, m the smallest class count (classes
    absent from the split are ignored); the kept examples keep their relative (random) order.
    rwy: every example, as it is: RWY reweights the *sampling* of each epoch (datamodules/loader.py
    ``class_balanced_weights``), never the stored data. It once drew one fixed bootstrap here, which
    put copies of training examples into the blocks the online code scores (35.6% on digits)."""
    check_balance(method)
    if method == "rwy":
        return torch.arange(len(y))
    y = y.cpu()
    counts = torch.bincount(y)
    smallest = int(counts[counts > 0].min())
    rank_in_class = torch.empty_like(y)
    for c in torch.nonzero(counts).flatten().tolist():
        where = torch.nonzero(y == c).flatten()
        rank_in_class[where] = torch.arange(len(where))
    return torch.nonzero(rank_in_class < smallest).flatten()


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


def apply_transform(transform: CovariancePower, x: Tensor) -> Tensor:
    """Apply the transform in chunks (same dtype, on x's device); p = 0 returns x itself."""
    if transform.is_identity:
        return x
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], ERASE_CHUNK):
        out[start : start + ERASE_CHUNK] = transform(x[start : start + ERASE_CHUNK])
    bad = int((~torch.isfinite(out)).sum())
    if bad:  # the data were finite when loaded (sources.check_source): the transform made these
        raise ValueError(
            f"data.transform (covariance_power, p={transform.p:g}, eps={transform.eps:g}) made {bad} values NaN or "
            f"infinite in {out.dtype} (the covariance's condition number is {transform.condition_before:.3g}, and "
            f"Sigma^(p/2) spreads it to the power |p|/2); choose p closer to 0 (-1 whitens) or a larger eps"
        )
    return out


def eraser_on(eraser: Eraser, device: torch.device) -> Eraser:
    """The same eraser with its tensors on ``device`` (so applying it per batch moves nothing)."""
    moved = {name: t.to(device) for name, t in eraser.tensors().items()}
    return dataclasses.replace(eraser, **moved) if moved else eraser


def erase(eraser: Eraser, x: Tensor, labels: Tensor | None) -> Tensor:
    """Apply ``eraser`` in chunks (float32 out, on x's device)."""
    if not getattr(eraser, "can_transform_new_data", True):
        return eraser(x, labels)  # edits exactly the data it was fitted on: one call
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], ERASE_CHUNK):
        sl = slice(start, start + ERASE_CHUNK)
        out[sl] = eraser(x[sl], labels[sl] if labels is not None else None)
    return out


def needs_eval_labels(eraser: Eraser) -> bool:
    """Label-dependent maps (qleace) and data-editing erasers (gradient, refitted per split) use
    labels on val/test; every other eraser maps them without."""
    return bool(eraser.requires_labels) or not getattr(eraser, "can_transform_new_data", True)


def _report_gaps(report: dict[str, float]) -> tuple[dict[str, float], dict[str, float]] | None:
    """(before, after) moment gaps out of an ``erasure_report``, or None without diagnostics."""
    split = [{k[: -len(when)]: v for k, v in report.items() if k.endswith(when)} for when in ("_before", "_after")]
    return (split[0], split[1]) if split[0] and split[1] else None


def not_erased(eraser: Eraser, split: str, gaps: tuple[dict[str, float], dict[str, float]] | None) -> list[str]:
    """A warning when the eraser left the class moments it targets almost as they were: a run on
    such data measures no erasure, whatever its name says."""
    missed = erasure_shortfall(*gaps, eraser.targeted_gaps()) if gaps is not None else []
    if not missed:
        return []
    return [
        f"the {eraser.name!r} eraser did not erase on the {split} split: {', '.join(missed)} (less than 10% "
        f"removed), so this run trains and evaluates on nearly unerased data. To fix it: {eraser.tuning_hint()}"
    ]


def criterion_check(
    eraser: Eraser, report: dict[str, float], checks: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """(record, warnings) for an eraser that declares a probe criterion (``criterion_probes``, the
    gradient eraser). The paper's criterion (Sec. 2.4: the data "close to the original images" with
    "almost no quadratically available information") is read as every held-out probe at most
    ``checks.criterion_points`` above chance, and the relative RMS change at most
    ``checks.max_relative_rms_change`` (when the eraser records one); (None, []) otherwise."""
    keys = tuple(getattr(eraser, "criterion_probes", ()))
    if not keys:
        return None, []
    checks = checks or {}
    points = float(checks.get("criterion_points", getattr(eraser, "criterion_points", 0.02)))
    rms, rms_bound = getattr(eraser, "relative_rms_change", None), checks.get("max_relative_rms_change")
    far = rms is not None and rms_bound is not None and math.isfinite(rms) and rms > float(rms_bound)
    distance = [] if not far else [
        f"the {eraser.name!r} eraser moved the images too far to count as close to the originals (paper Sec. 2.4): "
        f"relative RMS change {rms:.3g} > eraser.checks.max_relative_rms_change={rms_bound}; to fix it: raise "
        f"eraser.options.distance_weight or lower the mean and covariance weights"
    ]
    checked = [key for key in keys if f"{key}_after" in report]
    if "chance" not in report or not checked:
        return {"checked": False, "relative_rms_change": rms}, distance + [
            f"the {eraser.name!r} eraser's criterion (probes within {100 * points:g} points of chance) was not checked: "
            f"no probe accuracy in the erasure diagnostics (data.diagnostics=true computes them)"
        ]
    missed = probe_shortfall(report, checked, points)
    record = {"checked": True, "met": not missed and not far, "points": points, "chance": report["chance"],
              **{key: report[f"{key}_after"] for key in checked},
              "relative_rms_change": rms, "max_relative_rms_change": rms_bound}
    if not missed:
        return record, distance
    gaps = ", ".join(f"{key} {report[f'{key}_after']:.4g}" for key in ("max_mean_gap", "max_cov_gap") if f"{key}_after" in report)
    return record, [
        f"the {eraser.name!r} eraser did not erase enough to meet the paper's criterion (almost no quadratically "
        f"available information, section 2.4; here: held-out {' and '.join(checked)} within {100 * points:g} points "
        f"of chance {report['chance']:.3f}): {', '.join(missed)}; residual {gaps}. To fix it: {eraser.tuning_hint()}"
    ] + distance


def quadratic_leftover(eraser: Eraser, report: dict[str, float], points: float | None) -> list[str]:
    """A warning when an eraser that targets class covariances (``erases_quadratic``) leaves a held-out
    quadratic probe more than ``points`` above chance: the data still carries quadratically available
    class information, whatever the eraser's name says (QLEACE on digits: QDA 96% against chance 10%)."""
    if not getattr(eraser, "erases_quadratic", False) or points is None:
        return []
    if "qda_acc_after" not in report or "chance" not in report or report["qda_acc_after"] <= report["chance"] + points:
        return []
    return [
        f"after the {eraser.name!r} eraser a held-out quadratic probe (QDA) still reads {report['qda_acc_after']:.3f} "
        f"against chance {report['chance']:.3f} (more than eraser.checks.qda_warning_points={points} above): class "
        f"information is still quadratically available (e.g. in singular class covariances, or from a fit that "
        f"stopped early), so this run does not measure learning without it"
    ]


def diagnostics_summary(report: dict[str, float]) -> str:
    """One log line: residual moment gaps and held-out probe accuracies, before -> after."""
    names = {"max_mean_gap": "max mean gap", "max_cov_gap": "max cov gap", "linear_probe_acc": "linear probe", "qda_acc": "QDA"}
    parts = [f"{label} {report[f'{key}_before']:.4g} -> {report[f'{key}_after']:.4g}"
             for key, label in names.items() if f"{key}_before" in report and f"{key}_after" in report]
    if "chance" in report:
        parts.append(f"chance {report['chance']:.3f}")
    return "erasure diagnostics: " + (", ".join(parts) or "none computed")


def default_options(name: str) -> dict[str, Any]:
    """An eraser's options at their code defaults (conf/eraser/<name>.yaml repeats them), so a
    ``rank_from`` fit shares its cache entry with a run of that eraser at its config defaults."""
    params = list(inspect.signature(eraser_class(name).fit).parameters.values())[3:]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {"zscore": False, **{k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}}


def edit_rank(eraser: Eraser) -> int:
    """The number of directions an eraser edits (``edit_rank``, or ``rank`` for leace and random)."""
    meta = eraser.metadata()
    for key in ("edit_rank", "rank"):
        if isinstance(meta.get(key), int) and not isinstance(meta.get(key), bool):
            return int(meta[key])
    raise ValueError(
        f"eraser.options.rank_from={eraser.name}: the {eraser.name!r} eraser edits no fixed number of directions "
        f"(it records no edit rank); use alf_qleace or leace, or give eraser.options.rank"
    )


@dataclasses.dataclass(frozen=True)
class Splits:
    train: ImageSet
    val: ImageSet
    test: ImageSet
    classes: list[str]
    balance: dict[str, Any] | None = None  # class counts of the training split before / after balancing
    zscore: dict[str, Any] | None = None  # data.zscore: what the standardisation was fitted on


def standardised(splits: Splits) -> Splits:
    """Every split z-scored per (pixel, channel) with the training split's mean and standard deviation
    (float64 statistics, float32 data), before any eraser sees the data: the condition of the paper's
    Figure 16 and its table. As the original code (EleutherAI/mdl experiments/cli.py normalize_dataset,
    commit 0cc7065): per-coordinate mean and std, std + float32 eps (a constant pixel maps to 0, not NaN),
    applied to the images before erasure and augmentation, so crops pad with the mean. Ours: the
    statistics come from the training split only (the original's came from its pool minus a 1024-image
    validation set, which held the sweep's own validation and test chunks)."""
    x = splits.train.x.double().flatten(1)
    mean, std = x.mean(0), x.std(0) + torch.finfo(torch.float32).eps

    def z(images: ImageSet) -> ImageSet:
        shape = images.x.shape
        out = ((images.x.double().flatten(1) - mean.to(images.x.device)) / std.to(images.x.device)).float()
        return ImageSet(out.view(shape), images.y)

    info = {"statistics": "training split", "examples": int(x.shape[0]),
            "constant_features": int((std <= 2 * torch.finfo(torch.float32).eps).sum())}
    log.info("data.zscore: every split standardised with the training split's mean and std (%d constant features)",
             info["constant_features"])
    return dataclasses.replace(splits, train=z(splits.train), val=z(splits.val), test=z(splits.test), zscore=info)


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
    if isinstance(qda_regularization, bool) or not (isinstance(qda_regularization, (int, float)) and qda_regularization > 0):
        raise ValueError(f"data.qda_regularization={qda_regularization!r}: must be > 0 (it ridges singular covariances), e.g. 1e-3")
    if isinstance(padding_fraction, bool) or not (isinstance(padding_fraction, (int, float)) and 0 <= padding_fraction < 1):
        raise ValueError(f"data.padding_fraction={padding_fraction!r}: must lie in [0, 1) (crop padding / image side), e.g. 0.125")


class ErasedDataModule(L.LightningDataModule):
    def __init__(
        self,
        source: str,
        eraser: dict[str, Any],
        data_seed: int = 0,
        seed: int = 0,
        options: dict[str, Any] | None = None,
        val_size: int = 300,
        test_size: int = 300,
        batch_size: int = 128,
        eval_batch_size: int = 1024,
        augment: bool = False,
        flip: bool = True,
        augment_order: str = "erase_then_augment",
        eval_labels: bool | str = True,
        device: str = "auto",
        padding_fraction: float = 0.125,
        pad_mode: str = "constant",
        cache_dir: str | None = None,
        qda_regularization: float = 1e-3,
        diagnostics: bool = True,
        balance: str | None = None,
        transform: dict[str, Any] | None = None,
        zscore: bool = False,
    ) -> None:
        super().__init__()
        check_data_settings(val_size, test_size, batch_size, eval_batch_size, qda_regularization, padding_fraction)
        if augment_order not in AUGMENT_ORDERS:
            raise ValueError(f"data.augment_order must be one of {AUGMENT_ORDERS}, got {augment_order!r}")
        if not (eval_labels is True or eval_labels == "predicted"):
            raise ValueError(
                f"data.eval_labels must be true (erase val/test with their true labels, as the paper did) "
                f"or predicted (labels from a QDA fitted on the training split), got {eval_labels!r}"
            )
        self.balance = check_balance(balance)
        if not isinstance(zscore, bool):
            raise ValueError(f"data.zscore={zscore!r}: use true (standardise every pixel and channel with the training "
                             f"split's mean and std before erasure, as Figure 16) or false")
        self.zscore = zscore
        self.transform_cfg = check_transform(transform)
        if self.transform_cfg is not None and augment_order == "augment_then_erase":
            raise ValueError(
                "data.transform is applied to the stored splits, but data.augment_order=augment_then_erase keeps "
                "the training images raw and erases each augmented batch; use data.augment_order=erase_then_augment "
                "with a transform"
            )
        self._transform: CovariancePower | None = None
        self.source_name = source
        self.source_options = dict(options or {})
        self.eraser_cfg = dict(eraser)
        # how the run judges the erasure (warning thresholds): not part of what is computed, so not of cache keys
        self.eraser_checks = dict(self.eraser_cfg.get("checks") or {})
        self.fit_scope = self.eraser_cfg.get("fit_scope", "split")
        if self.fit_scope not in FIT_SCOPES:
            raise ValueError(f"eraser.fit_scope={self.fit_scope!r}: choose one of {list(FIT_SCOPES)} (split: fitted on "
                             f"each split it edits; pool: once on the training and validation splits together)")
        if self._fits_pool() and eval_labels != True:  # noqa: E712 (eval_labels is True or "predicted")
            raise ValueError("eraser.fit_scope=pool edits the validation split with its true labels (as the original); "
                             "it cannot be combined with data.eval_labels=predicted: use eraser.fit_scope=split")
        self.data_seed, self.seed = data_seed, seed
        self.val_size, self.test_size = val_size, test_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.augment, self.flip, self.augment_order = augment, flip, augment_order
        self.padding_fraction, self.pad_mode = padding_fraction, pad_mode
        self.eval_labels = eval_labels
        self.qda_regularization = qda_regularization
        self.run_diagnostics = diagnostics
        self.device = resolve_device(device)
        self.cache = ErasureCache(cache_dir)
        self.prefix: int | None = None
        self.steps_per_group = 1  # training batches per Lightning step (use_prefix)
        self.eraser: Eraser | None = None
        self.train_set: ImageSet | None = None
        self.diagnostics: dict[str, Any] = {}
        self._batch_eraser: BatchTransform | None = None

    # --- cache keys --------------------------------------------------------------------------

    def source_identity(self) -> dict[str, Any]:
        options = {k: v for k, v in self.source_options.items() if k not in NON_DATA_OPTIONS}
        return {"name": self.source_name, "options": options}

    def split_identity(self) -> dict[str, Any]:
        split = {"data_seed": self.data_seed, "val_size": self.val_size, "test_size": self.test_size}
        if self.balance is not None:  # keys of runs without balancing stay as they were
            split["balance"] = self.balance
        if self.zscore:
            split["zscore"] = True
        return split

    def eraser_key(self, eraser_cfg: dict[str, Any] | None = None) -> str:
        parts: dict[str, Any] = {}
        if self.transform_cfg is not None and self.transform_cfg["order"] == "before_eraser":
            parts["transform"] = self.transform_cfg  # the eraser is fitted on transformed data
        cfg = self.eraser_cfg if eraser_cfg is None else eraser_cfg
        return cache_key(
            kind="eraser", source=self.source_identity(), split=self.split_identity(),
            eraser={k: v for k, v in cfg.items() if k != "checks"}, eraser_format=ERASER_FORMAT_VERSION, **parts,
        )

    def _fits_pool(self) -> bool:
        """Whether the eraser is fitted once on training + validation (eraser.fit_scope=pool; only for
        erasers that edit their own fitting data: a map learnt on the training split serves the others)."""
        return self.fit_scope == "pool" and not eraser_class(self.eraser_cfg["name"]).can_transform_new_data

    def data_key(self) -> str:
        evaluation = {"eval_labels": self.eval_labels}
        if self.eval_labels == "predicted":
            evaluation["qda_regularization"] = self.qda_regularization
        parts = {"transform": self.transform_cfg} if self.transform_cfg is not None else {}
        return cache_key(
            kind="erased", eraser=self.eraser_key(), evaluation=evaluation, augment_order=self.augment_order, **parts
        )

    # --- setup -------------------------------------------------------------------------------

    def _load_splits(self) -> Splits:
        src: ImageSource = load_source(self.source_name, **self.source_options)
        x, y = src.train.x, src.train.y
        held = self.val_size + (self.test_size if src.test is None else 0)
        if held >= len(y):
            sizes = "data.val_size" + (" + data.test_size" if src.test is None else "")
            raise ValueError(
                f"{sizes} = {held} leaves no training examples out of the {len(y)} of data source "
                f"{self.source_name!r}; lower {sizes.replace(' + ', ' and ')} (at most {len(y) - 1} in all)"
            )
        if src.test is None:
            val_idx, test_idx, train_idx = seeded_split(len(y), [self.val_size, self.test_size], self.data_seed)
            test = ImageSet(x[test_idx], y[test_idx])
        else:
            val_idx, train_idx = seeded_split(len(y), [self.val_size], self.data_seed)
            test = src.test
        balance = None
        if self.balance is not None:
            before = torch.bincount(y[train_idx], minlength=len(src.classes))
            train_idx = train_idx[balance_indices(y[train_idx], self.balance, self.data_seed)]
            after = torch.bincount(y[train_idx], minlength=len(src.classes))
            balance = {"method": self.balance, "class_counts_before": before.tolist(), "class_counts_after": after.tolist()}
            if self.balance == "rwy":  # the stored split is unchanged; each epoch's draws are balanced
                balance["sampling"] = "each epoch: n draws with replacement, probability 1 / class count in the prefix"
            log.info("data.balance=%s: training class counts %s -> %s", self.balance, before.tolist(), after.tolist())
        splits = Splits(
            ImageSet(x[train_idx], y[train_idx]), ImageSet(x[val_idx], y[val_idx]), test, src.classes, balance
        )
        return standardised(splits) if self.zscore else splits

    def _fit_transform(self, x: Tensor) -> CovariancePower:
        cfg = self.transform_cfg
        assert cfg is not None
        log.info("fitting the %s transform (p=%g, eps=%g, %s) on %d training examples",
                 cfg["name"], cfg["p"], cfg["eps"], cfg["order"], x.shape[0])
        try:
            self._transform = fit_covariance_power(x.to(self.device), p=cfg["p"], eps=cfg["eps"])
        except ValueError as err:  # name the setting: the math layer knows only p and eps
            raise ValueError(f"data.transform: {err}") from err
        return self._transform

    def _transform_before(self, splits: Splits) -> Splits:
        """The splits the eraser sees: transformed when data.transform.order=before_eraser."""
        if self.transform_cfg is None or self.transform_cfg["order"] != "before_eraser":
            return splits
        t = self._fit_transform(splits.train.x)
        on = self.device

        def mapped(images: ImageSet) -> ImageSet:
            return ImageSet(apply_transform(t, images.x.to(on)), images.y)

        return dataclasses.replace(splits, train=mapped(splits.train), val=mapped(splits.val), test=mapped(splits.test))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        name = self.eraser_cfg["name"]
        if self.augment_order == "augment_then_erase" and not eraser_class(name).can_transform_new_data:
            raise ValueError(
                f"the {name!r} eraser edits only the data it was fitted on, so it cannot erase augmented "
                f"batches; use data.augment_order=erase_then_augment"
            )
        raw_splits = _Memo(self._load_splits)
        splits = _Memo(lambda: self._transform_before(raw_splits()))

        def fit() -> Eraser:
            train = splits().train
            options = self._fit_options(splits())
            x, y = train.x, train.y
            if self._fits_pool():  # one edit of training + validation, as the original's erased copy of its pool
                x, y = torch.cat([train.x, splits().val.x]), torch.cat([train.y, splits().val.y])
            log.info("fitting eraser %s on %d examples (%s)", self.eraser_cfg["name"], len(y),
                     "training and validation splits" if self._fits_pool() else "training split")
            return fit_eraser(
                self.eraser_cfg["name"], x.to(self.device), y.to(self.device), num_classes=len(splits().classes), **options,
            )

        # a cached eraser loads onto the CPU: put it where the data is erased, like a fresh fit
        eraser = _Memo(lambda: eraser_on(self.cache.eraser(self.eraser_key(), fit, describe=self._describe()), self.device))
        tensors, info = self.cache.tensors(self.data_key(), lambda: self._build(splits(), eraser()), describe=self._describe())
        self.eraser = eraser()
        self.classes = list(info["classes"])
        self.num_classes = len(self.classes)
        self.diagnostics = {k: v for k, v in info.items() if k != "classes"}
        report = self.diagnostics.get("erasure", {})
        record, missed_criterion = criterion_check(eraser(), report, self.eraser_checks)
        if record is not None:
            self.diagnostics["erasure_criterion"] = record
        leftover = quadratic_leftover(eraser(), report, self.eraser_checks.get("qda_warning_points"))
        for message in [*info.get("not_erased", []), *missed_criterion, *leftover]:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        on = self.device
        self.train_set = ImageSet(tensors["train_x"].to(on), tensors["train_y"].to(on))
        self.val_set = ImageSet(tensors["val_x"].to(on), tensors["val_y"].to(on))
        self.test_set = ImageSet(tensors["test_x"].to(on), tensors["test_y"].to(on))
        self.input_shape = tuple(self.train_set.x.shape[1:])
        if self.augment_order == "augment_then_erase":
            self._batch_eraser = self._make_batch_eraser(self.eraser)
        log.info(
            "data %s: train %d, val %d, test %d, input %s, eraser %s (%s), on %s; cache hits %d, builds %d",
            self.source_name, len(self.train_set), len(self.val_set), len(self.test_set), self.input_shape,
            self.eraser_cfg["name"], self.augment_order, on, self.cache.stats.hits, self.cache.stats.builds,
        )

    def _fit_options(self, splits: Splits) -> dict[str, Any]:
        """The eraser's options; for ``random``, ``rank_from: <eraser>`` becomes ``rank``: the edit
        rank of that eraser (with ``rank_from_options``) fitted on the same training split, through
        the eraser cache (a sweep fits it once; a run of that eraser with the same options shares it)."""
        options = dict(self.eraser_cfg.get("options") or {})
        if self.eraser_cfg["name"] != "random":
            return options
        source, source_options = options.pop("rank_from", None), dict(options.pop("rank_from_options", None) or {})
        if source is None:
            return options
        if options.get("rank") is not None:
            raise ValueError(
                f"eraser.options.rank={options['rank']} and eraser.options.rank_from={source} both set the random "
                f"control's rank; set one of them (the other to null)"
            )
        if source == "random":
            raise ValueError("eraser.options.rank_from=random: the random control cannot take its rank from itself")
        source_options = {**default_options(source), **source_options}
        cfg = {"name": source, "options": source_options}  # the key a run of that eraser with these options uses
        train = splits.train

        def fit_source() -> Eraser:
            log.info("fitting eraser %s on %d training examples for the random control's rank", source, len(train))
            return fit_eraser(source, train.x.to(self.device), train.y.to(self.device),
                              num_classes=len(splits.classes), **source_options)

        describe = {**self._describe(), "eraser": cfg}
        options["rank"] = edit_rank(self.cache.eraser(self.eraser_key(cfg), fit_source, describe=describe))
        log.info("eraser random: rank %d, the edit rank of %s %s on this training split", options["rank"], source, source_options)
        return options

    def _describe(self) -> dict[str, Any]:
        return {"source": self.source_identity(), "split": self.split_identity(), "eraser": self.eraser_cfg,
                "eval_labels": self.eval_labels, "augment_order": self.augment_order, "transform": self.transform_cfg}

    def _build(self, splits: Splits, eraser: Eraser) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Erase the splits once: train with its labels, val/test as eval_labels says."""
        info: dict[str, Any] = {"classes": splits.classes}
        on = self.device
        qda = self._label_predictor(eraser, splits)
        erased = {}
        pooled = self._fits_pool()
        n_train = len(splits.train)
        if pooled:  # the eraser holds the edited training + validation rows, in that order
            erased["val"] = eraser.edited[n_train:].to(on).view_as(splits.val.x)
        for name, images in (("val", splits.val), ("test", splits.test)):
            if name in erased:
                continue
            x, y = images.x.to(on), images.y.to(on)
            labels = None
            if needs_eval_labels(eraser):
                labels = y if qda is None else qda.predict(x)
                if qda is not None:
                    info[f"qda_{name}_accuracy"] = float((labels == y).double().mean())
            if getattr(eraser, "can_transform_new_data", True):
                erased[name] = erase(eraser, x, labels if eraser.requires_labels else None)
            else:  # an eraser that edits its own fitting data (gradient): one edit per split
                log.info("%s cannot transform new data: fitting it on the %s split too", eraser.name, name)
                split_eraser = fit_eraser(
                    self.eraser_cfg["name"], x, labels, num_classes=len(splits.classes),
                    **dict(self.eraser_cfg.get("options") or {}),
                )
                erased[name] = erase(split_eraser, x, labels if split_eraser.requires_labels else None)
                info.setdefault("not_erased", []).extend(not_erased(split_eraser, name, split_eraser.fit_gaps()))
        train_x, train_y = splits.train.x.to(on), splits.train.y.to(on)
        if pooled:
            train_x = eraser.edited[:n_train].to(on).view_as(splits.train.x)
        elif self.augment_order == "erase_then_augment":
            train_x = erase(eraser, train_x, train_y if eraser.requires_labels else None)
        # augment_then_erase keeps the training images raw; the loaders erase each batch
        tensors = {"train_x": train_x, "train_y": train_y, "val_x": erased["val"], "val_y": splits.val.y,
                   "test_x": erased["test"], "test_y": splits.test.y}
        if self.run_diagnostics:
            skipped: dict[str, str] = {}
            info["erasure"] = self._diagnose(eraser, splits, train_x, erased["val"], skipped)
            if skipped:
                info["erasure_skipped"] = skipped
            log.info(diagnostics_summary(info["erasure"]))
        gaps = eraser.fit_gaps() or _report_gaps(info.get("erasure", {}))
        info["not_erased"] = not_erased(eraser, "training", gaps) + info.get("not_erased", [])
        if splits.balance is not None:
            info["balance"] = splits.balance
        if splits.zscore is not None:
            info["zscore"] = splits.zscore
        if self.transform_cfg is not None:
            if self.transform_cfg["order"] == "after_eraser":  # fitted on the erased training split
                t = self._fit_transform(tensors["train_x"])
                for key in ("train_x", "val_x", "test_x"):
                    tensors[key] = apply_transform(t, tensors[key].to(on))
            assert self._transform is not None
            info["transform"] = {**self.transform_cfg, **self._transform.summary()}
            log.info("transform %s: condition number %.4g -> %.4g, effective rank %.4g -> %.4g (of %d)",
                     self.transform_cfg["name"], self._transform.condition_before, self._transform.condition_after,
                     self._transform.effective_rank_before, self._transform.effective_rank_after, self._transform.dim)
        return tensors, info

    def _diagnose(
        self, eraser: Eraser, splits: Splits, train_after: Tensor, val_after: Tensor, skipped: dict[str, str]
    ) -> dict[str, float]:
        """Moment gaps and linear/QDA probe accuracies on held-out data, before and after erasure.
        Optional numbers: what cannot be computed is recorded in ``skipped`` and warned, never fatal."""
        on = self.device
        train_before, y = splits.train.x.to(on), splits.train.y.to(on)
        if self.augment_order == "augment_then_erase":  # the stored training images are raw
            train_after = erase(eraser, train_before, y if eraser.requires_labels else None)
        log.info("erasure diagnostics: moment gaps, linear probe and QDA before/after")
        # Probes are scored on held-out rows of data edited by the same fit. An eraser that edits only its own
        # fitting data and was fitted per split edited validation separately, so its probes hold out training rows.
        own_edit_per_split = not getattr(eraser, "can_transform_new_data", True) and not self._fits_pool()
        held_out = {} if own_edit_per_split else {
            "x_test_before": splits.val.x.to(on), "x_test_after": val_after, "y_test": splits.val.y.to(on)}
        try:
            return erasure_report(train_before, train_after, y, seed=self.data_seed, skipped=skipped, **held_out)
        except (ValueError, RuntimeError, ArithmeticError) as err:
            skipped["all"] = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"erasure diagnostics failed ({skipped['all']}); the run goes on without them "
                f"(data.diagnostics=false skips them)", RuntimeWarning, stacklevel=2,
            )
            return {}

    def _label_predictor(self, eraser: Eraser, splits: Splits) -> QuadraticDiscriminant | None:
        """The QDA whose predictions map val/test under eval_labels=predicted (None otherwise)."""
        if not needs_eval_labels(eraser) or self.eval_labels is True:
            return None
        train = splits.train
        moments = class_moments(train.x.to(self.device), train.y.to(self.device), len(splits.classes))
        log.info("eval_labels=predicted: val/test mapped with QDA labels (regularization %g)", self.qda_regularization)
        return QuadraticDiscriminant.from_moments(moments, self.qda_regularization)

    def _make_batch_eraser(self, eraser: Eraser) -> BatchTransform:
        """Erasure of each (augmented) training batch, on the device. The raw training split passed
        the eraser's value checks when it was fitted, so batches skip them (a host read each)."""
        device_eraser = eraser_on(eraser, self.device)
        return device_eraser.erase_checked  # uses the labels only if the eraser maps each class differently

    # --- loaders -----------------------------------------------------------------------------

    @property
    def num_train(self) -> int:
        assert self.train_set is not None, "call setup() first"
        return len(self.train_set)

    def use_prefix(self, n: int | None, steps_per_group: int = 1) -> None:
        """Serve only the first n training examples (the prequential prefix; None = all), in groups
        of ``steps_per_group`` batches per Lightning step when that is more than 1."""
        if n is not None and not 0 < n <= self.num_train:
            raise ValueError(f"prefix {n} outside 1..{self.num_train}")
        if steps_per_group < 1:
            raise ValueError(f"mdl.steps_per_group must be >= 1, got {steps_per_group}")
        self.prefix, self.steps_per_group = n, steps_per_group

    def train_dataloader(self) -> DeviceBatches | GroupedBatches:
        assert self.train_set is not None, "call setup() first"
        n = self.prefix or self.num_train
        batches = DeviceBatches(
            self.train_set.x[:n], self.train_set.y[:n], self.batch_size, shuffle=True,
            augment=self.augment, flip=self.flip, seed=self.seed,
            padding_fraction=self.padding_fraction, pad_mode=self.pad_mode, transform=self._batch_eraser,
            class_balance=self._class_balance(),
        )
        return GroupedBatches(batches, self.steps_per_group) if self.steps_per_group > 1 else batches

    def _class_balance(self) -> int | None:
        """The class count the training batches are balanced over (data.balance=rwy), else None."""
        return self.num_classes if self.balance == "rwy" else None

    def stacked_train_loader(self, prefixes: list[int], steps_per_group: int = 1,
                             member_ids: list[int] | None = None) -> StackedBatches:
        """Batches for a stack of models, member m training on the first prefixes[m] examples, in
        groups of up to ``steps_per_group`` steps (``member_ids``: each prefix's member id, default 0, 1, ...)."""
        assert self.train_set is not None, "call setup() first"
        return StackedBatches(
            self.train_set.x, self.train_set.y, prefixes, self.batch_size, seed=self.seed, augment=self.augment,
            flip=self.flip, padding_fraction=self.padding_fraction, pad_mode=self.pad_mode, transform=self._batch_eraser,
            steps_per_group=steps_per_group, class_balance=self._class_balance(), member_ids=member_ids,
        )

    def val_dataloader(self) -> DeviceBatches:
        return DeviceBatches(self.val_set.x, self.val_set.y, self.eval_batch_size)

    def test_dataloader(self) -> DeviceBatches:
        return DeviceBatches(self.test_set.x, self.test_set.y, self.eval_batch_size)

    def eval_loader(self, start: int, stop: int) -> DeviceBatches:
        """Unaugmented batches of training examples [start, stop): the next prequential block."""
        assert self.train_set is not None, "call setup() first"
        return DeviceBatches(
            self.train_set.x[start:stop], self.train_set.y[start:stop], self.eval_batch_size,
            transform=self._batch_eraser,
        )


class _Memo:
    """Call a zero-argument function at most once (the source and the eraser are built lazily)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done, self.value = fn, False, None

    def __call__(self) -> Any:
        if not self.done:
            self.value, self.done = self.fn(), True
        return self.value
