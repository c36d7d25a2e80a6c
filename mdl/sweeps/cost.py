"""What a sweep will cost, printed before any job runs: its number of jobs and estimated GPU-hours.

A paper preset is one command that can start hundreds of jobs; the user should see the bill first.

    python -m mdl.sweeps.cost +experiment=paper/appendix_c [overrides]   # print it, run nothing
    python launch.py -m +experiment=paper/appendix_c [overrides]        # print it, then run

The job list is Hydra's own (BasicSweeper: ``hydra.sweeper.params``, then the command line, later
wins), and each distinct job (seeds aside) is composed as the launcher composes it. One job takes
    job overhead + fits x fit overhead + sum over its S members (S-1 prequential blocks and the final fit) of
    epochs x (steps x step time + validation batches x batch time),
with fits = ceil(S / mdl.members_per_fit), epochs = min(max_epochs, warm-up epochs + assumed best epoch +
patience) and step time = step overhead + training FLOPs / FLOP rate, where training FLOPs = batch x (3 x
forward FLOPs, counted by torch's FlopCounterMode on a meta-device model, + 2 d^2 per example when
augment_then_erase applies the eraser to every batch). A member of a fit of several (or of a pack, which
pays one job overhead for all its runs) steps at a stack's measured rate per member where the table has one
(mdl.sweeps.rates), at one member's rate otherwise (the same arithmetic: an assumption, not a bound). Rates, overheads
and the assumed best epoch are data: conf/cost/epoch_times.yaml says which are measured and which are estimates.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mdl.sweeps.checks import PACKING_LAUNCHERS
from mdl.run.sweep_jobs import BASIC_SWEEPER, SEED_KEYS, expand_sweep, sweep_dimensions, without_keys
from mdl.sweeps.rates import CPU_SETTING, MeasuredRates, Rate, anchored_gpu_rate, gpu_setting

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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


def forward_flops(
    name: str, width: int, depth: int, shape: Sequence[int], options: Any = None, num_classes: int = 10
) -> float:
    """Matmul and convolution FLOPs of one example's forward pass (no weights are allocated)."""
    opts = OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else dict(options or {})
    return _flops(
        name, int(width), int(depth), tuple(int(s) for s in shape), int(num_classes), json.dumps(opts, sort_keys=True)
    )


class CostTable:
    """conf/cost/epoch_times.yaml: data-set sizes, per-device rates and the stated assumptions."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path if path.is_absolute() else CONF_DIR / path
        self.data = OmegaConf.to_container(OmegaConf.load(self.path), resolve=True)
        self.assume = self.data["assumptions"]
        self.measured = {
            device: MeasuredRates(
                self.data[device]["points"], self.data[device]["batch"], self.data[device]["eval_batch"]
            )
            for device in ("cpu", "gpu")
            if self.data[device].get("points")
        }
        self.gpu = self.data["gpu"]

    def rates(self, device: str, model: str, trainer: DictConfig, stacked: bool = False) -> tuple[Rate, Rate, bool]:
        """(training step of one member, validation batch, whether a stack's own rate was measured) on ``device``;
        a stack without a measured rate is priced at one member's (the same arithmetic: an assumption). GPU settings
        or models without measured rows take the anchor-derived rate, for training and validation alike."""
        setting = gpu_setting(trainer) if device == "gpu" else CPU_SETTING
        if device in self.measured and (device == "cpu" or self.measured[device].has(model, setting)):
            return self.measured[device].rates(model, setting, stacked, f"{self.path} ({device})")
        rate = anchored_gpu_rate(self.gpu, model, setting, forward_flops)
        return rate, rate, False

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

    def job_seconds(self, cfg: DictConfig, device: str, packed: bool = False) -> float:
        """Estimated seconds of one job on ``device`` (cpu | gpu); ``packed``: trained as members of a pack's
        fits (mdl.engine.driver), its steps at a stack's rate, without the overheads (the pack's: ``pack_overhead``)."""
        return self.job_estimate(cfg, device, packed)[0]

    def pack_overhead(self, cfg: DictConfig, device: str, runs: int) -> float:
        """A pack's own seconds besides its members' work (a run alone: a pack of one): one job overhead,
        compilation once, and a fit overhead per fit."""
        per_device = self.data[device]
        return (
            per_device["job_overhead_s"]
            + len(self.fit_sizes(cfg, runs)) * per_device["fit_overhead_s"]
            + (self.gpu["compile_s"] if device == "gpu" and cfg.trainer.compile else 0)
        )

    def _boundaries(self, cfg: DictConfig) -> list[int]:
        from mdl.schedule import block_boundaries, protocol_rounding

        n = self.data_dims(cfg.data)[0]
        return block_boundaries(n, cfg.mdl.num_blocks, cfg.mdl.first_block, protocol_rounding(cfg))

    def fit_sizes(self, cfg: DictConfig, runs: int = 1) -> list[int]:
        """Members of each fit as the engine splits them (mdl.engine.memory.pack_fits: a run alone is a pack of
        one); ``auto``: all in one fit, assumed to fit in memory."""
        from mdl.engine.members import AUTO
        from mdl.engine.memory import pack_fits
        from mdl.run.identity import members_per_fit

        k = members_per_fit(cfg.mdl)
        k, size = (None if k == AUTO else k), len(self._boundaries(cfg))
        return [len(f) for f in pack_fits(runs, size, k)]

    def job_estimate(self, cfg: DictConfig, device: str, packed: bool = False) -> tuple[float, bool]:
        """(seconds, whether a stacked fit was priced at a measured stacked rate rather than one member's)."""
        n, shape, k = self.data_dims(cfg.data)
        bounds = self._boundaries(cfg)  # a member per prequential block and the final fit
        stacked = packed or max(self.fit_sizes(cfg)) > 1
        train_rate, val_rate, stacked_rate = self.rates(device, cfg.model.name, cfg.trainer, stacked)
        f = forward_flops(cfg.model.name, cfg.width, cfg.depth, shape, cfg.model.options, k)
        erase = (
            2 * math.prod(shape) ** 2
            if cfg.data.augment_order == "augment_then_erase" and cfg.eraser.name != "none"
            else 0
        )
        batch, eval_batch = cfg.data.batch_size, cfg.data.eval_batch_size
        step = train_rate.batch_seconds(batch * (3 * f + erase))  # one member's step (its share of a stack's)
        val = (
            math.ceil(cfg.data.val_size / eval_batch) * val_rate.overhead_s
            + cfg.data.val_size * f / val_rate.flops_per_s
        )
        max_epochs = cfg.trainer.kwargs.get("max_epochs")
        seconds = 0.0 if packed else self.pack_overhead(cfg, device, runs=1)  # a run alone: a pack of one
        for n_fit in [*bounds[:-1], n]:
            steps = math.ceil(n_fit / batch)
            epochs = (
                math.ceil(cfg.optimizer.get("warmup_steps", 0) / steps)
                + self.assume["best_epoch_after_warmup"]
                + cfg.trainer.patience
            )
            if max_epochs not in (None, -1):
                epochs = min(epochs, max_epochs)
            seconds += epochs * (steps * step + val)
        return seconds, stacked_rate


class InvalidJob(ValueError):
    """A job of the sweep that launch.py would refuse (named with its overrides)."""


def job_configs(master: DictConfig, jobs: list[list[str]]) -> list[tuple[DictConfig, int, tuple[str, ...]]]:
    """One composed config per distinct job (seeds aside), how many runs it stands for and its overrides (without
    bookkeeping and seed keys): jobs that differ only
    in bookkeeping keys (mdl.run.identity: how a run is logged or stored) are one run, trained once and
    skipped after. Each is checked as launch.py checks a run (mdl.run.config_checks.validate_config): a sweep
    with an invalid job is refused before its first job runs, and no refused job is priced."""
    from hydra.core.global_hydra import GlobalHydra

    from mdl.run.config_checks import validate_config
    from mdl.run.identity import is_bookkeeping

    runs: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    others = set()  # the seed and bookkeeping overrides that a job's cost leaves out, checked all the same
    for job in jobs:
        run = tuple(o for o in job if not is_bookkeeping(o.split("=", 1)[0]))
        key = without_keys(run, SEED_KEYS)
        runs.setdefault(key, set()).add(run)
        others.add(tuple(o for o in job if o not in key))
    groups = {key: len(same) for key, same in runs.items()}
    loader = GlobalHydra.instance().config_loader()

    def checked(overrides: tuple[str, ...]) -> DictConfig:
        cfg = loader.load_sweep_config(master, list(overrides))
        try:
            validate_config(cfg)
        except ValueError as err:
            raise InvalidJob(f"job {' '.join(overrides) or '(no overrides)'}: {err}") from err
        return cfg

    configs = [(checked(key), count, key) for key, count in groups.items()]
    for values in sorted(others - {()}):  # each once, with the first job's other keys: seed=abc is refused too
        checked((*next(iter(groups)), *values))
    return configs


def hours(seconds: float) -> str:
    """A duration for people: seconds below 6 minutes, hours above."""
    return f"{seconds / 3600:.3g} h" if seconds >= 360 else f"{seconds:.0f} s"


@dataclass
class Estimate:
    """A sweep's jobs and estimated seconds (GPU: the table's GPU; CPU: each job on one thread)."""

    jobs: list[list[str]]
    gpu_s: float
    cpu_s: float
    longest_gpu_s: float  # the longest job (or pack, when the launcher packs)
    packed: Any = None  # mdl.sweeps.pack_cost.PackedCost when the launcher packs
    alone_gpu_s: float = 0.0  # the same runs job by job (what packing saves against)


def estimate(master: DictConfig, table: CostTable) -> Estimate:
    """The sweep of a composed multirun config, priced job by job (or pack by pack)."""
    params = master.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params else {}
    jobs = expand_sweep(params, OmegaConf.to_container(master.hydra.overrides.task))
    configs = job_configs(master, jobs)
    gpu, cpu, longest = sweep_seconds(table, configs)
    if str(master.hydra.launcher.get("_target_", "")) not in PACKING_LAUNCHERS:
        return Estimate(jobs, gpu, cpu, longest, alone_gpu_s=gpu)
    from mdl.sweeps.pack_cost import packed_sweep_cost

    packed = packed_sweep_cost(table, master, jobs, configs)
    return Estimate(jobs, packed.gpu_s, packed.cpu_s, packed.longest_gpu_s, packed, alone_gpu_s=gpu)


def cost_report(master: DictConfig, table: CostTable, cost: Estimate | None = None) -> str:
    """The lines printed before a sweep: jobs (and their dimensions) and the estimated cost (``cost``: made already)."""
    cost = cost or estimate(master, table)
    dims = " x ".join(f"{k} {n}" for k, n in sweep_dimensions(cost.jobs)) or "no swept keys"
    lines = [
        f"sweep: {len(cost.jobs)} jobs ({dims})",
        f"estimated cost: {cost.gpu_s / 3600:.3g} GPU-hours in all on {table.gpu['name']} (an estimate: "
        f"{hours(cost.gpu_s / len(cost.jobs))} per job on average, longest {'pack' if cost.packed else 'job'} "
        f"{hours(cost.longest_gpu_s)}); on CPUs instead: {hours(cost.cpu_s)} in all, each job on one thread "
        f"(measured rates)",
        f"  assumed: best epoch {table.assume['best_epoch_after_warmup']} epochs after warm-up, then trainer.patience "
        f"more; GPU rates: {table.gpu['basis']}; rates and how they were made: {table.path}",
    ]
    if cost.packed:
        lines.append(cost.packed.line(len(cost.jobs), cost.alone_gpu_s))
    return "\n".join(lines)


def composed_sweep(args: Sequence[str]) -> tuple[DictConfig, CostTable]:
    """A command line's multirun config and its cost table (inside Hydra's initialize_config_dir; also
    scripts/paper_costs.py, which makes docs/paper.md's bill)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    master = GlobalHydra.instance().hydra.compose_config("config", list(args), run_mode=RunMode.MULTIRUN)
    return master, CostTable(OmegaConf.select(master, "hydra.callbacks.sweep_cost.table", default=SweepCost().table))


def sweep_seconds(
    table: CostTable, configs: list[tuple[DictConfig, int, tuple[str, ...]]]
) -> tuple[float, float, float]:
    """(GPU seconds, CPU seconds, longest job's GPU seconds) of the sweep's runs, each run alone."""
    gpu = cpu = longest = 0.0
    for cfg, count, _ in configs:
        g, c = table.job_seconds(cfg, "gpu"), table.job_seconds(cfg, "cpu")
        gpu, cpu, longest = gpu + count * g, cpu + count * c, max(longest, g)
    return gpu, cpu, longest


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
    from hydra.errors import HydraException

    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("-m", "--multirun")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    from mdl.run.config_checks import retired_key_error

    for arg in args:
        if (why := retired_key_error(arg)) is not None:
            print(f"error: {arg}: {why}", file=sys.stderr, flush=True)
            raise SystemExit(2)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            print(cost_report(*composed_sweep(args)))
        except (ValueError, KeyError, HydraException) as err:  # a setting to change, not a bug: one message
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err  # launch.py's exit code for a setting to change
    print("(cost only: nothing was launched)")


if __name__ == "__main__":
    main()
