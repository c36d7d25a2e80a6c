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
import logging
import warnings
from typing import Any, Callable

import lightning as L
import torch
from torch import Tensor

from datamodules.cache import ErasureCache, cache_key
from datamodules.erasure_checks import (
    _report_gaps, criterion_check, diagnose, diagnostics_summary, edit_rank, erase, eraser_on, label_predictor,
    needs_eval_labels, not_erased, quadratic_leftover,
)
from datamodules.interrupts import interruptible
from datamodules.loader import BatchTransform
from datamodules.serving import BatchServing
from datamodules.settings import (
    FIT_SCOPES, check_balance, check_data_settings, check_erasure_settings, check_transform,
    POOLED_ERASERS, ZSCORE_AFTER, default_options, resolve_device,
)
from datamodules.sources import ImageSet, ImageSource, load_source
from datamodules.splits import Splits, apply_transform, balance_indices, seeded_split, standardised, zscore_map
from erasure import CovariancePower, Eraser, fit_covariance_power, fit_eraser
from erasure.base import FORMAT_VERSION as ERASER_FORMAT_VERSION
from erasure.base import eraser_class

log = logging.getLogger(__name__)


class ErasedDataModule(BatchServing, L.LightningDataModule):
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
        zscore: bool | str = False,
        options_not_data: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        check_data_settings(val_size, test_size, batch_size, eval_batch_size, qda_regularization, padding_fraction)
        self.balance = check_balance(balance)
        self.transform_cfg = check_transform(transform)
        self.eraser_cfg = dict(eraser)
        self.fit_scope = self.eraser_cfg.get("fit_scope", "split")
        check_erasure_settings(augment_order, eval_labels, zscore, self.transform_cfg, self.fit_scope,
                               pooled=self.fit_scope in FIT_SCOPES and self._fits_pool())
        self.zscore = zscore
        self._transform: CovariancePower | None = None
        self.source_name = source
        self.source_options = dict(options or {})
        # source options that say where or how the data is fetched, not what it is: left out of the cache keys.
        # A run passes the ones its identity leaves out (mdl/run/identity.py BOOKKEEPING_KEYS): one definition.
        self.options_not_data = tuple(options_not_data)
        # how the run judges the erasure (warning thresholds): not part of what is computed, so not of cache keys
        self.eraser_checks = dict(self.eraser_cfg.get("checks") or {})
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
        self.reshuffle, self.augment_per_batch = True, False  # the training loop's (BatchServing.use_prefix)
        self.steps_per_group = 1  # training batches per Lightning step (use_prefix)
        self.eraser: Eraser | None = None
        self.train_set: ImageSet | None = None
        self.diagnostics: dict[str, Any] = {}
        self._batch_eraser: BatchTransform | None = None

    # --- cache keys --------------------------------------------------------------------------

    def source_identity(self) -> dict[str, Any]:
        options = {k: v for k, v in self.source_options.items() if k not in self.options_not_data}
        return {"name": self.source_name, "options": options}

    def split_identity(self) -> dict[str, Any]:
        split = {"data_seed": self.data_seed, "val_size": self.val_size, "test_size": self.test_size}
        if self.balance is not None:  # keys of runs without balancing stay as they were
            split["balance"] = self.balance
        if self.zscore is True:  # z-scored before the eraser: part of what it is fitted on
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
        """Whether the eraser's own edit of training + validation is the data (eraser.fit_scope=pool, an eraser
        that edits its own fitting data). A map fitted with fit_scope=pool (LEACE, QLEACE, ALF-QLEACE) sees the
        validation rows too and then erases every split as a map."""
        return self.fit_scope == "pool" and not eraser_class(self.eraser_cfg["name"]).can_transform_new_data

    def data_key(self) -> str:
        evaluation = {"eval_labels": self.eval_labels}
        if self.eval_labels == "predicted":
            evaluation["qda_regularization"] = self.qda_regularization
        parts: dict[str, Any] = {"transform": self.transform_cfg} if self.transform_cfg is not None else {}
        if self.zscore == ZSCORE_AFTER:  # the erased splits standardised (keys of other runs stay as they were)
            parts["zscore"] = ZSCORE_AFTER
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
        return standardised(splits) if self.zscore is True else splits

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
            if self.fit_scope == "pool":  # validation rows in the fit, as every scored block is (a gradient eraser:
                # one edit of both, as the original's erased copy of its pool)
                x, y = torch.cat([train.x, splits().val.x]), torch.cat([train.y, splits().val.y])
            log.info("fitting eraser %s on %d examples (%s)", self.eraser_cfg["name"], len(y),
                     "training and validation splits" if self.fit_scope == "pool" else "training split")
            return fit_eraser(self.eraser_cfg["name"], x.to(self.device), y.to(self.device),
                              num_classes=len(splits().classes), **options)

        # a cached eraser loads onto the CPU: put it where the data is erased, like a fresh fit
        eraser = _Memo(lambda: eraser_on(self.cache.eraser(self.eraser_key(), fit, describe=self._describe()), self.device))

        def prepared() -> tuple[Eraser, dict[str, Tensor], dict[str, Any]]:
            tensors, info = self.cache.tensors(self.data_key(), lambda: self._build(splits(), eraser()), describe=self._describe())
            return eraser(), tensors, info

        # minutes of single LAPACK calls at CIFAR-10's size: a SIGTERM stops them at once (datamodules/interrupts.py)
        self.eraser, tensors, info = interruptible(prepared)
        self.classes = list(info["classes"])
        self.num_classes = len(self.classes)
        self.diagnostics = {k: v for k, v in info.items() if k != "classes"}
        report = self.diagnostics.get("erasure", {})
        record, missed_criterion = criterion_check(eraser(), report, self.eraser_checks)
        if record is not None:
            self.diagnostics["erasure_criterion"] = record
        leftover = quadratic_leftover(eraser(), report, self.eraser_checks.get("qda_warning_points"), self.fit_scope)
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

    def resident_bytes(self) -> int:
        """Bytes its splits hold on its device (a pack holds several data modules at once: mdl/run/pack.py); the
        eraser and batch buffers, small beside them, are not counted."""
        return sum(t.nbytes for s in (self.train_set, self.val_set, self.test_set) for t in (s.x, s.y))

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
        # the key and fitting rows a run of that eraser with these options uses (conf/eraser/<source>.yaml fit_scope)
        cfg = {"name": source, "options": source_options, **({"fit_scope": "pool"} if source in POOLED_ERASERS else {})}
        x, y = splits.train.x, splits.train.y
        if source in POOLED_ERASERS:
            x, y = torch.cat([x, splits.val.x]), torch.cat([y, splits.val.y])

        def fit_source() -> Eraser:
            log.info("fitting eraser %s on %d examples for the random control's rank", source, len(y))
            return fit_eraser(source, x.to(self.device), y.to(self.device), num_classes=len(splits.classes), **source_options)

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
        qda = label_predictor(eraser, splits, self.eval_labels, self.device, self.qda_regularization)
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
            info["erasure"] = diagnose(eraser, splits, train_x, erased["val"], skipped, self.device,
                                       raw_train=self.augment_order == "augment_then_erase",
                                       own_edit_per_split=not getattr(eraser, "can_transform_new_data", True)
                                       and not self._fits_pool(), data_seed=self.data_seed)
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
        if self.zscore == ZSCORE_AFTER:  # last: the erased (and transformed) splits, the erased training split's statistics
            z, info["zscore"] = zscore_map(tensors["train_x"], ZSCORE_AFTER)
            for key in ("train_x", "val_x", "test_x"):
                tensors[key] = z(tensors[key].to(on))
        return tensors, info

    def _make_batch_eraser(self, eraser: Eraser) -> BatchTransform:
        """Erasure of each (augmented) training batch, on the device. The raw training split passed
        the eraser's value checks when it was fitted, so batches skip them (a host read each)."""
        device_eraser = eraser_on(eraser, self.device)
        return device_eraser.erase_checked  # uses the labels only if the eraser maps each class differently


class _Memo:
    """Call a zero-argument function at most once (the source and the eraser are built lazily)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done, self.value = fn, False, None

    def __call__(self) -> Any:
        if not self.done:
            self.value, self.done = self.fn(), True
        return self.value
