"""The LightningDataModule: load a source, split it by data_seed, fit the eraser, erase, serve batches.

``setup`` composes the steps: load and split (datamodules.splits) -> fit the eraser on the rows its fit_scope
names -> erase and diagnose (datamodules.erasing), the fitted eraser and the erased splits each cached on disk
(datamodules.cache) under the keys of ``DataOptions`` (datamodules.options). Every job of a sweep that shares
those reuses them; a cache hit does not even load the source. Afterwards every split is one tensor on the training
device: training batches come from ``stacked_train_loader`` (each member its prefix), evaluation batches from
``EvalBatches``. The training split is stored in its (seeded) shuffled order, which is also the prequential order.

Two optional steps around the eraser (both off by default, both part of the cache keys):
``balance`` (the gradient-starvation thesis, ch. 8): suby subsamples the training split by class before
it is stored, so before the prequential order; rwy keeps it and draws every epoch's training batches
class-balanced (datamodules.loader); validation and test are untouched.
``transform`` (covariance_power, the preconditioning abstract) maps every split with
x -> mu + c Sigma^{p/2} (x - mu), Sigma the training covariance, either before the eraser (the
eraser is then fitted on transformed data) or after it (fitted on the erased training split).
"""

from __future__ import annotations

from dataclasses import replace

import functools
import logging
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import lightning as L
import torch
from torch import Tensor

from datamodules.cache import ErasureCache
from datamodules.erasing import erase_splits, fit_on_scope, fit_options
from datamodules.erasure_checks import erasure_warnings
from datamodules.fit_progress import PartialFit
from datamodules.interrupts import interruptible, saved_if_abandoned
from datamodules.loader import BatchTransform, EvalBatches
from datamodules.options import DataOptions, EraserOptions
from datamodules.redraw import pool_rows, redrawn_orders
from datamodules.sources import ImageSet
from datamodules.splits import Splits, load_splits, transformed_before
from datamodules.stacked_batches import Pacing, StackedBatches, TrainSource
from datamodules.timing import timed
from erasure import Eraser

log = logging.getLogger(__name__)


class ErasedDataModule(L.LightningDataModule):
    """The erased splits of ``options`` on its device, and their batches; ``seed`` orders and augments the training
    batches (a pack of runs sets it per run)."""

    def __init__(self, options: DataOptions, seed: int = 0) -> None:
        """Only the state the module carries: the work (load, split, fit, erase, each from the cache when it
        holds it) is ``setup``'s, where Lightning expects it, and a second ``setup`` finds it done."""
        super().__init__()
        self.options = options
        self.seed = seed
        self.cache = ErasureCache(options.cache_dir)
        self.eraser: Eraser | None = None
        self.train_set: ImageSet | None = None
        self.diagnostics: dict[str, Any] = {}
        self._batch_eraser: BatchTransform | None = None

    # --- the erased splits ----------------------------------------------------------------------

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

        def load() -> Splits:
            with timed("data: loading and splitting the source"):
                return transformed_before(load_splits(o), o.transform, on)

        splits = functools.cache(load)

        def cached_fit(spec: EraserOptions) -> Eraser:
            key = o.eraser_key(spec)

            def fit() -> Eraser:  # the run's eraser with its options resolved (random's rank_from: another cached fit)
                options = fit_options(spec, cached_fit) if spec is o.eraser else None
                partial = self.cache.partial_path(key)
                with timed("eraser: fit"):  # less the source's load, if it comes first here (timed on its own)
                    if partial is None or spec.checkpoint_every_s is None:
                        return fit_on_scope(splits(), spec, on, options)
                    progress = PartialFit(partial, spec.checkpoint_every_s)
                    with saved_if_abandoned(progress.save_latest):  # a SIGTERM keeps the last finished step
                        return fit_on_scope(splits(), spec, on, options, progress)

            return self.cache.eraser(key, fit, describe=o.describe(spec))

        # a cached eraser loads onto the CPU: put it where the data is erased, like a fresh fit
        eraser = functools.cache(lambda: cached_fit(o.eraser).to(on))

        def prepared() -> tuple[Eraser, dict[str, Tensor], dict[str, Any]]:
            tensors, info = self.cache.tensors(
                o.data_key(), lambda: erase_splits(splits(), eraser(), o), describe=o.describe()
            )
            return eraser(), tensors, info

        # minutes of single LAPACK calls at CIFAR-10's size: a SIGTERM stops them at once (datamodules.interrupts)
        self.eraser, tensors, info = interruptible(prepared)
        self._hold(tensors, info)

    def _hold(self, tensors: dict[str, Tensor], info: dict[str, Any]) -> None:
        """Keep the erased splits on the device and what was measured on them; warn of what the erasure missed."""
        o, on = self.options, self.options.device
        assert self.eraser is not None
        self.classes = list(info["classes"])
        self.num_classes = len(self.classes)
        self.diagnostics = {k: v for k, v in info.items() if k != "classes"}
        record, messages = erasure_warnings(self.eraser, info, o.eraser.checks, o.eraser.fit_scope)
        if record is not None:
            self.diagnostics["erasure_criterion"] = record
        for message in messages:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.train_set = ImageSet(tensors["train_x"].to(on), tensors["train_y"].to(on))
        self.val_set = ImageSet(tensors["val_x"].to(on), tensors["val_y"].to(on))
        self.test_set = ImageSet(tensors["test_x"].to(on), tensors["test_y"].to(on))
        self.input_shape = tuple(self.train_set.x.shape[1:])
        if o.augment_order == "augment_then_erase":
            # each (augmented) training batch erased on the device; the raw training split passed the eraser's value
            # checks when it was fitted, so batches skip them (a host read each)
            self._batch_eraser = self.eraser.to(on).erase_checked
        log.info(
            "data %s: train %d, val %d, test %d, input %s, eraser %s (%s), on %s; cache hits %d, builds %d",
            o.source,
            len(self.train_set),
            len(self.val_set),
            len(self.test_set),
            self.input_shape,
            o.eraser.name,
            o.augment_order,
            on,
            self.cache.stats.hits,
            self.cache.stats.builds,
        )

    @contextmanager
    def redrawn(self, block: int) -> Iterator[None]:
        """Inside it, the training and validation splits are block ``block``'s (0-based) fresh draw of the pool
        (the training split, then the validation split) as the original drew them (``protocol.redraw_per_block``;
        datamodules.redraw): the training split is that draw's first N rows, its prefix, next block and last (scored)
        block, the validation split the rest. Both splits must hold the rows erased alike, with true labels."""
        assert self.train_set is not None, "call setup() first"
        o = self.options
        if o.augment_order != "erase_then_augment" or o.eval_labels is not True:
            raise ValueError(
                f"protocol.redraw_per_block=true moves rows between the training and validation splits, so both must "
                f"be erased alike with their true labels (data.augment_order={o.augment_order}, data.eval_labels="
                f"{o.eval_labels}); use data.augment_order=erase_then_augment data.eval_labels=true, or "
                f"protocol.redraw_per_block=false"
            )
        train, val = self.train_set, self.val_set
        order = redrawn_orders(len(train) + len(val), block + 1, o.data_seed)[block]
        n = len(train)
        self.train_set = ImageSet(pool_rows(train.x, val.x, order[:n]), pool_rows(train.y, val.y, order[:n]))
        self.val_set = ImageSet(pool_rows(train.x, val.x, order[n:]), pool_rows(train.y, val.y, order[n:]))
        try:
            yield
        finally:
            self.train_set, self.val_set = train, val

    # --- batches ----------------------------------------------------------------------------

    @property
    def num_train(self) -> int:
        assert self.train_set is not None, "call setup() first"
        return len(self.train_set)

    def stacked_train_loader(
        self,
        prefixes: list[int],
        pacing: Pacing = Pacing(),
        member_ids: list[int] | None = None,
        seeds: list[int] | None = None,
        others: Sequence[ErasedDataModule] = (),
        source_of: list[int] | None = None,
        reshuffle: bool = True,
        augment_per_batch: bool = False,
    ) -> StackedBatches:
        """Batches for a stack of models, member m training on the first prefixes[m] examples, in
        groups and passes cut by ``pacing`` (``member_ids``: each prefix's member id, default 0, 1, ...;
        ``seeds``: each prefix's batch-order seed, default this module's ``seed``; ``others``, ``source_of``:
        packed runs' own data modules and each prefix's, 0 = this one, i = others[i - 1]; ``reshuffle``,
        ``augment_per_batch``: protocol=original's, ``mdl.engine.protocol.LoopRules``)."""
        assert self.train_set is not None, "call setup() first"
        sources = [TrainSource(d.train_set.x, d.train_set.y, d._batch_eraser) for d in (self, *others)]
        augment = self.options.augmentation()
        return StackedBatches(
            sources,
            prefixes,
            self.options.batch_size,
            seeds=self.seed if seeds is None else seeds,
            augment=None if augment is None else replace(augment, per_batch=augment_per_batch),
            pacing=pacing,
            class_balance=self.num_classes if self.options.balance == "rwy" else None,  # data.balance=rwy
            member_ids=member_ids,
            source_of=source_of,
            reshuffle=reshuffle,
        )

    def val_dataloader(self, batch_size: int | None = None) -> EvalBatches:
        """Validation batches of ``batch_size`` (None: data.eval_batch_size; protocol.batch_mean_validation: the
        training batch size, as the original validated)."""
        return EvalBatches(self.val_set.x, self.val_set.y, batch_size or self.options.eval_batch_size)

    def test_dataloader(self) -> EvalBatches:
        return EvalBatches(self.test_set.x, self.test_set.y, self.options.eval_batch_size)

    def eval_loader(self, start: int, stop: int) -> EvalBatches:
        """Unaugmented batches of training examples [start, stop): the next prequential block."""
        assert self.train_set is not None, "call setup() first"
        return EvalBatches(
            self.train_set.x[start:stop],
            self.train_set.y[start:stop],
            self.options.eval_batch_size,
            transform=self._batch_eraser,
        )
