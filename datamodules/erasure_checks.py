"""Applying a fitted eraser to the splits, and checking what it left: the erasure diagnostics, the
criterion (equal class moments), the quadratic leftover, a summary line; the QDA of eval_labels=predicted."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from datamodules.qda import QuadraticDiscriminant
from datamodules.settings import ERASE_CHUNK, ZSCORE_AFTER
from datamodules.splits import Splits
from erasure import Eraser, class_moments, erasure_report
from erasure.diagnostics import erasure_shortfall, probe_shortfall

log = logging.getLogger(__name__)


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


Gaps = tuple[dict[str, float], dict[str, float]]  # moment gaps (before, after) erasure
EXTREME_RATIO = 100.0  # a held-out split whose largest |value| is this many times the training split's is extreme


def not_erased(eraser: Eraser, gaps: dict[str, Gaps | None], report: dict[str, float] | None = None) -> list[str]:
    """Warnings for the targeted class moments the eraser left (nearly) as they were, in words that follow the
    numbers: a gap that shrank by less than 10% is "did not erase" (a run on such data measures no erasure), a gap
    that grew is "added class information" (the edit made the classes more different), with what likely made it
    grow (``report``'s input scales, ``input_scale``). One warning per kind, naming every split it happened on
    (``gaps``: split name -> (before, after) gaps, None where not measured)."""
    kinds: dict[str, dict[str, list[str]]] = {"grew": {}, "kept": {}}  # kind -> split -> "key before -> after (...)"
    for split, pair in gaps.items():
        if pair is None:
            continue
        before, after = pair
        for key in eraser.targeted_gaps():
            if not erasure_shortfall(before, after, (key,)):
                continue
            ratio = after[key] / before[key]
            change = f"grew {ratio:.3g}x" if ratio > 1 else f"{100 * (1 - ratio):.0f}% removed"
            kind = "grew" if ratio > 1 else "kept"
            kinds[kind].setdefault(split, []).append(f"{key} {before[key]:.4g} -> {after[key]:.4g}, {change}")

    def where(found: dict[str, list[str]]) -> str:
        return " and ".join(f"the {split} split ({'; '.join(parts)})" for split, parts in found.items())

    messages = []
    if kinds["kept"]:
        messages.append(
            f"the {eraser.name!r} eraser did not erase on {where(kinds['kept'])}: less than the 10% that counts as "
            f"erased, so this run trains and evaluates on nearly unerased data. To fix it: {eraser.tuning_hint()}"
        )
    if kinds["grew"]:
        messages.append(
            f"the {eraser.name!r} eraser made the classes differ more, not less, on {where(kinds['grew'])}: it added "
            f"class information on this statistic, so this run measures learning from data the eraser distorted, not "
            f"erased data. {grown_gap_cause(report or {})}"
        )
    return messages


def input_scale(splits: Splits) -> dict[str, float]:
    """The largest |value| of each split as the eraser gets it (after data.zscore before erasure), for the
    diagnostics: a held-out split far larger than the training split points at a standardisation that divided a
    feature constant on the training split by its std + eps (datamodules.splits.zscore_map)."""
    return {
        f"max_abs_input_{name}": float(images.x.abs().max()) if len(images) else 0.0
        for name, images in (("train", splits.train), ("val", splits.val), ("test", splits.test))
    }


def grown_gap_cause(report: dict[str, float]) -> str:
    """What most likely made a targeted gap grow, from the input scales in ``report`` (``input_scale``), and what to
    check."""
    train = report.get("max_abs_input_train")
    extreme = {
        split: report[f"max_abs_input_{split}"]
        for split in ("val", "test")
        if train and report.get(f"max_abs_input_{split}", 0.0) > EXTREME_RATIO * train
    }
    if not extreme:
        return (
            "What to check: the eraser's fit (eraser.options; a fit on few rows per class), the labels it maps the "
            "rows with (data.eval_labels), and the data's scale (data.zscore)."
        )
    worst = max(extreme, key=extreme.__getitem__)
    named = {"val": "validation", "test": "test"}
    return (
        f"Likely cause: the {named[worst]} split holds values up to {extreme[worst]:.3g}, the training split at most "
        f"{train:.3g}. data.zscore before the eraser divides each feature by its training-split std + eps, so a feature "
        f"(nearly) constant on the training split is blown up wherever it varies elsewhere; an eraser fitted on the "
        f"validation rows too (eraser.fit_scope=pool) is pulled by them, and its class maps move the training rows. "
        f"To fix it: fit on the training split alone (eraser.fit_scope=split), or standardise after erasure "
        f"(data.zscore={ZSCORE_AFTER})."
    )


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
    distance = (
        []
        if not far
        else [
            f"the {eraser.name!r} eraser moved the images too far to count as close to the originals (paper Sec. 2.4): "
            f"relative RMS change {rms:.3g} > eraser.checks.max_relative_rms_change={rms_bound}; to fix it: raise "
            f"eraser.options.distance_weight or lower the mean and covariance weights"
        ]
    )
    checked = [key for key in keys if f"{key}_after" in report]
    if "chance" not in report or not checked:
        return {"checked": False, "relative_rms_change": rms}, distance + [
            f"the {eraser.name!r} eraser's criterion (probes within {100 * points:g} points of chance) was not checked: "
            f"no probe accuracy in the erasure diagnostics (data.diagnostics=true computes them)"
        ]
    missed = probe_shortfall(report, checked, points)
    record = {
        "checked": True,
        "met": not missed and not far,
        "points": points,
        "chance": report["chance"],
        **{key: report[f"{key}_after"] for key in checked},
        "relative_rms_change": rms,
        "max_relative_rms_change": rms_bound,
    }
    if not missed:
        return record, distance
    gaps = ", ".join(
        f"{key} {report[f'{key}_after']:.4g}" for key in ("max_mean_gap", "max_cov_gap") if f"{key}_after" in report
    )
    return record, [
        f"the {eraser.name!r} eraser did not erase enough to meet the paper's criterion (almost no quadratically "
        f"available information, section 2.4; here: held-out {' and '.join(checked)} within {100 * points:g} points "
        f"of chance {report['chance']:.3f}): {', '.join(missed)}; residual {gaps}. To fix it: {eraser.tuning_hint()}"
    ] + distance


def erasure_warnings(
    eraser: Eraser, info: dict[str, Any], checks: dict[str, Any] | None, fit_scope: str
) -> tuple[dict[str, Any] | None, list[str]]:
    """(criterion record, warnings) of one run's erasure, each finding said once: the gaps it left or grew
    (``info["not_erased"]``, every split in one warning per kind), its criterion (``criterion_check``) and the
    quadratic leftover (``quadratic_leftover``), which is left out when the criterion already names the same QDA
    accuracy (a stricter bound on the same number)."""
    checks = checks or {}
    report = info.get("erasure", {})
    record, missed_criterion = criterion_check(eraser, report, checks)
    covered = bool(record and "qda_acc" in record and record["qda_acc"] > record["chance"] + record["points"])
    leftover = [] if covered else quadratic_leftover(eraser, report, checks.get("qda_warning_points"), fit_scope)
    return record, [*info.get("not_erased", []), *missed_criterion, *leftover]


def quadratic_leftover(
    eraser: Eraser, report: dict[str, float], points: float | None, fit_scope: str = "split"
) -> list[str]:
    """A warning when an eraser that targets class covariances (``erases_quadratic``) leaves a quadratic probe
    more than ``points`` above chance: the data still carries quadratically available class information, whatever
    the eraser's name says (QLEACE on digits: singular class covariances). It says which rows the probe was scored
    on and whether the eraser was fitted on them (``probe_rows``; ``fit_scope``: eraser.fit_scope): inside the fit
    the number is information the eraser left in its own rows, outside it may be the fit not generalising."""
    if not getattr(eraser, "erases_quadratic", False) or points is None:
        return []
    if "qda_acc_after" not in report or "chance" not in report or report["qda_acc_after"] <= report["chance"] + points:
        return []
    return [
        f"after the {eraser.name!r} eraser a quadratic probe (QDA) trained on erased training rows still reads "
        f"{report['qda_acc_after']:.3f} of {probe_rows(eraser, fit_scope)}, against chance {report['chance']:.3f} "
        f"(more than eraser.checks.qda_warning_points={points} above): the erased classes still differ in their "
        f"covariances (e.g. singular class covariances, which the maps match only on their span, or a fit that stopped "
        f"early), "
        f"so this run measures learning from data that still carries quadratically available class information, "
        f"not learning without it"
    ]


def probe_rows(eraser: Eraser, fit_scope: str) -> str:
    """Which rows the probes of ``diagnose`` are scored on, and whether the eraser was fitted on them: an eraser that
    edits only its own fitting data, fitted per split, is probed on held-out training rows (``own_edit_per_split``)."""
    if not getattr(eraser, "can_transform_new_data", True) and fit_scope != "pool":
        return "a held-out part of the training split, which the eraser was fitted on"
    if fit_scope == "pool":
        return "the validation split, which the eraser was fitted on too (eraser.fit_scope=pool)"
    return "the validation split, outside the eraser's fit (eraser.fit_scope=split)"


def diagnostics_summary(report: dict[str, float]) -> str:
    """One log line: residual moment gaps and held-out probe accuracies, before -> after."""
    names = {
        "max_mean_gap": "max mean gap",
        "max_cov_gap": "max cov gap",
        "linear_probe_acc": "linear probe",
        "qda_acc": "QDA",
    }
    parts = [
        f"{label} {report[f'{key}_before']:.4g} -> {report[f'{key}_after']:.4g}"
        for key, label in names.items()
        if f"{key}_before" in report and f"{key}_after" in report
    ]
    if "chance" in report:
        parts.append(f"chance {report['chance']:.3f}")
    return "erasure diagnostics: " + (", ".join(parts) or "none computed")


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


def diagnose(
    eraser: Eraser,
    splits: Splits,
    train_after: Tensor,
    val_after: Tensor,
    skipped: dict[str, str],
    device: torch.device,
    raw_train: bool,
    own_edit_per_split: bool,
    data_seed: int,
) -> dict[str, float]:
    """Moment gaps and linear/QDA probe accuracies on held-out data, before and after erasure.
    Optional numbers: what cannot be computed is recorded in ``skipped`` and warned, never fatal.
    ``raw_train``: the stored training images are raw (augment_then_erase). ``own_edit_per_split``: an eraser
    that edits only its own fitting data was fitted per split, so its probes hold out training rows."""
    train_before, y = splits.train.x.to(device), splits.train.y.to(device)
    if raw_train:
        train_after = erase(eraser, train_before, y if eraser.requires_labels else None)
    log.info("erasure diagnostics: moment gaps, linear probe and QDA before/after")
    # Probes are scored on held-out rows of data edited by the same fit.
    held_out = (
        {}
        if own_edit_per_split
        else {"x_test_before": splits.val.x.to(device), "x_test_after": val_after, "y_test": splits.val.y.to(device)}
    )
    try:
        report = erasure_report(train_before, train_after, y, seed=data_seed, skipped=skipped, **held_out)
        return {**report, **input_scale(splits)}
    except (ValueError, RuntimeError, ArithmeticError) as err:
        skipped["all"] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"erasure diagnostics failed ({skipped['all']}); the run goes on without them "
            f"(data.diagnostics=false skips them)",
            RuntimeWarning,
            stacklevel=2,
        )
        return {}


def label_predictor(
    eraser: Eraser, splits: Splits, eval_labels: bool | str, device: torch.device, regularization: float
) -> QuadraticDiscriminant | None:
    """The QDA whose predictions map val/test under eval_labels=predicted (None otherwise)."""
    if not needs_eval_labels(eraser) or eval_labels is True:
        return None
    moments = class_moments(splits.train.x.to(device), splits.train.y.to(device), len(splits.classes))
    log.info("eval_labels=predicted: val/test mapped with QDA labels (regularization %g)", regularization)
    return QuadraticDiscriminant.from_moments(moments, regularization)
