"""``hydra/launcher=packed_slurm``: the packed launcher's packs (hydra_plugins.mdl_packed.packed_launcher)
submitted through hydra-submitit-launcher's Slurm launcher, one array task per pack.

    python launch.py -m +experiment=paper/appendix_c hydra/launcher=packed_slurm

The jobs are composed here and grouped into packs by ``mdl.run.pack.plan_packs``; each pack is one task of one sbatch
array, with the resources of ``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml: the same keys and
environment variables). On its node a task makes its jobs' folders and .hydra/ files, checks them and
trains them as one fit; each job keeps its own results.json, store entry and loggers. A preempted or
timed-out task is requeued by submitit (``checkpoint``) and resumes every run in its pack from the pack's
checkpoint; finished runs are skipped. A task's errors end it as launch.py ends a run (mdl.run.exits): exit 2
for a setting or file to change, 143 after a SIGTERM (with the pack checkpointed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from hydra_plugins.mdl_packed.packed_launcher import check_jobs, train_checked
from mdl.engine.preemption import sigterm_guard
from mdl.run.exits import ends_like_a_run

log = logging.getLogger(__name__)


class PackedSlurmLauncher(SlurmLauncher):
    """Hydra's submitit Slurm launcher, one array task per pack instead of one per job."""

    def __call__(self, jobs: list[tuple[list[str], int]], singleton_state: dict[type, Singleton]) -> list[JobReturn]:  # type: ignore[override]
        """One array task: the pack's jobs (overrides, job number) checked, then trained as one fit."""
        import submitit

        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        job_id = submitit.JobEnvironment().job_id
        with ends_like_a_run(), sigterm_guard():  # as the packed launcher's sweep: one code path for both
            checked = check_jobs(self.hydra_context, self.config, [(overrides, idx, job_id) for overrides, idx in jobs])
            ok = [i for i, ret in enumerate(checked) if ret.status == JobStatus.COMPLETED]
            done = list(checked)
            if ok:
                for i, ret in zip(ok, train_checked([checked[i] for i in ok])):
                    done[i] = ret
        return done

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Hydra's entry: compose every job here only to group them into packs, then submit one array task per
        pack (``__call__`` checks and trains it on its node) and collect each job's return in the sweep's order."""
        from mdl.run.pack import packs_line, plan_packs

        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        cfgs = []
        for i, overrides in enumerate(job_overrides):  # composed as on the node, to group them
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.num = initial_job_idx + i
            HydraConfig.instance().set_config(cfg)
            job = OmegaConf.to_container(cfg, resolve=False)
            del job["hydra"]  # resolved while its job's Hydra config is set (values may interpolate it)
            cfgs.append(OmegaConf.create(OmegaConf.to_container(OmegaConf.create(job), resolve=True)))
        packs = plan_packs(cfgs)
        log.info(
            "packed Slurm launcher: %s, one array task each; sweep output dir: %s",
            packs_line(len(job_overrides), len(packs)),
            self.config.hydra.sweep.dir,
        )
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        tasks = [[(list(job_overrides[i]), initial_job_idx + i) for i in pack] for pack in packs]
        submitted = self._executor().map_array(self, tasks, [Singleton.get_state()] * len(tasks))
        done: list[Any] = [None] * len(job_overrides)
        for pack, job in zip(packs, submitted):
            for i, ret in zip(pack, job.results()[0]):
                done[i] = ret
        return done

    def _executor(self) -> Any:
        """submitit's Slurm executor with this launcher's parameters, as the plugin's ``launch`` makes it."""
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(
            folder=params.pop("submitit_folder"), cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout")
        )
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
        return executor
