"""What a sweep will cost, printed before any job runs: its number of jobs and estimated GPU-hours.

A paper preset is one command that can start hundreds of jobs; the user should see the bill first.

    python -m mdl.sweeps.cost +experiment=paper/appendix_c [overrides]   # print it, run nothing
    python launch.py -m +experiment=paper/appendix_c [overrides]        # print it, then run

The job list is Hydra's own (BasicSweeper: ``hydra.sweeper.params``, then the command line, later
wins), and each distinct job (seeds aside) is composed as the launcher composes it. One job takes
    job overhead + sum over its fits (S-1 prequential blocks and the final fit) of
    fit overhead + epochs x (steps x step time + validation batches x batch time),
with epochs = min(max_epochs, warm-up epochs + assumed best epoch + patience) and
step time = step overhead + training FLOPs / FLOP rate, where training FLOPs = batch x (3 x forward
FLOPs, counted by torch's FlopCounterMode on a meta-device model, + 2 d^2 per example when
augment_then_erase applies the eraser to every batch). Rates, overheads and the assumed best epoch
are data: conf/cost/epoch_times.yaml says which are measured (CPU) and which are estimates (GPU).
It counts the models one after the other (the sequential engine); the stacked engine does the same
arithmetic in fewer, larger steps, so for it the estimate is an upper bound.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mdl.sweeps.checks import PACKING_LAUNCHERS

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
SEED_KEYS = ("seed", "data_seed")  # change no job's cost: jobs differing only in these are costed once


@dataclass(frozen=True)
class Rate:
    """Seconds per batch = overhead_s + flops / flops_per_s (one device, one architecture)."""

    overhead_s: float
    flops_per_s: float

    def batch_seconds(self, flops: float) -> float:
        return self.overhead_s + flops / self.flops_per_s


def sweep_jobs(params: dict[str, str], overrides: Sequence[str]) -> list[list[str]]:
    """Every job's overrides, exactly as Hydra's BasicSweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    return BasicSweeper.split_arguments(parsed, None)[0]


def sweep_dimensions(jobs: list[list[str]]) -> list[tuple[str, int]]:
    """(key, number of values) of every swept key, in Hydra's order."""
    if not jobs:
        return []
    dims = []
    for i, entry in enumerate(jobs[0]):
        values = {job[i] for job in jobs}
        if len(values) > 1:
            dims.append((entry.split("=", 1)[0], len(values)))
    return dims


@lru_cache(maxsize=256)
def _flops(name: str, width: int, depth: int, shape: tuple[int, ...], num_classes: int, options: str) -> float:
    import warnings

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models import create_model

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # e.g. Swin on 8x8 digits: one token in the last stages
        model = create_model(name, width, depth, num_classes, shape, base_width=None, **json.loads(options))
        x = torch.empty(2, *shape)
        with FlopCounterMode(display=False) as counter:
            model(x)
    return counter.get_total_flops() / 2


def forward_flops(name: str, width: int, depth: int, shape: Sequence[int], options: Any = None, num_classes: int = 10) -> float:
    """Matmul and convolution FLOPs of one example's forward pass (no weights are allocated)."""
    opts = OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else dict(options or {})
    return _flops(name, int(width), int(depth), tuple(int(s) for s in shape), int(num_classes), json.dumps(opts, sort_keys=True))


class CostTable:
    """conf/cost/epoch_times.yaml: data-set sizes, per-device rates and the stated assumptions."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path if path.is_absolute() else CONF_DIR / path
        self.data = OmegaConf.to_container(OmegaConf.load(self.path), resolve=True)
        self.assume = self.data["assumptions"]
        c = self.data["cpu"]
        self.cpu = self._fit_cpu(c["points"], c["batch"], c["eval_batch"])
        self.gpu = self.data["gpu"]

    @staticmethod
    def _fit_cpu(points: list[dict[str, Any]], batch: int, eval_batch: int) -> dict[str, tuple[Rate, Rate]]:
        """Per architecture, least-squares seconds = overhead + rate^-1 x FLOPs (overhead >= 0), once for
        training steps (batch x 3 x forward FLOPs) and once for validation batches (eval_batch x forward FLOPs)."""

        def fit(xs: list[float], ys: list[float]) -> Rate:
            """Least squares in relative error (weights 1/y^2): the rows span orders of magnitude."""
            w = [1 / y**2 for y in ys]
            sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
            sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
            det = sw * sxx - sx * sx
            a, b = ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (0.0, sxy / sxx)
            if a < 0 or b <= 0:  # no overhead, or one point: a rate through the origin
                a, b = 0.0, sxy / sxx
            return Rate(a, 1.0 / b)

        rates = {}
        for model in sorted({p["model"] for p in points}):
            rows = [p for p in points if p["model"] == model]
            rates[model] = (fit([3 * batch * p["fwd_flops"] for p in rows], [p["step_s"] for p in rows]),
                            fit([eval_batch * p["fwd_flops"] for p in rows], [p["val_batch_s"] for p in rows]))
        return rates

    def gpu_rate(self, model: str, trainer: DictConfig) -> Rate:
        """From the measured anchor throughput of the speed setting, scaled by the assumed relative rate."""
        g = self.gpu
        if trainer.precision == "bf16":
            setting = "bf16_compile" if trainer.compile else "bf16"
        else:
            setting = "fp32_highest" if trainer.matmul_precision == "highest" else "fp32_high"
        a = g["anchor"]
        flops = 3 * a["batch"] * forward_flops(a["model"], a["width"], a["depth"], a["shape"], a.get("options"))
        compute_s = a["batch"] / a["examples_per_s"][setting] - g["step_overhead_s"]
        return Rate(g["step_overhead_s"], flops / compute_s * g["relative_rate"].get(model, 1.0))

    def rates(self, device: str, model: str, trainer: DictConfig) -> tuple[Rate, Rate]:
        """(training step, validation batch) rates; the GPU's validation rate is assumed equal to training's."""
        if device == "gpu":
            rate = self.gpu_rate(model, trainer)
            return rate, rate
        if model not in self.cpu:
            raise ValueError(f"no CPU measurement for model {model!r} in {self.path}")
        return self.cpu[model]

    def data_dims(self, data: DictConfig) -> tuple[int, tuple[int, ...], int]:
        """(examples the prequential schedule covers, image shape, classes) without loading the data."""
        if data.source == "synthetic":
            o = data.options
            n, shape, k, official_test = o.n_train, tuple(o.shape), o.num_classes, o.n_test > 0
        else:
            d = self.data["datasets"][data.source]
            n, shape, k, official_test = d["n"], tuple(d["shape"]), d["classes"], d["official_test"]
            if data.options.get("use_extra"):
                n += d["extra"]
        return n - data.val_size - (0 if official_test else data.test_size), shape, k

    def job_seconds(self, cfg: DictConfig, device: str) -> float:
        """Estimated seconds of one job on ``device`` (cpu | gpu)."""
        from mdl.schedule import block_boundaries

        n, shape, k = self.data_dims(cfg.data)
        bounds = block_boundaries(n, cfg.mdl.num_blocks, cfg.mdl.first_block)
        train_rate, val_rate = self.rates(device, cfg.model.name, cfg.trainer)
        f = forward_flops(cfg.model.name, cfg.width, cfg.depth, shape, cfg.model.options, k)
        erase = 2 * math.prod(shape) ** 2 if cfg.data.augment_order == "augment_then_erase" and cfg.eraser.name != "none" else 0
        batch, eval_batch = cfg.data.batch_size, cfg.data.eval_batch_size
        step = train_rate.batch_seconds(batch * (3 * f + erase))
        val = math.ceil(cfg.data.val_size / eval_batch) * val_rate.overhead_s + cfg.data.val_size * f / val_rate.flops_per_s
        max_epochs = cfg.trainer.kwargs.get("max_epochs")
        per_device = self.data[device]
        fit_overhead = per_device.get("fit_overhead_s") or statistics.median(p["fit_overhead_s"] for p in per_device["points"])
        seconds = per_device["job_overhead_s"] + (self.gpu["compile_s"] if device == "gpu" and cfg.trainer.compile else 0)
        for n_fit in [*bounds[:-1], n]:
            steps = math.ceil(n_fit / batch)
            epochs = math.ceil(cfg.optimizer.get("warmup_steps", 0) / steps) + self.assume["best_epoch_after_warmup"] + cfg.trainer.patience
            if max_epochs not in (None, -1):
                epochs = min(epochs, max_epochs)
            seconds += fit_overhead + epochs * (steps * step + val)
        return seconds


class InvalidJob(ValueError):
    """A job of the sweep that launch.py would refuse (named with its overrides)."""


def job_configs(master: DictConfig, jobs: list[list[str]]) -> list[tuple[DictConfig, int, tuple[str, ...]]]:
    """One composed config per distinct job (seeds aside), how many runs it stands for and its overrides (without
    bookkeeping and seed keys): jobs that differ only
    in bookkeeping keys (mdl/run/identity.py: how a run is logged or stored) are one run, trained once and
    skipped after. Each is checked as launch.py checks a run (mdl.run.config_checks.validate_config): a sweep
    with an invalid job is refused before its first job runs, and no refused job is priced."""
    from hydra.core.global_hydra import GlobalHydra

    from mdl.run.config_checks import validate_config
    from mdl.run.identity import is_bookkeeping

    runs: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for job in jobs:
        run = tuple(o for o in job if not is_bookkeeping(o.split("=", 1)[0]))
        key = _without(run, SEED_KEYS)
        runs.setdefault(key, set()).add(run)
    groups = {key: len(same) for key, same in runs.items()}
    loader = GlobalHydra.instance().config_loader()
    configs = []
    for key, count in groups.items():
        cfg = loader.load_sweep_config(master, list(key))
        try:
            validate_config(cfg)
        except ValueError as err:
            raise InvalidJob(f"job {' '.join(key) or '(no overrides)'}: {err}") from err
        configs.append((cfg, count, key))
    return configs


def hours(seconds: float) -> str:
    """A duration for people: seconds below 6 minutes, hours above."""
    return f"{seconds / 3600:.3g} h" if seconds >= 360 else f"{seconds:.0f} s"


def cost_report(master: DictConfig, table: CostTable) -> str:
    """The lines printed before a sweep: jobs (and their dimensions) and the estimated cost."""
    params = master.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params else {}
    jobs = sweep_jobs(params, OmegaConf.to_container(master.hydra.overrides.task))
    dims = " x ".join(f"{k} {n}" for k, n in sweep_dimensions(jobs)) or "no swept keys"
    lines = [f"sweep: {len(jobs)} jobs ({dims})"]
    configs = job_configs(master, jobs)
    costed = [(cfg, count, table.job_seconds(cfg, "gpu"), table.job_seconds(cfg, "cpu")) for cfg, count, _ in configs]
    gpu = sum(count * s for _, count, s, _ in costed)
    cpu = sum(count * s for _, count, _, s in costed)
    longest = max(s for _, _, s, _ in costed)
    lines.append(
        f"estimated cost: {gpu / 3600:.3g} GPU-hours on {table.gpu['name']} (an estimate: {hours(gpu / len(jobs))} per job on "
        f"average, longest {hours(longest)}); {hours(cpu)} of CPU time at one thread per job (measured rates)"
    )
    lines.append(
        f"  assumed: best epoch {table.assume['best_epoch_after_warmup']} epochs after warm-up, then trainer.patience "
        f"more; rates and how they were made: {table.path}"
    )
    if str(master.hydra.launcher.get("_target_", "")) in PACKING_LAUNCHERS:
        from mdl.run.pack import packs_line

        lines.append(f"  packed: {packs_line(len(jobs), sweep_packs(jobs, configs))}; the estimate above prices every "
                     f"run as if alone (no measured rate of packed fits yet)")
    return "\n".join(lines)


def _without(run: tuple[str, ...], keys: Sequence[str]) -> tuple[str, ...]:
    return tuple(o for o in run if o.split("=", 1)[0].lstrip("+~") not in keys)


def sweep_packs(jobs: list[list[str]], configs: list[tuple[DictConfig, int, tuple[str, ...]]]) -> int:
    """Packs of a packed sweep: runs with equal ``mdl.run.pack.pack_key`` (differing in seed, eraser or data seed)
    are one, a run that cannot be packed its own; jobs differing only in bookkeeping keys are one run.
    ``configs``: ``job_configs``' composed config of each job (seeds aside)."""
    from mdl.run.identity import is_bookkeeping
    from mdl.run.pack import pack_key

    keys = {key: (pack_key(cfg), cfg.optimizer.get("precondition") is not None) for cfg, _, key in configs}
    packs = set()
    for job in jobs:
        run = tuple(o for o in job if not is_bookkeeping(o.split("=", 1)[0]))
        key, by_data_seed = keys[_without(run, SEED_KEYS)]
        if key is None:
            packs.add(("run", run))
        else:  # preconditioned runs pack over seeds only: each data seed its own pack
            data_seed = tuple(o for o in run if o.split("=", 1)[0].lstrip("+~") == "data_seed") if by_data_seed else ()
            packs.add(("pack", key, data_seed))
    return len(packs)


class SweepCost(Callback):
    """Hydra callback: print the sweep's job count and estimated cost before the sweeper starts."""

    def __init__(self, table: str = "cost/epoch_times.yaml") -> None:
        self.table = table

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
            print(f"sweep cost: not estimated for sweeper {config.hydra.sweeper.get('_target_')}", flush=True)
            return
        try:
            print(cost_report(config, CostTable(self.table)), flush=True)
        except InvalidJob as err:  # stop before the first job: a later one would fail after hours of the others
            print(f"error: {err} (no job was run)", file=sys.stderr, flush=True)
            raise SystemExit(2) from err  # launch.py's exit code for a setting to change
        except Exception as err:  # an estimate must never stop a sweep that Hydra can run
            print(f"sweep cost: no estimate ({type(err).__name__}: {err})", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: the same printout for a command line, without launching anything."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode

    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("-m", "--multirun")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            master = GlobalHydra.instance().hydra.compose_config("config", args, run_mode=RunMode.MULTIRUN)
            table = OmegaConf.select(master, "hydra.callbacks.sweep_cost.table", default=SweepCost().table)
            print(cost_report(master, CostTable(table)))
        except (ValueError, KeyError, HydraException) as err:  # a setting to change, not a bug: one message
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err  # launch.py's exit code for a setting to change
    print("(cost only: nothing was launched)")


if __name__ == "__main__":
    main()
