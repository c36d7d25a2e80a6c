"""The original code's MDL loop beside ``launch.py protocol=original`` on the project's digits pool (issue 45).

The original side runs EleutherAI/mdl's own files, unmodified: ``mdl/sweep.py@3034bc0`` (``Sweep``),
``mdl/probe.py@5e66bb9`` (``Probe.fit``), ``mdl/mlp_probe.py@5e66bb9`` (``MlpProbe``) and ``mdl/math.py@72865a4``,
driven as ``experiments/cli.py@0cc7065`` drives them (docs/paper.md, "The original code beside
``protocol=original``"). Make ``--original-dir`` (outside this repository) with::

    git clone https://github.com/EleutherAI/mdl && cd mdl && mkdir -p DIR/mdl
    git show 3034bc0:mdl/sweep.py > DIR/mdl/sweep.py
    git show 5e66bb9:mdl/probe.py > DIR/mdl/probe.py
    git show 5e66bb9:mdl/mlp_probe.py > DIR/mdl/mlp_probe.py
    git show 72865a4:mdl/math.py > DIR/mdl/math.py

It needs ``mup``, ``schedulefree`` and ``scipy`` (sweep.py imports it). The driver supplies only what cli.py would:
the arguments, a ``muon`` module (``mlp_probe.py`` imports ``Muon``; ``MlpProbe(muon=False)`` never calls it), a
stand-in for the W&B run (``.name``, ``.log``) and ``torch.manual_seed(seed)`` (cli.py seeds no global generator).
Its input is the pool ``launch.py`` builds for ``data_seed=seed`` (training and validation splits, erased by the
eraser launch.py fits), with ``val_frac`` giving the project's 300 validation examples. A fit is kept at the
untrained model when its pre-training validation loss stays the best (the loop's own comparison, ``val_loss <
best_loss``, never true after it); ours when results.json says ``best_after_epochs == 0``.

    python scripts/beside_original.py --original-dir DIR --settings paper --erasers leace,none --threads 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {  # name: (label, lr, b1): the paper's MLP; docs/paper.md's second setting
    "paper": ("the paper's MLP: lr 5e-4, b1 0.95", 5e-4, 0.95),
    "fast": ("lr 3e-3, b1 0.9", 3e-3, 0.9),
}
ORIGINAL_FILES = ("sweep.py", "probe.py", "mlp_probe.py", "math.py")
VAL_SIZE, NUM_CHUNKS = 300, 5  # the project's validation split; 5 blocks from 128 (docs/paper.md)


def project_overrides(lr: float, b1: float) -> list[str]:
    """The ``launch.py`` overrides of docs/paper.md's paragraph, less eraser and seed."""
    return [
        "protocol=original",
        "+model.init=original",
        "data_seed=${seed}",
        "data.first_block=128",
        f"mdl.num_blocks={NUM_CHUNKS}",
        f"optimizer.lr={lr}",
        f"optimizer.betas=[{b1},0.999]",
        "optimizer.warmup_steps=1000",
        "trainer.patience=100",
        "trainer.kwargs.max_epochs=30000",
    ]


@dataclass
class Side:
    """One side's runs of one setting and eraser: paper MDL per seed, and per fit whether it kept the untrained model."""

    mdl: list[float] = field(default_factory=list)
    untrained: list[bool] = field(default_factory=list)
    cpu_seconds: float = 0.0  # each side's processes, whole: imports, data, training (resource.RUSAGE_CHILDREN)


# --- the original side ------------------------------------------------------------------------------------------


def load_original(original_dir: Path) -> types.ModuleType:
    """The original's ``mdl`` package, imported as ``original_mdl`` (this project's own package is ``mdl``)."""
    folder = original_dir / "mdl"
    missing = [name for name in ORIGINAL_FILES if not (folder / name).is_file()]
    if missing:
        raise SystemExit(
            f"--original-dir {original_dir}: mdl/{', mdl/'.join(missing)} missing; see this script's docstring"
        )
    if "muon" not in sys.modules:  # imported by mlp_probe.py, used only by MlpProbe(muon=True)
        muon = types.ModuleType("muon")

        class Muon:  # noqa: D101
            def __init__(self, *args: object, **kwargs: object) -> None:
                raise RuntimeError("Muon is not available here: run the original with muon=False")

        muon.Muon = Muon
        sys.modules["muon"] = muon
    package = types.ModuleType("original_mdl")
    package.__path__ = [str(folder)]
    sys.modules["original_mdl"] = package
    importlib.import_module("original_mdl.mlp_probe")
    return importlib.import_module("original_mdl.sweep")


class StandInRun:
    """What ``Probe.fit`` uses of a W&B run: a name (checkpoint file names) and ``log``."""

    name = "beside"

    def log(self, data: dict) -> None:
        pass


def recording_probe(mlp_probe: type, record: list[bool]) -> type:
    """``MlpProbe`` whose ``fit`` notes whether the untrained model stayed best: ``fit`` returns the best validation
    loss after each epoch's comparison, the first the untrained model's; it changes only when an epoch is below it."""

    class RecordingMlpProbe(mlp_probe):
        def fit(self, *args: object, **kwargs: object) -> None:
            best = super().fit(*args, return_validation_losses=True, **kwargs)
            record.append(best[-1] == best[0])

    return RecordingMlpProbe


def run_original(sweep_module: types.ModuleType, x, y, seed: int, lr: float, b1: float, side: Side) -> None:
    """One seed of the original's sweep on the pool (x, y), as cli.py@0cc7065 builds and runs it."""
    import torch
    from mup import make_base_shapes

    mlp_probe = sys.modules["original_mdl.mlp_probe"].MlpProbe
    k, d = int(y.max()) + 1, x.shape[1]
    with tempfile.TemporaryDirectory() as work:
        cwd = os.getcwd()
        os.chdir(work)  # Probe.fit writes probe-ckpts/ into the working directory
        try:
            shapes = Path(work) / "mup.bsh"
            widths = [mlp_probe(num_classes=k, num_features=d, num_layers=2, hidden_size=128) for _ in range(2)]
            make_base_shapes(*widths, savefile=str(shapes))
            torch.manual_seed(seed)
            record: list[bool] = []
            sweep = sweep_module.Sweep(
                d,
                k,
                device="cpu",
                dtype=torch.float32,
                num_chunks=NUM_CHUNKS,
                logger=StandInRun(),
                probe_cls=recording_probe(mlp_probe, record),
                ckpt_every=10,
                val_frac=VAL_SIZE / len(x),
                probe_kwargs=dict(
                    num_layers=2,
                    hidden_size=128,
                    learning_rate=lr,
                    schedule_free=True,
                    betas=(b1, 0.999),
                    base_shapes_path=str(shapes),
                    activation="relu",
                ),
            )
            result = sweep.run(x, y, seed=seed, reduce_lr_on_plateau=False, max_epochs=30000, early_stop_epochs=100)
        finally:
            os.chdir(cwd)
    side.mdl.append(float(result.mdl))
    side.untrained.extend(record)


def original_process(
    original_dir: Path, pool: tuple, seed: int, lr: float, b1: float, threads: int, side: Side
) -> None:
    """One seed of the original in a process of its own (``--original-child``), as cli.py runs one: its CPU seconds
    from its start (Python, torch and the original's imports) to its result, beside launch.py's whole process."""
    import torch

    with tempfile.TemporaryDirectory() as work:
        pool_file = Path(work) / "pool.pt"
        torch.save(pool, pool_file)
        command = [sys.executable, __file__, "--original-dir", str(original_dir), "--threads", str(threads)]
        command += ["--original-child", str(pool_file), "--seeds", str(seed), "--settings", f"{lr},{b1}"]
        before = cpu_of_children()
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        side.cpu_seconds += cpu_of_children() - before
    child = json.loads(done.stdout.strip().splitlines()[-1])
    side.mdl.extend(child["mdl"])
    side.untrained.extend(child["untrained"])


def original_child(args: argparse.Namespace) -> None:
    """``--original-child POOL``: the original on the saved pool, one seed; prints its Side as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    lr, b1 = map(float, args.settings.split(","))
    side = Side()
    run_original(load_original(args.original_dir), *torch.load(args.original_child), int(args.seeds), lr, b1, side)
    print(json.dumps({"mdl": side.mdl, "untrained": side.untrained}))


def cpu_of_children() -> float:
    """User and system CPU seconds of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def project_pool(eraser: str, seed: int, lr: float, b1: float):
    """The training and validation splits ``launch.py`` builds for this seed, erased by its eraser (float32)."""
    import torch
    from hydra import compose, initialize_config_dir

    from mdl.run.components import make_datamodule

    overrides = [*project_overrides(lr, b1), f"eraser={eraser}", f"seed={seed}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    dm = make_datamodule(cfg, torch.device("cpu"))
    x = torch.cat([dm.train_set.x, dm.val_set.x]).flatten(1).float()
    return x, torch.cat([dm.train_set.y, dm.val_set.y]).long()


# --- the project's side -----------------------------------------------------------------------------------------


def run_project(eraser: str, seeds: list[int], lr: float, b1: float, threads: int, out: Path, side: Side) -> None:
    """``launch.py protocol=original`` with docs/paper.md's overrides, one process per seed as the original runs one
    (so each side's CPU seconds are those of a run: start-up, data, eraser, fits); its results.json files read."""
    for seed in seeds:
        root = out / f"seed{seed}"
        command = [
            sys.executable,
            str(ROOT / "launch.py"),
            *project_overrides(lr, b1),
            f"eraser={eraser}",
            f"seed={seed}",
            f"trainer.torch_threads={threads}",
            f"paths.output_root={root}",
        ]
        before = cpu_of_children()
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        side.cpu_seconds += cpu_of_children() - before
        found = sorted(root.glob("runs/*/*/results.json"))
        if not found:
            raise SystemExit(f"launch.py left no results.json for seed {seed} under {root}")
        record = json.loads(found[-1].read_text())
        side.mdl.append(record["paper_mdl"])
        side.untrained.extend(b["best_after_epochs"] == 0 for b in record["blocks"])


# --- statistics --------------------------------------------------------------------------------------------------


def welch_t(a: list[float], b: list[float]) -> float:
    """Welch's t of mean(b) - mean(a) (nan below two values a side)."""
    if min(len(a), len(b)) < 2:
        return math.nan
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return (statistics.mean(b) - statistics.mean(a)) / se if se > 0 else math.nan


def fisher_exact(a: int, n: int, c: int, m: int) -> float:
    """Two-sided Fisher exact p of a of n against c of m (tables at most as likely as the observed one)."""
    total, hits = n + m, a + c

    def prob(i: int) -> float:
        return math.comb(n, i) * math.comb(m, hits - i) / math.comb(total, hits)

    observed = prob(a)
    cells = range(max(0, hits - m), min(n, hits) + 1)
    return min(1.0, sum(p for p in map(prob, cells) if p <= observed * (1 + 1e-9)))


def row(setting: str, eraser: str, ours: Side, theirs: Side) -> str:
    def spread(values: list[float]) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else math.nan
        return f"{statistics.mean(values):.3f} ± {sd:.3f}"

    a, c = sum(theirs.untrained), sum(ours.untrained)
    p = fisher_exact(a, len(theirs.untrained), c, len(ours.untrained))
    gap = statistics.mean(ours.mdl) - statistics.mean(theirs.mdl)
    return (
        f"| {setting} | {eraser} | {spread(theirs.mdl)} | {spread(ours.mdl)} | {gap:+.3f} (t = "
        f"{welch_t(theirs.mdl, ours.mdl):.1f}) | {a} / {c} of {len(theirs.untrained)} / {len(ours.untrained)} "
        f"| {p:.3f} | {theirs.cpu_seconds:.1f} / {ours.cpu_seconds:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--original-dir", type=Path, required=True, help="holds mdl/{sweep,probe,mlp_probe,math}.py")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--erasers", default="none,leace")
    parser.add_argument("--settings", default="paper,fast", help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="launch.py's output root (default: a temporary one)")
    parser.add_argument("--original-child", type=Path, default=None, help=argparse.SUPPRESS)  # original_process's
    args = parser.parse_args()
    if args.original_child is not None:
        return original_child(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings {','.join(unknown)}: choose from {', '.join(SETTINGS)}")
    import torch

    torch.set_num_threads(args.threads)
    load_original(args.original_dir)  # its files are there
    out = args.out or Path(tempfile.mkdtemp(prefix="beside-"))
    lines = [
        "| settings | eraser | original code | launch.py protocol=original | difference (Welch t) "
        "| kept at the untrained model, original / ours | Fisher p | CPU seconds, original / launch.py (whole processes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting in args.settings.split(","):
        label, lr, b1 = SETTINGS[setting]
        for eraser in args.erasers.split(","):
            theirs, ours = Side(), Side()
            for seed in seeds:  # the two sides take turns, so a change in the machine's load falls on both
                pool = project_pool(eraser, seed, lr, b1)
                original_process(args.original_dir, pool, seed, lr, b1, args.threads, theirs)
                run_project(eraser, [seed], lr, b1, args.threads, out / f"{setting}-{eraser}", ours)
            lines.append(row(label, eraser, ours, theirs))
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
