"""What a data module is asked for, read once from the config and checked once: the eraser's options (the ``eraser``
node) and the data options (the ``data`` node, ``data_seed`` and the eraser), each a frozen value, and the erasure
cache keys they determine.

The keys hash what decides the cached files' content (``datamodules.cache.cache_key``): the fitted eraser's key the
source, the split and the eraser node (less its ``checks``, which only judge the result), and the transform when the
eraser is fitted on transformed data; the erased data's key that eraser key plus how validation and test are labelled,
the augmentation order and the steps after the eraser. A setting that is off leaves its key out, so a new setting
invalidates no cached file while it is off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from datamodules.augment import Augmentation
from datamodules.cache import cache_key
from datamodules.settings import (
    FIT_SCOPES,
    ZSCORE_AFTER,
    check_balance,
    check_data_settings,
    check_erasure_settings,
    check_transform,
    resolve_device,
)
from erasure.base import FORMAT_VERSION as ERASER_FORMAT_VERSION
from erasure.base import eraser_class


# eraser node keys that do not change the fitted eraser: left out of the cache keys
NOT_IDENTITY = ("checks", "checkpoint_every_s")


@dataclasses.dataclass(frozen=True)
class EraserOptions:
    """The ``eraser`` config node: its name, options, the rows it is fitted on (``fit_scope``: split | pool), the
    thresholds the run judges it by (``checks``) and, for an eraser whose fit can resume, the least seconds between
    saves of its partial fit (``checkpoint_every_s``; None: never saved). ``identity`` is the node as given less
    ``checks`` and ``checkpoint_every_s``: what the cache keys hash (a key absent from the node stays absent)."""

    name: str
    options: dict[str, Any]
    fit_scope: str
    checks: dict[str, Any]
    identity: dict[str, Any]
    checkpoint_every_s: float | None = None

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> EraserOptions:
        """The options of a plain eraser node, e.g. ``{"name": "leace", "options": {}, "fit_scope": "pool"}``."""
        node = dict(node)
        return cls(
            name=node["name"],
            options=dict(node.get("options") or {}),
            fit_scope=node.get("fit_scope", "split"),
            checks=dict(node.get("checks") or {}),
            identity={k: v for k, v in node.items() if k not in NOT_IDENTITY},
            checkpoint_every_s=node.get("checkpoint_every_s"),
        )

    def __post_init__(self) -> None:
        every = self.checkpoint_every_s
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0):
            raise ValueError(
                f"eraser.checkpoint_every_s={every!r}: give the least seconds between saves of a partial eraser fit "
                f"(a number >= 0; 0 saves at every step), or null to save none"
            )
        rank_from = self.options.get("rank_from") if self.name == "random" else None
        if rank_from is None:
            return
        if self.options.get("rank") is not None:
            raise ValueError(
                f"eraser.options.rank={self.options['rank']} and eraser.options.rank_from={rank_from} both set the "
                f"random control's rank; set one of them (the other to null)"
            )
        if rank_from == "random":
            raise ValueError("eraser.options.rank_from=random: the random control cannot take its rank from itself")

    @property
    def edits_own_data(self) -> bool:
        """Whether the eraser edits only the data it was fitted on (gradient) instead of mapping new data."""
        return not eraser_class(self.name).can_transform_new_data

    @property
    def fits_pool(self) -> bool:
        """Whether the eraser's own edit of training + validation is the data (fit_scope=pool, an eraser that edits
        its own fitting data). A map fitted with fit_scope=pool (LEACE, QLEACE, ALF-QLEACE) sees the validation rows
        too and then erases every split as a map."""
        return self.fit_scope == "pool" and self.edits_own_data

    def described(self) -> dict[str, Any]:
        """The node as given, checks included (for the cache files' description, not their keys)."""
        return {**self.identity, **({"checks": self.checks} if self.checks else {})}


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Every setting of a data module but the batch-order seed: the source and its options, the split, the eraser,
    the steps around it, and how batches are served. Checked when made, each error naming its ``data.`` key;
    ``device`` is resolved to a ``torch.device`` and ``transform`` to a plain dict."""

    source: str
    eraser: EraserOptions
    data_seed: int = 0
    source_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # data.options: the source loader's
    # source options that say where or how the data is fetched, not what it is: left out of the cache keys (the ones
    # a run's identity leaves out, mdl.run.identity.BOOKKEEPING_KEYS: one definition)
    options_not_data: tuple[str, ...] = ()
    val_size: int = 300
    test_size: int = 300
    batch_size: int = 128
    eval_batch_size: int = 1024
    augment: bool = False
    flip: bool = True
    augment_order: str = "erase_then_augment"
    eval_labels: bool | str = True
    device: torch.device | str = "auto"
    padding_fraction: float = 0.125
    pad_mode: str = "constant"
    cache_dir: str | None = None
    qda_regularization: float = 1e-3
    diagnostics: bool = True
    balance: str | None = None
    transform: dict[str, Any] | None = None
    zscore: bool | str = False

    @classmethod
    def from_config(
        cls,
        data: Mapping[str, Any],
        eraser: Mapping[str, Any],
        data_seed: int = 0,
        options_not_data: tuple[str, ...] = (),
    ) -> DataOptions:
        """The options of a plain ``data`` node (its keys are this class's fields, ``options`` the source options)
        and ``eraser`` node."""
        data = dict(data)
        return cls(
            eraser=EraserOptions.from_config(eraser),
            data_seed=data_seed,
            source_options=data.pop("options", None),
            options_not_data=tuple(options_not_data),
            **data,
        )

    def __post_init__(self) -> None:
        check_data_settings(
            self.val_size,
            self.test_size,
            self.batch_size,
            self.eval_batch_size,
            self.qda_regularization,
            self.padding_fraction,
        )
        check_balance(self.balance)
        object.__setattr__(self, "transform", check_transform(self.transform))
        scope = self.eraser.fit_scope
        check_erasure_settings(
            self.augment_order,
            self.eval_labels,
            self.zscore,
            self.transform,
            scope,
            pooled=scope in FIT_SCOPES and self.eraser.fits_pool,
        )
        if self.augment_order == "augment_then_erase" and self.eraser.edits_own_data:
            raise ValueError(
                f"the {self.eraser.name!r} eraser edits only the data it was fitted on, so it cannot erase augmented "
                f"batches; use data.augment_order=erase_then_augment"
            )
        Augmentation(self.flip, self.padding_fraction, self.pad_mode)  # its checks, whether data.augment is on or off
        object.__setattr__(self, "source_options", dict(self.source_options or {}))
        object.__setattr__(self, "device", resolve_device(str(self.device)))

    def augmentation(self) -> Augmentation | None:
        """The training batches' crop and flip (None without ``data.augment``)."""
        return Augmentation(self.flip, self.padding_fraction, self.pad_mode) if self.augment else None

    # --- cache keys --------------------------------------------------------------------------

    def source_identity(self) -> dict[str, Any]:
        """The source and the options that change its data."""
        options = {k: v for k, v in self.source_options.items() if k not in self.options_not_data}
        return {"name": self.source, "options": options}

    def split_identity(self) -> dict[str, Any]:
        """What decides the splits the eraser is fitted on."""
        split = {"data_seed": self.data_seed, "val_size": self.val_size, "test_size": self.test_size}
        if self.balance is not None:
            split["balance"] = self.balance
        if self.zscore is True:  # z-scored before the eraser: part of what it is fitted on
            split["zscore"] = True
        return split

    def eraser_key(self, eraser: EraserOptions | None = None) -> str:
        """The fitted eraser's key: this one's, or ``eraser`` fitted on the same splits (random's rank_from)."""
        parts: dict[str, Any] = {}
        if self.transform is not None and self.transform["order"] == "before_eraser":
            parts["transform"] = self.transform  # the eraser is fitted on transformed data
        return cache_key(
            kind="eraser",
            source=self.source_identity(),
            split=self.split_identity(),
            eraser=(eraser or self.eraser).identity,
            eraser_format=ERASER_FORMAT_VERSION,
            **parts,
        )

    def data_key(self) -> str:
        """The erased splits' key."""
        evaluation: dict[str, Any] = {"eval_labels": self.eval_labels}
        if self.eval_labels == "predicted":
            evaluation["qda_regularization"] = self.qda_regularization
        parts: dict[str, Any] = {"transform": self.transform} if self.transform is not None else {}
        if self.zscore == ZSCORE_AFTER:  # the erased splits standardised
            parts["zscore"] = ZSCORE_AFTER
        return cache_key(
            kind="erased", eraser=self.eraser_key(), evaluation=evaluation, augment_order=self.augment_order, **parts
        )

    def describe(self, eraser: EraserOptions | None = None) -> dict[str, Any]:
        """What a cache file holds, in words (stored beside it; not part of its key)."""
        return {
            "source": self.source_identity(),
            "split": self.split_identity(),
            "eraser": (eraser or self.eraser).described(),
            "eval_labels": self.eval_labels,
            "augment_order": self.augment_order,
            "transform": self.transform,
        }
