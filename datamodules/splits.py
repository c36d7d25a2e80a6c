"""Splits of a data set: loading them (seeded split, class balancing, standardisation), and the covariance
transform fitted on the training split."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from datamodules.settings import ERASE_CHUNK, check_balance
from datamodules.sources import ImageSet, ImageSource, load_source
from erasure import CovariancePower, fit_covariance_power

if TYPE_CHECKING:
    from datamodules.options import DataOptions

log = logging.getLogger(__name__)


def seeded_split(n: int, sizes: list[int], data_seed: int) -> list[Tensor]:
    """A random permutation of range(n) cut into consecutive pieces; the remainder comes last."""
    if sum(sizes) >= n:
        raise ValueError(f"split sizes {sizes} leave no training data out of {n} examples; lower val_size/test_size")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(data_seed))
    return list(perm.split([*sizes, n - sum(sizes)]))


def balance_indices(y: Tensor, method: str, data_seed: int) -> Tensor:
    """Positions into the training labels ``y`` (already in their seeded order) that make the stored
    training split, in its stored (prequential) order.

    suby: every class keeps its first m examples in that order, m the smallest class count (classes
    absent from the split are ignored); the kept examples keep their relative (random) order.
    rwy: every example, as it is: RWY reweights the *sampling* of each epoch (datamodules.loader
    ``class_balanced_weights``), never the stored data: a fixed bootstrap would put copies of training examples
    into the blocks the online code scores (35.6% of them on digits)."""
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


def size_follows_data_seed(balance: str | None) -> bool:
    """Whether the training split's size depends on ``data_seed``: suby keeps the smallest class count of the seeded
    split (``balance_indices``); every other split has the sizes its config sets."""
    return balance == "suby"


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


@dataclasses.dataclass(frozen=True)
class Splits:
    train: ImageSet
    val: ImageSet
    test: ImageSet
    classes: list[str]
    balance: dict[str, Any] | None = None  # class counts of the training split before / after balancing
    zscore: dict[str, Any] | None = None  # data.zscore: what the standardisation was fitted on
    transform: dict[str, Any] | None = None  # data.transform before the eraser: its setting and spectrum


def standardised(splits: Splits) -> Splits:
    """Every split z-scored per (pixel, channel) with the training split's mean and standard deviation
    (float64 statistics, float32 data), before any eraser sees the data: the condition of the paper's
    Figure 16 and its table. As the original code (EleutherAI/mdl experiments/cli.py normalize_dataset,
    commit 0cc7065): per-coordinate mean and std, std + float32 eps (a constant pixel maps to 0, not NaN),
    applied to the images before erasure and augmentation, so crops pad with the mean. Ours: the
    statistics come from the training split only (the original's came from its pool minus a 1024-image
    validation set, which held the sweep's own validation and test chunks)."""
    z, info = zscore_map(splits.train.x)

    def mapped(images: ImageSet) -> ImageSet:
        return ImageSet(z(images.x), images.y)

    return dataclasses.replace(
        splits, train=mapped(splits.train), val=mapped(splits.val), test=mapped(splits.test), zscore=info
    )


def zscore_map(train_x: Tensor, when: str = "before_eraser") -> tuple[Callable[[Tensor], Tensor], dict[str, Any]]:
    """The per-(pixel, channel) standardisation fitted on ``train_x`` (float64 mean and std + float32 eps) as a
    function of any split's images, and what it was fitted on. ``when``: before_eraser (``data.zscore=true``) or
    after_eraser (``data.zscore=after_eraser``: ``train_x`` is the erased training split)."""
    x = train_x.double().flatten(1)
    mean, std = x.mean(0), x.std(0) + torch.finfo(torch.float32).eps

    def z(images: Tensor) -> Tensor:
        shape = images.shape
        return ((images.double().flatten(1) - mean.to(images.device)) / std.to(images.device)).float().view(shape)

    info = {
        "statistics": "training split" if when == "before_eraser" else "erased training split",
        "examples": int(x.shape[0]),
        "constant_features": int((std <= 2 * torch.finfo(torch.float32).eps).sum()),
    }
    if when != "before_eraser":
        info["when"] = when
    log.info(
        "data.zscore: every split standardised with the %s's mean and std (%d constant features)",
        info["statistics"],
        info["constant_features"],
    )
    return z, info


def load_splits(options: DataOptions) -> Splits:
    """The source's training, validation and test splits: split by ``data_seed`` (the training split in its seeded
    order, the prequential order), balanced (``data.balance``) and standardised (``data.zscore=true``) as asked."""
    src: ImageSource = load_source(options.source, **options.source_options)
    x, y = src.train.x, src.train.y
    held = options.val_size + (options.test_size if src.test is None else 0)
    if held >= len(y):
        sizes = "data.val_size" + (" + data.test_size" if src.test is None else "")
        raise ValueError(
            f"{sizes} = {held} leaves no training examples out of the {len(y)} of data source "
            f"{options.source!r}; lower {sizes.replace(' + ', ' and ')} (at most {len(y) - 1} in all)"
        )
    if src.test is None:
        val_idx, test_idx, train_idx = seeded_split(len(y), [options.val_size, options.test_size], options.data_seed)
        test = ImageSet(x[test_idx], y[test_idx])
    else:
        val_idx, train_idx = seeded_split(len(y), [options.val_size], options.data_seed)
        test = src.test
    balance = None
    if options.balance is not None:
        before = torch.bincount(y[train_idx], minlength=len(src.classes))
        train_idx = train_idx[balance_indices(y[train_idx], options.balance, options.data_seed)]
        after = torch.bincount(y[train_idx], minlength=len(src.classes))
        balance = {
            "method": options.balance,
            "class_counts_before": before.tolist(),
            "class_counts_after": after.tolist(),
        }
        if options.balance == "rwy":  # the stored split is unchanged; each epoch's draws are balanced
            balance["sampling"] = "each epoch: n draws with replacement, probability 1 / class count in the prefix"
        log.info("data.balance=%s: training class counts %s -> %s", options.balance, before.tolist(), after.tolist())
    splits = Splits(ImageSet(x[train_idx], y[train_idx]), ImageSet(x[val_idx], y[val_idx]), test, src.classes, balance)
    return standardised(splits) if options.zscore is True else splits


def fit_transform(x: Tensor, setting: dict[str, Any], device: torch.device) -> CovariancePower:
    """The ``data.transform`` fitted on the training images ``x``; errors name the setting."""
    log.info(
        "fitting the %s transform (p=%g, eps=%g, %s) on %d training examples",
        setting["name"],
        setting["p"],
        setting["eps"],
        setting["order"],
        x.shape[0],
    )
    try:
        t = fit_covariance_power(x.to(device), p=setting["p"], eps=setting["eps"])
    except ValueError as err:  # the math layer knows only p and eps
        raise ValueError(f"data.transform: {err}") from err
    log.info(
        "transform %s: condition number %.4g -> %.4g, effective rank %.4g -> %.4g (of %d)",
        setting["name"],
        t.condition_before,
        t.condition_after,
        t.effective_rank_before,
        t.effective_rank_after,
        t.dim,
    )
    return t


def transformed_before(splits: Splits, setting: dict[str, Any] | None, device: torch.device) -> Splits:
    """The splits the eraser sees: mapped by the transform fitted on the training split when
    ``data.transform.order=before_eraser``, else ``splits`` as they are."""
    if setting is None or setting["order"] != "before_eraser":
        return splits
    t = fit_transform(splits.train.x, setting, device)

    def mapped(images: ImageSet) -> ImageSet:
        return ImageSet(apply_transform(t, images.x.to(device)), images.y)

    return dataclasses.replace(
        splits,
        train=mapped(splits.train),
        val=mapped(splits.val),
        test=mapped(splits.test),
        transform={**setting, **t.summary()},
    )
