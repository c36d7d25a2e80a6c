"""The one entry point: python launch.py [overrides], or python launch.py -m for sweeps."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from mdl.experiment import quiet_lightning, run_experiment, summary  # after Hydra parsed the command line
    from mdl.results import RESULTS_FILE

    quiet_lightning()

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    results = run_experiment(cfg, run_dir, overrides=list(hc.overrides.task))
    print(summary(results, run_dir / RESULTS_FILE), flush=True)
    return results["paper_mdl"]


if __name__ == "__main__":
    main()
