"""The cost of a packed sweep (``hydra/launcher=packed`` or ``packed_slurm``): its runs grouped into packs as the
launchers group them by ``mdl.run.pack.pack_key``, each pack one job: its members' steps at a stack's rate where
one is measured (mdl.sweeps.rates), plus the pack's own overheads (one job, compilation once, its fits); a run that
cannot be packed is a job of its own. Runs of one key whose data exceed ``mdl.pack_data_gb`` are counted as one pack
here; the launchers make several of them (mdl.run.pack.plan_packs), each with its own overheads. Printed by
mdl.sweeps.cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from mdl.run.sweep_jobs import SEED_KEYS, without_keys

Configs = list[tuple[DictConfig, int, tuple[str, ...]]]  # cost.job_configs: (config, runs it stands for, overrides)


@dataclass
class PackedCost:
    gpu_s: float
    cpu_s: float
    longest_gpu_s: float  # the longest pack (a job of its own): what a packed_slurm time limit must allow
    packs: int
    lone: int  # runs that cannot be packed
    stacked_rates: bool  # whether every pack's members were priced at a measured rate of a stack

    def line(self, jobs: int, alone_gpu_s: float) -> str:
        from mdl.run.pack import packs_line

        rate = (
            "members' steps at the measured rate of a stack"
            if self.stacked_rates
            else "members' steps at one member's rate (no measured GPU rate of a stack for these models: an assumption)"
        )
        return (
            f"  packed: {packs_line(jobs, self.packs + self.lone)}, each pack one job with one job overhead, {rate}; "
            f"job by job: {alone_gpu_s / 3600:.3g} GPU-hours"
        )


def pack_groups(master: DictConfig, jobs: list[list[str]], configs: Configs) -> dict[tuple, list[tuple[str, ...]]]:
    """Pack -> its runs (each named by its overrides without seeds and bookkeeping keys, ``configs``' key), as the
    packed launchers group the jobs; a run that cannot be packed is a pack ``("run", ...)`` of its own. Jobs that
    differ only in bookkeeping keys are one run. Two kinds of run have a key that needs each job's own resolved data
    seed, so their jobs are composed one by one: preconditioned runs (they pack over seeds only; the paper presets
    set ``data_seed: ${seed}``) and ``data.balance=suby`` runs (their split's size follows the data seed)."""
    from hydra.core.global_hydra import GlobalHydra

    from datamodules.splits import size_follows_data_seed
    from mdl.run.identity import is_bookkeeping
    from mdl.run.pack import pack_key

    keys = {
        key: (
            pack_key(cfg),
            cfg.optimizer.get("precondition") is not None or size_follows_data_seed(cfg.data.get("balance")),
        )
        for cfg, _, key in configs
    }
    loader = GlobalHydra.instance().config_loader()
    groups: dict[tuple, list[tuple[str, ...]]] = {}
    for run in dict.fromkeys(tuple(o for o in job if not is_bookkeeping(o.split("=", 1)[0])) for job in jobs):
        config_key = without_keys(run, SEED_KEYS)
        key, keyed_by_data_seed = keys[config_key]
        if key is None:
            pack: tuple = ("run", run)
        elif keyed_by_data_seed:
            pack = ("pack", pack_key(loader.load_sweep_config(master, list(run))))
        else:
            pack = ("pack", key)
        groups.setdefault(pack, []).append(config_key)
    return groups


def packed_sweep_cost(table: Any, master: DictConfig, jobs: list[list[str]], configs: Configs) -> PackedCost:
    """``table``: the sweep's mdl.sweeps.cost.CostTable (which imports this module)."""
    by_key = {key: cfg for cfg, _, key in configs}
    cost = PackedCost(0.0, 0.0, 0.0, 0, 0, True)
    for pack, runs in pack_groups(master, jobs, configs).items():
        first = by_key[runs[0]]
        if pack[0] == "run":
            gpu, cpu = table.job_seconds(first, "gpu"), table.job_seconds(first, "cpu")
            cost.lone += 1
        else:
            gpu, cpu = table.pack_overhead(first, "gpu", len(runs)), table.pack_overhead(first, "cpu", len(runs))
            for key in runs:
                seconds, measured = table.job_estimate(by_key[key], "gpu", packed=True)
                gpu += seconds
                cpu += table.job_seconds(by_key[key], "cpu", packed=True)
                cost.stacked_rates = cost.stacked_rates and measured
            cost.packs += 1
        cost.gpu_s, cost.cpu_s, cost.longest_gpu_s = cost.gpu_s + gpu, cost.cpu_s + cpu, max(cost.longest_gpu_s, gpu)
    return cost
