"""Store this environment's golden numbers of the embedded default run (tests/reference/default_runs.json).

    python scripts/make_reference.py            # add or replace the record of this environment
    python scripts/make_reference.py --readme   # ... and mark it as the README's (the lock's environment)
    python scripts/make_reference.py --out F    # write the reference with this record to F (a GPU lease: $OUT)

A run's last bits follow its environment (torch build, CPU kernels, threads: mdl/run/environment.py), so the
reference holds one record per environment it was made in. tests/test_one_engine.py compares a run bit for bit
with the record of its own environment and, where none exists, checks what holds everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REFERENCE = REPO / "tests" / "reference" / "default_runs.json"
MODES = {"stacked": "all", "sequential": "1"}  # the record's run name -> mdl.members_per_fit
KEYS = [
    "paper_mdl",
    "paper_mdl_last_block",
    "paper_mdl_val_min",
    "online_codelength_bits",
    "final_val_loss",
    "final_epochs",
    "final_test_bits_per_example",
    "val_loss_curve",
    "train_loss_curve",
    "blocks",
]


def overrides(mode: str) -> list[str]:
    """The embedded default with one thread (what `python launch.py` runs outside Slurm), in one fit mode."""
    return [f"mdl.members_per_fit={MODES[mode]}", "trainer.torch_threads=1"]


def matching_record(reference: dict, environment: dict) -> dict | None:
    """The record made in exactly this environment, if any."""
    from mdl.run.environment import environment_differences

    return next((r for r in reference["records"] if not environment_differences(r["environment"], environment)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="mark this record as the one README.md prints")
    parser.add_argument(
        "--out", type=Path, default=REFERENCE, help="where the reference with this record goes (default: the tests')"
    )
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    from erasure.files import atomic_write_bytes
    from mdl.results import git_sha
    from mdl.run.console import summary
    from mdl.run.experiment import quiet_lightning, run_experiment

    quiet_lightning()
    runs, environment = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
                cfg = compose("config", overrides=[*overrides(mode), f"paths.output_root={tmp}/{mode}", "~logger"])
            results = run_experiment(cfg, Path(tmp) / mode / "run")
            environment = results["environment"]
            printed = summary(results, Path("-")).splitlines()[
                :3
            ]  # the numbers launch.py prints (README.md shows them)
            runs[mode] = {"config_hash": results["config_hash"], "printed": printed, **{k: results[k] for k in KEYS}}
            print(f"{mode}: paper MDL {results['paper_mdl']!r}, online {results['online_codelength_bits']!r}")
    reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {"keys": KEYS, "records": []}
    record = {"made_by": f"{git_sha()}: python scripts/make_reference.py", "environment": environment, "runs": runs}
    old = matching_record(reference, environment)
    reference["records"] = [r for r in reference["records"] if r is not old]
    if args.readme:
        for r in reference["records"]:
            r.pop("readme", None)
        record["readme"] = True
    reference["records"].append(record)
    atomic_write_bytes(args.out, json.dumps(reference, indent=1).encode() + b"\n")
    print(f"{'replaced' if old else 'added'} the record of this environment in {args.out}")


if __name__ == "__main__":
    main()
