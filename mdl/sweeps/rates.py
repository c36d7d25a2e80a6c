"""Seconds per training step and per validation batch for the sweep cost estimate (mdl.sweeps.cost), per
device, architecture, speed setting and fit kind (one member per fit, or a stack of members), from
conf/cost/epoch_times.yaml: fitted to its measured rows (``points``, printed by benchmarks/bench_epoch_times.py) where
a device's section has them, derived from the GPU's measured anchor throughput and stated assumptions where not.

A row of M members (``members: M``) times one optimizer step of all M, each on its own batch: a member's share,
``step_s / M``, is what one member's step costs inside a stack (a fit of several members, or a pack of runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

CPU_SETTING = "fp32"  # the CPU rows are measured in fp32 whatever the trainer asks for


@dataclass(frozen=True)
class Rate:
    """Seconds per batch = overhead_s + flops / flops_per_s (one device, one architecture)."""

    overhead_s: float
    flops_per_s: float

    def batch_seconds(self, flops: float) -> float:
        return self.overhead_s + flops / self.flops_per_s


def fit_rate(xs: list[float], ys: list[float]) -> Rate:
    """Least squares of seconds = overhead + FLOPs / rate (overhead >= 0) in relative error (weights 1/y^2: the
    rows span orders of magnitude); one row, or a negative overhead: a rate through the origin."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    a, b = ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (0.0, sxy / sxx)
    if a < 0 or b <= 0:
        a, b = 0.0, sxy / sxx
    return Rate(a, 1.0 / b)


def gpu_setting(trainer: Any) -> str:
    """The speed setting a run's trainer config asks for, in the table's names."""
    if trainer.precision == "bf16":
        return "bf16_compile" if trainer.compile else "bf16"
    return "fp32_highest" if trainer.matmul_precision == "highest" else "fp32_high"


class MeasuredRates:
    """Rates fitted per (architecture, setting, stacked) to a section's measured rows: training steps against
    batch x 3 x forward FLOPs per member (a stacked row's member share), validation batches against eval_batch x
    forward FLOPs (rows of one member)."""

    def __init__(self, points: list[dict[str, Any]], batch: int, eval_batch: int) -> None:
        train: dict[tuple[str, str, bool], tuple[list[float], list[float]]] = {}
        val: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        for p in points:
            members, setting = int(p.get("members", 1)), p.get("setting", CPU_SETTING)
            xs, ys = train.setdefault((p["model"], setting, members > 1), ([], []))
            xs.append(3 * batch * p["fwd_flops"])
            ys.append(p["step_s"] / members)
            if members == 1 and "val_batch_s" in p:
                vx, vy = val.setdefault((p["model"], setting), ([], []))
                vx.append(eval_batch * p["fwd_flops"])
                vy.append(p["val_batch_s"])
        self.train = {key: fit_rate(*xy) for key, xy in train.items()}
        self.val = {key: fit_rate(*xy) for key, xy in val.items()}

    def has(self, model: str, setting: str) -> bool:
        """Whether one member's steps and validation batches were measured for this model and setting."""
        return (model, setting, False) in self.train and (model, setting) in self.val

    def rates(self, model: str, setting: str, stacked: bool, where: str) -> tuple[Rate, Rate, bool]:
        """(training step of one member, validation batch, whether a stack's own rate was measured). A stack
        without stacked rows is priced at one member's rate: the same arithmetic, an assumption (measured on a CPU,
        a stacked member's step costs from 0.6x to 3x one model's, depending on the model and its size)."""
        one, val = self.train.get((model, setting, False)), self.val.get((model, setting))
        if one is None or val is None:
            measured = sorted({f"{m} {s}" for m, s, _ in self.train})
            raise ValueError(f"no measured {setting} rate for model {model!r} in {where} (measured: {measured})")
        many = self.train.get((model, setting, True)) if stacked else None
        return (many or one), val, many is not None


def anchored_gpu_rate(gpu: dict[str, Any], model: str, setting: str, forward_flops: Callable[..., float]) -> Rate:
    """Without measured GPU rows: the anchor's measured throughput of the speed setting as a FLOP rate, scaled by
    the assumed relative rate of the architecture (conf/cost/epoch_times.yaml says which values are assumed)."""
    a = gpu["anchor"]
    flops = 3 * a["batch"] * forward_flops(a["model"], a["width"], a["depth"], a["shape"], a.get("options"))
    compute_s = a["batch"] / a["examples_per_s"][setting] - gpu["step_overhead_s"]
    return Rate(gpu["step_overhead_s"], flops / compute_s * gpu["relative_rate"].get(model, 1.0))
