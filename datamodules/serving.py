"""The batches a data module serves once its splits are on the device: the prequential prefix, grouped
steps, the stacked members' batches, validation, test and the blocks to score. A mixin of
``ErasedDataModule`` (datamodules/datamodule.py), which sets the attributes these read in ``setup``."""

from __future__ import annotations

from typing import Any, Sequence

from datamodules.options import DataOptions
from datamodules.loader import BatchTransform, DeviceBatches, GroupedBatches
from datamodules.sources import ImageSet
from datamodules.stacked_batches import StackedBatches, TrainSource


class BatchServing:
    """Loaders over ``train_set`` / ``val_set`` / ``test_set`` (tensors on the training device)."""

    options: DataOptions
    train_set: ImageSet | None
    val_set: Any
    test_set: Any
    prefix: int | None
    steps_per_group: int
    seed: int
    reshuffle: bool
    augment_per_batch: bool
    num_classes: int
    _batch_eraser: BatchTransform | None

    @property
    def num_train(self) -> int:
        assert self.train_set is not None, "call setup() first"
        return len(self.train_set)

    def use_prefix(self, n: int | None, steps_per_group: int = 1, reshuffle: bool = True,
                   augment_per_batch: bool = False) -> None:
        """Serve only the first n training examples (the prequential prefix; None = all), in groups
        of ``steps_per_group`` batches per Lightning step when that is more than 1. ``reshuffle`` False:
        the prefix in its order every epoch; ``augment_per_batch``: one crop and flip per batch (both
        protocol=original, mdl/engine/protocol.py ``LoopRules``)."""
        if n is not None and not 0 < n <= self.num_train:
            raise ValueError(f"prefix {n} outside 1..{self.num_train}")
        if steps_per_group < 1:
            raise ValueError(f"mdl.steps_per_group must be >= 1, got {steps_per_group}")
        self.prefix, self.steps_per_group = n, steps_per_group
        self.reshuffle, self.augment_per_batch = reshuffle, augment_per_batch

    def train_dataloader(self) -> DeviceBatches | GroupedBatches:
        assert self.train_set is not None, "call setup() first"
        n, o = self.prefix or self.num_train, self.options
        batches = DeviceBatches(
            self.train_set.x[:n], self.train_set.y[:n], o.batch_size, shuffle=self.reshuffle,
            augment=o.augment, flip=o.flip, seed=self.seed,
            padding_fraction=o.padding_fraction, pad_mode=o.pad_mode, transform=self._batch_eraser,
            class_balance=self._class_balance(), augment_per_batch=self.augment_per_batch,
        )
        return GroupedBatches(batches, self.steps_per_group) if self.steps_per_group > 1 else batches

    def _class_balance(self) -> int | None:
        """The class count the training batches are balanced over (data.balance=rwy), else None."""
        return self.num_classes if self.options.balance == "rwy" else None

    def stacked_train_loader(self, prefixes: list[int], steps_per_group: int = 1,
                             member_ids: list[int] | None = None, seeds: list[int] | None = None,
                             others: Sequence[BatchServing] = (), source_of: list[int] | None = None) -> StackedBatches:
        """Batches for a stack of models, member m training on the first prefixes[m] examples, in
        groups of up to ``steps_per_group`` steps (``member_ids``: each prefix's member id, default 0, 1, ...;
        ``seeds``: each prefix's batch-order seed, default this module's ``seed``; ``others``, ``source_of``:
        packed runs' own data modules and each prefix's, 0 = this one, i = others[i - 1])."""
        assert self.train_set is not None, "call setup() first"
        sources = [TrainSource(other.train_set.x, other.train_set.y, other._batch_eraser) for other in others]
        o = self.options
        return StackedBatches(
            self.train_set.x, self.train_set.y, prefixes, o.batch_size, seed=self.seed, augment=o.augment,
            flip=o.flip, padding_fraction=o.padding_fraction, pad_mode=o.pad_mode, transform=self._batch_eraser,
            steps_per_group=steps_per_group, class_balance=self._class_balance(), member_ids=member_ids, seeds=seeds,
            other_sources=sources, source_of=source_of,
        )

    def val_dataloader(self) -> DeviceBatches:
        return DeviceBatches(self.val_set.x, self.val_set.y, self.options.eval_batch_size)

    def test_dataloader(self) -> DeviceBatches:
        return DeviceBatches(self.test_set.x, self.test_set.y, self.options.eval_batch_size)

    def eval_loader(self, start: int, stop: int) -> DeviceBatches:
        """Unaugmented batches of training examples [start, stop): the next prequential block."""
        assert self.train_set is not None, "call setup() first"
        return DeviceBatches(
            self.train_set.x[start:stop], self.train_set.y[start:stop], self.options.eval_batch_size,
            transform=self._batch_eraser,
        )
