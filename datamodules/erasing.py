"""Erasure as a step of its own, on tensors, without Lightning: fit the eraser on the rows its ``fit_scope`` names,
then erase the splits with it and diagnose the result (``erase_splits``). The data module caches both results
(datamodules.cache) and serves the erased splits.

Label-dependent erasers (``requires_labels``, e.g. qleace) need a class for every example they map; an eraser that
only edits the data it was fitted on (gradient) is fitted again on the validation and on the test split, with labels
chosen the same way. The training split always uses its true labels (it is the data being learned, and the
prequential blocks are scored on it as erased). Validation and test use ``data.eval_labels``: ``true`` (the paper's
choice: their true labels, which leaks label information into evaluation) or ``predicted`` (the class a quadratic
discriminant fitted on the training split's moments assigns: no evaluation label is used).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import Tensor

from datamodules.erasure_checks import (
    _report_gaps,
    diagnose,
    diagnostics_summary,
    edit_rank,
    erase,
    label_predictor,
    needs_eval_labels,
    not_erased,
)
from datamodules.options import DataOptions, EraserOptions
from datamodules.settings import POOLED_ERASERS, ZSCORE_AFTER, default_options
from datamodules.splits import Splits, apply_transform, fit_transform, zscore_map
from datamodules.timing import timed
from erasure import Eraser, fit_eraser
from erasure.resumable import FitProgress

log = logging.getLogger(__name__)


def fit_on_scope(
    splits: Splits,
    eraser: EraserOptions,
    device: torch.device,
    options: dict[str, Any] | None = None,
    progress: FitProgress | None = None,
) -> Eraser:
    """``eraser`` fitted (with ``options``, default its own) on the training split, or with ``fit_scope=pool`` on
    the training and validation splits together: validation rows in the fit, as every scored block is (for an eraser
    that edits its fitting data, one edit of both, as the original's erased copy of its pool). ``progress``: where a
    resumable fit keeps its state (datamodules.fit_progress)."""
    x, y = splits.train.x, splits.train.y
    if eraser.fit_scope == "pool":
        x, y = torch.cat([x, splits.val.x]), torch.cat([y, splits.val.y])
    log.info(
        "fitting eraser %s on %d examples (%s)",
        eraser.name,
        len(y),
        "training and validation splits" if eraser.fit_scope == "pool" else "training split",
    )
    return fit_eraser(
        eraser.name,
        x.to(device),
        y.to(device),
        num_classes=len(splits.classes),
        progress=progress,
        **(eraser.options if options is None else options),
    )


def rank_source(name: str, options: dict[str, Any] | None) -> EraserOptions:
    """The eraser whose edit rank ``eraser.options.rank_from`` names, as a run of it is configured: its options over
    their code defaults (conf/eraser/<name>.yaml repeats them) and that run's fit_scope, so both share a cache key."""
    node = {"name": name, "options": {**default_options(name), **(options or {})}}
    return EraserOptions.from_config({**node, **({"fit_scope": "pool"} if name in POOLED_ERASERS else {})})


def fit_options(eraser: EraserOptions, fitted: Callable[[EraserOptions], Eraser]) -> dict[str, Any]:
    """The options ``eraser`` is fitted with: its own; for ``random`` with ``rank_from: <eraser>``, ``rank`` becomes
    the edit rank of that eraser (``rank_from_options``) as ``fitted`` returns it (the data module: through the eraser
    cache, so a sweep fits it once and a run of that eraser with the same options shares it)."""
    options = dict(eraser.options)
    if eraser.name != "random":
        return options
    source, source_options = options.pop("rank_from", None), options.pop("rank_from_options", None)
    if source is None:
        return options
    options["rank"] = edit_rank(fitted(rank_source(source, source_options)))
    log.info(
        "eraser random: rank %d, the edit rank of %s %s on this training split", options["rank"], source, source_options
    )
    return options


def erase_splits(splits: Splits, eraser: Eraser, options: DataOptions) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every split erased once (train with its labels, val/test as ``data.eval_labels`` says), then transformed and
    standardised when asked, as tensors (``train_x``, ``train_y``, ``val_x``, ...) on ``options.device``; and what
    was measured on the way (JSON: classes, diagnostics, warnings under ``not_erased``, balance, transform, zscore).
    With ``augment_order=augment_then_erase`` the training images stay raw: the loaders erase each batch."""
    on = options.device
    info: dict[str, Any] = {"classes": splits.classes}
    erased = _erase_held_out(splits, eraser, options, info)
    train_x, train_y = splits.train.x.to(on), splits.train.y.to(on)
    if options.eraser.fits_pool:  # the eraser holds the edited training + validation rows, in that order
        train_x = eraser.edited[: len(splits.train)].to(on).view_as(splits.train.x)
    elif options.augment_order == "erase_then_augment":
        train_x = erase(eraser, train_x, train_y if eraser.requires_labels else None)
    tensors = {
        "train_x": train_x,
        "train_y": train_y,
        "val_x": erased["val"],
        "val_y": splits.val.y,
        "test_x": erased["test"],
        "test_y": splits.test.y,
    }
    if options.diagnostics:
        skipped: dict[str, str] = {}
        with timed("eraser: diagnostics"):
            info["erasure"] = diagnose(
                eraser,
                splits,
                train_x,
                erased["val"],
                skipped,
                on,
                raw_train=options.augment_order == "augment_then_erase",
                own_edit_per_split=not getattr(eraser, "can_transform_new_data", True) and not options.eraser.fits_pool,
                data_seed=options.data_seed,
            )
        if skipped:
            info["erasure_skipped"] = skipped
        log.info(diagnostics_summary(info["erasure"]))
    gaps = eraser.fit_gaps() or _report_gaps(info.get("erasure", {}))
    info["not_erased"] = not_erased(eraser, {"training": gaps, **info.pop("split_gaps", {})}, info.get("erasure"))
    if splits.balance is not None:
        info["balance"] = splits.balance
    if splits.zscore is not None:
        info["zscore"] = splits.zscore
    if options.transform is not None:
        info["transform"] = splits.transform
        if options.transform["order"] == "after_eraser":  # fitted on the erased training split
            t = fit_transform(tensors["train_x"], options.transform, on)
            for key in ("train_x", "val_x", "test_x"):
                tensors[key] = apply_transform(t, tensors[key].to(on))
            info["transform"] = {**options.transform, **t.summary()}
    if options.zscore == ZSCORE_AFTER:  # last: the erased (and transformed) splits, by the erased training split
        z, info["zscore"] = zscore_map(tensors["train_x"], ZSCORE_AFTER)
        for key in ("train_x", "val_x", "test_x"):
            tensors[key] = z(tensors[key].to(on))
    return tensors, info


def _erase_held_out(splits: Splits, eraser: Eraser, options: DataOptions, info: dict[str, Any]) -> dict[str, Tensor]:
    """The erased validation and test images (labels as ``data.eval_labels`` says; QDA accuracies into ``info``)."""
    on = options.device
    qda = label_predictor(eraser, splits, options.eval_labels, on, options.qda_regularization)
    erased = {}
    if options.eraser.fits_pool:  # the eraser holds the edited training + validation rows, in that order
        erased["val"] = eraser.edited[len(splits.train) :].to(on).view_as(splits.val.x)
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
                options.eraser.name, x, labels, num_classes=len(splits.classes), **options.eraser.options
            )
            erased[name] = erase(split_eraser, x, labels if split_eraser.requires_labels else None)
            info.setdefault("split_gaps", {})[name] = split_eraser.fit_gaps()  # judged with the training split's
    return erased
