"""The LightningDataModule: load a source, split it by data_seed, fit the eraser, erase, serve batches.

``setup`` composes the steps: load and split (datamodules/splits.py) -> fit the eraser on the rows its fit_scope
names -> erase and diagnose (datamodules/erasing.py), the fitted eraser and the erased splits each cached on disk
(datamodules/cache.py) under the keys of ``DataOptions`` (datamodules/options.py). Every job of a sweep that shares
those reuses them; a cache hit does not even load the source. Afterwards every split is one tensor on the training
device and batches come from ``DeviceBatches``. The training split is stored in its (seeded) shuffled order, which is
also the prequential order: ``use_prefix(n)`` makes the loaders serve its first n examples.

Two optional steps around the eraser (both off by default, both part of the cache keys):
``balance`` (the gradient-starvation thesis, ch. 8): suby subsamples the training split by class before
it is stored, so before the prequential order; rwy keeps it and draws every epoch's training batches
class-balanced (datamodules/loader.py); validation and test are untouched.
``transform`` (covariance_power, the preconditioning abstract) maps every split with
x -> mu + c Sigma^{p/2} (x - mu), Sigma the training covariance, either before the eraser (the
eraser is then fitted on transformed data) or after it (fitted on the erased training split).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import lightning as L
import torch
from torch import Tensor

from datamodules.cache import ErasureCache
from datamodules.erasing import erase_splits, fit_on_scope, fit_options
from datamodules.erasure_checks import criterion_check, eraser_on, quadratic_leftover
from datamodules.interrupts import interruptible
from datamodules.loader import BatchTransform
from datamodules.options import DataOptions, EraserOptions
from datamodules.serving import BatchServing
from datamodules.sources import ImageSet
from datamodules.splits import load_splits, transformed_before
from erasure import Eraser

log = logging.getLogger(__name__)


class ErasedDataModule(BatchServing, L.LightningDataModule):
    """The erased splits of ``options`` on its device, and their batches; ``seed`` orders and augments the training
    batches (a pack of runs sets it per run)."""

    def __init__(self, options: DataOptions, seed: int = 0) -> None:
        super().__init__()
        self.options = options
        self.seed = seed
        self.cache = ErasureCache(options.cache_dir)
        self.prefix: int | None = None
        self.reshuffle, self.augment_per_batch = True, False  # the training loop's (BatchServing.use_prefix)
        self.steps_per_group = 1  # training batches per Lightning step (use_prefix)
        self.eraser: Eraser | None = None
        self.train_set: ImageSet | None = None
        self.diagnostics: dict[str, Any] = {}
        self._batch_eraser: BatchTransform | None = None

    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def eval_batch_size(self) -> int:
        return self.options.eval_batch_size

    def setup(self, stage: str | None = None) -> None:
        """Load, split, fit and erase (each read from the cache when it holds it), then put the splits on the device.
        Steps run only when a result they feed is missing from the cache."""
        if self.train_set is not None:
            return
        o, on = self.options, self.options.device
        splits = functools.cache(lambda: transformed_before(load_splits(o), o.transform, on))

        def cached_fit(spec: EraserOptions) -> Eraser:
            def fit() -> Eraser:  # the run's eraser with its options resolved (random's rank_from: another cached fit)
                options = fit_options(spec, cached_fit) if spec is o.eraser else None
                return fit_on_scope(splits(), spec, on, options)

            return self.cache.eraser(o.eraser_key(spec), fit, describe=o.describe(spec))

        # a cached eraser loads onto the CPU: put it where the data is erased, like a fresh fit
        eraser = functools.cache(lambda: eraser_on(cached_fit(o.eraser), on))

        def prepared() -> tuple[Eraser, dict[str, Tensor], dict[str, Any]]:
            tensors, info = self.cache.tensors(o.data_key(), lambda: erase_splits(splits(), eraser(), o),
                                               describe=o.describe())
            return eraser(), tensors, info

        # minutes of single LAPACK calls at CIFAR-10's size: a SIGTERM stops them at once (datamodules/interrupts.py)
        self.eraser, tensors, info = interruptible(prepared)
        self._hold(tensors, info)

    def _hold(self, tensors: dict[str, Tensor], info: dict[str, Any]) -> None:
        """Keep the erased splits on the device and what was measured on them; warn of what the erasure missed."""
        o, on = self.options, self.options.device
        assert self.eraser is not None
        self.classes = list(info["classes"])
        self.num_classes = len(self.classes)
        self.diagnostics = {k: v for k, v in info.items() if k != "classes"}
        report = self.diagnostics.get("erasure", {})
        record, missed_criterion = criterion_check(self.eraser, report, o.eraser.checks)
        if record is not None:
            self.diagnostics["erasure_criterion"] = record
        leftover = quadratic_leftover(self.eraser, report, o.eraser.checks.get("qda_warning_points"),
                                      o.eraser.fit_scope)
        for message in [*info.get("not_erased", []), *missed_criterion, *leftover]:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.train_set = ImageSet(tensors["train_x"].to(on), tensors["train_y"].to(on))
        self.val_set = ImageSet(tensors["val_x"].to(on), tensors["val_y"].to(on))
        self.test_set = ImageSet(tensors["test_x"].to(on), tensors["test_y"].to(on))
        self.input_shape = tuple(self.train_set.x.shape[1:])
        if o.augment_order == "augment_then_erase":
            # each (augmented) training batch erased on the device; the raw training split passed the eraser's value
            # checks when it was fitted, so batches skip them (a host read each)
            self._batch_eraser = eraser_on(self.eraser, on).erase_checked
        log.info(
            "data %s: train %d, val %d, test %d, input %s, eraser %s (%s), on %s; cache hits %d, builds %d",
            o.source, len(self.train_set), len(self.val_set), len(self.test_set), self.input_shape,
            o.eraser.name, o.augment_order, on, self.cache.stats.hits, self.cache.stats.builds,
        )

    def resident_bytes(self) -> int:
        """Bytes its splits hold on its device (a pack holds several data modules at once: mdl/run/pack.py); the
        eraser and batch buffers, small beside them, are not counted."""
        return sum(t.nbytes for s in (self.train_set, self.val_set, self.test_set) for t in (s.x, s.y))
