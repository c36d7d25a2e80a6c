"""The GPU check of one lease: every CUDA path and the GPU-hours numbers, in two calls of at most 420 s each.

    bash scripts/gpu_check.sh                                   # call 1 on the device machine (the default steps)
    bash scripts/gpu_check.sh --steps versions,pytest,mlp1024   # call 2, right after (the machine is warm)
    python scripts/gpu_check.py --dry-run                       # on a CPU, toy sizes, in the test suite

A 15-minute lease holds a start (about a minute) and two such calls. Steps, in this order (each capped at 1.5x or
more of what an H200 took, all within --budget-s; a failure is recorded and the next step runs):
  versions   the software and GPU it ran with (mdl/run/environment.py)
  default    the default run on the device (paper MDL, seconds from launch to training), then this environment's
             record for tests/reference/default_runs.json (scripts/make_reference.py --out $OUT/default_runs.json)
  convnext   ConvNeXt width 64, 10 members: stacked + bf16 + compile against one member with bf16 + compile
             (benchmarks/bench_stacked_speed.py; goal >= 2.5x); the stack's compile time cold, then in a second
             process with the first one's inductor cache (a sweep's second job of the same shape)
  swin       the same for Swin V2 width 32 (models/swin_stacked.py)
  epochs     benchmarks/bench_epoch_times.py --device cuda: ConvNeXt's and Swin's rows at App. C's sizes and the
             paper presets' setting (fp32_high), one member and a stack, for conf/cost/epoch_times.yaml `gpu`
             (bf16_compile's rows compile per point: a call of their own, `--steps epochs` after editing LEASE)
  pack       a packed sweep of 4 runs against the same 4 runs alone: every number equal, bit for bit
Second call (--steps versions,pytest,mlp1024):
  pytest     `pytest -m gpu`, a per-test cap, counted per outcome (also when cut short)
  mlp1024    a CIFAR-shaped run (synthetic 3x32x32) of the MLP width 1024, every member in one fit and one member per
             fit: examples per second from the runs' own training time (their logs) beside process wall (the first
             run builds the data's cache); and the framework's step of 10 members against one
Writes $OUT/gpu_check.json and $OUT/gpu_check.md (OUT defaults to ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUMBERS = ("paper_mdl", "online_codelength_bits", "final_val_loss", "blocks", "val_loss_curve")


@dataclass(frozen=True)
class Sizes:
    """What each step runs: the lease's sizes, or toy ones for a CPU dry run."""

    device: str
    caps_s: dict[str, float]
    default: list[str]
    cifar: list[str]
    mlp_width: int
    mlp_step: list[str]
    convnext: list[str]
    swin: list[str]
    epochs: list[str]
    pack: list[str]


LEASE = Sizes(
    device="cuda",
    # measured on an H200 (2026-11-28, ../shared/gpu/h200-2026-11-28): default 21.3 s; mlp1024 83 s; a packed launch
    # of 4 runs past 40 s (start-up and diagnostics); ConvNeXt x10 bf16+compile 130 s of compiling the whole stack
    # (now its blocks: models/convnext_stacked.py compile_blocks); 11 gpu tests in 195 s, one compiled test taking the
    # rest. Each cap is at least 1.5x a measured time; the steps share --budget-s, pytest (last) gets what is left.
    caps_s={"default": 60, "convnext": 95, "swin": 70, "epochs": 65, "pytest": 400, "mlp1024": 130, "pack": 120},
    default=[],
    cifar=[
        "data.options.shape=[3,32,32]",
        "data.options.n_train=50000",
        "data.options.n_test=10000",
        "data.val_size=2048",
        "data.first_block=1024",
        "trainer.kwargs.max_epochs=2",
        "trainer.patience=2",
        "data.diagnostics=false",
    ],
    mlp_width=1024,
    mlp_step=["--width", "1024", "--members", "10", "--settings", "fp32_high,bf16", "--steps", "20"],
    convnext=["--width", "64", "--members", "10", "--settings", "bf16_compile", "--steps", "10"],
    swin=["--width", "32", "--members", "10", "--settings", "bf16_compile", "--steps", "10"],
    # ConvNeXt width 40 depth 2 and Swin width 32 depth 2 on CIFAR-10's shape (POINTS 9 and 12): the App. C sizes
    # bf16_compile's rows compile a model per point, past the step's cap on an H200 (2026-11-28): their own call
    epochs=["--points", "9,12", "--settings", "fp32_high", "--budget-s", "45"],
    pack=[
        "debug=fast",
        "width=1024",
        "model.base_width=128",
        "data=synthetic",
        "data.options.shape=[3,32,32]",
        "data.options.num_classes=10",
        "data.options.n_train=2000",  # 8000 took 58 s to its sweep line on an H200 (2026-11-28), past the cap
        "data.first_block=256",
        "data.diagnostics=false",
        "report=none",  # the sweep's report after its last job: not what this step compares
    ],
)
_TOY_STEP = ["--members", "2", "--settings", "fp32", "--steps", "2", "--batch", "8", "--base-width", "8"]
DRY_RUN = Sizes(
    device="cpu",
    caps_s={name: 300 for name in LEASE.caps_s},  # a loaded CI
    default=["debug=fast"],
    cifar=[
        "data.options.shape=[3,8,8]",
        "data.options.n_train=600",
        "data.options.n_test=100",
        "data.val_size=100",
        "data.first_block=64",
        "mdl.num_blocks=3",
        "trainer.kwargs.max_epochs=1",
        "trainer.patience=1",
        "trainer.torch_threads=1",
        "data.diagnostics=false",
    ],
    mlp_width=32,
    mlp_step=["--width", "32", *_TOY_STEP],
    convnext=["--width", "8", *_TOY_STEP],
    swin=["--width", "16", *_TOY_STEP[:-1], "16"],  # Swin's width: a multiple of its head dimension, 16
    epochs=["--points", "0", "--members", "2", "--budget-s", "10"],
    pack=["debug=fast", "trainer.torch_threads=1"],
)
CIFAR_SHAPED = ["data=synthetic", "data.options.num_classes=10", "eraser=none", "model=mlp"]  # shape: Sizes.cifar


@dataclass
class Step:
    name: str
    ok: bool = False
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    error: str | None = None
    tail: str = ""


class Check:
    """Runs the steps in order, printing as it goes, recording each step's outcome without stopping at a failure."""

    def __init__(self, sizes: Sizes, work: Path, out: Path, budget_s: float) -> None:
        self.sizes, self.work, self.out = sizes, work, out
        self.deadline = time.monotonic() + budget_s
        self.steps: list[Step] = []
        self.last_output = ""  # the last command's whole output, also when it failed or was cut short
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "SLOWING_CACHE_DIR": str(work / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "compiled"),  # fresh: the first compile of a lease is cold
            "WANDB_MODE": "offline",
        }

    def cap(self, name: str) -> float:
        """A step's own cap, or what is left of the whole check's budget if that is less."""
        return max(1.0, min(self.sizes.caps_s[name], self.deadline - time.monotonic()))

    def run(self, step: Step, args: list[str], cap_s: float) -> str:
        """One command, its output streamed with the step's name; returns the output, raises on failure or time-out."""
        if time.monotonic() >= self.deadline:
            raise TimeoutError("the check's --budget-s was spent before this command")
        cap_s = min(cap_s, self.deadline - time.monotonic())
        step.commands.append(" ".join(args))
        print(f"[{step.name}] $ {' '.join(args)}", flush=True)
        proc = subprocess.Popen(
            args, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: list[str] = []
        deadline = time.monotonic() + cap_s
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            line = proc.stdout.readline()
            if line:
                lines.append(line)
                print(f"[{step.name}] {line}", end="", flush=True)
                continue
            if proc.poll() is not None:
                lines.extend(proc.stdout.readlines())
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                self.last_output, step.tail = "".join(lines), "".join(lines[-40:])
                raise TimeoutError(f"{args[1] if len(args) > 1 else args[0]} ran past its cap of {cap_s:.0f} s")
            time.sleep(0.05)
        output = self.last_output = "".join(lines)
        step.tail = "".join(lines[-40:])
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {lines[-1].strip() if lines else ''}")
        return output

    def launch(
        self, step: Step, overrides: list[str], root: Path, cap_s: float, multirun: bool = False
    ) -> list[dict[str, Any]]:
        """launch.py with these overrides under ``root``; the results.json of every run it made, in job order."""
        device = [f"device={self.sizes.device}", "print_config=false", f"paths.output_root={root}"]
        self.run(step, [sys.executable, "launch.py", *(["-m"] if multirun else []), *device, *overrides], cap_s)
        files = sorted((root / ("multirun" if multirun else "runs")).rglob("results.json"), key=_job_order)
        return [json.loads(f.read_text()) for f in files]

    def step(self, name: str, body: Callable[[Step], None]) -> None:
        step = Step(name)
        start = time.monotonic()
        try:
            body(step)
            step.ok = True
        except Exception as err:  # noqa: BLE001 - recorded; the next step runs
            step.error = f"{type(err).__name__}: {err}"
        step.seconds = time.monotonic() - start
        verdict = "ok" if step.ok else f"FAILED ({step.error})"
        print(f"[{name}] {verdict} in {step.seconds:.1f} s; {json.dumps(step.metrics, default=str)}", flush=True)
        self.steps.append(step)
        self.write()

    # --- the steps -----------------------------------------------------------------------------------------

    def versions(self, step: Step) -> None:
        from importlib import metadata

        import torch

        from mdl.run.environment import current_environment

        step.metrics = current_environment(self.sizes.device)
        for name in ("lightning", "timm", "hydra-core", "omegaconf", "schedulefree", "mup", "torchvision", "wandb"):
            try:
                step.metrics[name] = metadata.version(name)
            except metadata.PackageNotFoundError:  # a missing package is what this step reports
                step.metrics[name] = "missing"
        if self.sizes.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")

    def pytest(self, step: Step) -> None:
        per_test = ["--timeout=150"] if _has_module("pytest_timeout") else []  # compiled ConvNeXt tests: ~70 s
        args = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfE", *per_test]
        try:
            self.run(step, args, self.cap("pytest"))
        finally:  # failing or cut short: the per-test lines still say what passed
            step.metrics = pytest_tally(self.last_output)

    def default(self, step: Step) -> None:
        """The default run as a user starts it (seconds from launch to its training), then the reference record of
        this environment (scripts/make_reference.py: both fit modes) for tests/reference/default_runs.json."""
        start = time.time()
        (result,) = self.launch(step, self.sizes.default, self.work / "default", self.cap("default") / 2)
        seconds = time.time() - start
        (log,) = (self.work / "default" / "runs").rglob("launch.log")
        step.metrics = {
            "paper_mdl": result["paper_mdl"],
            "final_val_loss": result["final_val_loss"],
            "seconds": round(seconds, 1),
            "seconds_to_training": round(training_start(log.read_text()) - start, 1),
            "device": result["device"],
        }
        reference = self.out / "default_runs.json"
        self.run(step, [sys.executable, "scripts/make_reference.py", "--out", str(reference)], self.cap("default"))
        step.metrics["reference_record"] = reference.name

    def mlp1024(self, step: Step) -> None:
        path = self.work / "mlp_step.json"
        self.run(
            step,
            [
                sys.executable,
                "benchmarks/bench_stacked_speed.py",
                "--model",
                "mlp",
                "--device",
                self.sizes.device,
                "--json",
                str(path),
                *self.sizes.mlp_step,
            ],
            self.cap("mlp1024") / 3,
        )
        step.metrics["step"] = {k: round(v["ratio"], 2) for k, v in json.loads(path.read_text())["settings"].items()}
        cap = self.cap("mlp1024") / 2
        common = [*CIFAR_SHAPED, f"width={self.sizes.mlp_width}", *self.sizes.cifar]
        rates, train_rates = {}, {}
        for mode in ("1", "all"):  # the first builds the synthetic data's cache: compare the training times
            start = time.monotonic()
            root = self.work / f"mlp_{mode}"
            (result,) = self.launch(step, [*common, f"mdl.members_per_fit={mode}"], root, cap)
            seconds = time.monotonic() - start
            (log,) = (root / "runs").rglob("launch.log")
            training = training_seconds(log.read_text())
            rates[mode], train_rates[mode] = trained_examples(result) / seconds, trained_examples(result) / training
            step.metrics[f"members_per_fit={mode}"] = {
                "examples_per_s_training": round(train_rates[mode]),
                "training_s": round(training, 1),
                "process_s": round(seconds, 1),
                "examples": trained_examples(result),
            }
        step.metrics["ratio_all_over_1"] = {
            "training": round(train_rates["all"] / train_rates["1"], 2),
            "process_wall": round(rates["all"] / rates["1"], 2),
        }

    def stacked_speed(self, step: Step, model: str, args: list[str], cap_s: float, name: str) -> dict[str, Any]:
        """benchmarks/bench_stacked_speed.py for ``model``: its JSON record."""
        path = self.work / f"{name}.json"
        bench = [sys.executable, "benchmarks/bench_stacked_speed.py", "--model", model, "--device", self.sizes.device]
        self.run(step, [*bench, "--json", str(path), *args], cap_s)
        return json.loads(path.read_text())

    def stacked_with_compile_cache(self, step: Step, model: str, args: list[str]) -> None:
        """One member against the stack (bf16 + compile), then the stack alone again in a new process that finds the
        first one's inductor cache, as a sweep's second job of the same shape does (paths.compile_cache_dir)."""
        cap = self.cap(step.name)
        start = time.monotonic()
        cold = self.stacked_speed(step, model, args, cap * 0.75, f"{model}_cold")
        warm = self.stacked_speed(step, model, [*args, "--sides", "stack"], cap - (time.monotonic() - start), model)
        step.metrics = {
            "settings": {k: {n: _round(v) for n, v in row.items()} for k, row in cold["settings"].items()},
            "stack_compile_s": {
                setting: {
                    "first_job": _round(row["warmup_s"][1]),
                    "second_job": _round(warm["settings"][setting]["warmup_s"][1]),
                }
                for setting, row in cold["settings"].items()
            },
        }

    def convnext(self, step: Step) -> None:
        self.stacked_with_compile_cache(step, "convnext", self.sizes.convnext)

    def swin(self, step: Step) -> None:
        self.stacked_with_compile_cache(step, "swin", self.sizes.swin)

    def epochs(self, step: Step) -> None:
        output = self.run(
            step,
            [sys.executable, "benchmarks/bench_epoch_times.py", "--device", self.sizes.device, *self.sizes.epochs],
            self.cap("epochs"),
        )
        rows = [
            line
            for line in output.splitlines()
            if line.strip().startswith(("- {", "batch:", "eval_batch:", "points:", "#"))
        ]
        step.metrics = {"rows": len([r for r in rows if r.strip().startswith("- {")])}
        (self.out / "epoch_times_rows.yaml").write_text("\n".join(rows) + "\n")

    def pack(self, step: Step) -> None:
        cap = self.cap("pack") / 2
        sweep = [*self.sizes.pack, "eraser=none,leace", "seed=0,1"]
        packed = self.launch(step, ["hydra/launcher=packed", *sweep], self.work / "packed", cap, multirun=True)
        alone = self.launch(step, sweep, self.work / "alone", cap, multirun=True)
        by_hash = {r["config_hash"]: r for r in alone}
        if len(packed) != 4 or len(by_hash) != 4:
            raise RuntimeError(f"expected 4 runs each way, got {len(packed)} packed and {len(by_hash)} alone")
        differing = [
            f"{r['config']['eraser']['name']} seed {r['config']['seed']}: {key}"
            for r in packed
            for key in NUMBERS
            if r[key] != by_hash[r["config_hash"]][key]
        ]
        step.metrics = {
            "runs": len(packed),
            "equal_to_the_bit": not differing,
            "differing": differing,
            "paper_mdl": {f"{r['config']['eraser']['name']}/{r['config']['seed']}": r["paper_mdl"] for r in packed},
        }
        if differing:
            raise AssertionError(f"{len(differing)} numbers differ between packed and alone: {differing[:4]}")

    # --- the record ----------------------------------------------------------------------------------------

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"device": self.sizes.device, "steps": [vars(s) for s in self.steps]}
        (self.out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
        lines = ["# GPU check", "", "| step | ok | seconds | numbers |", "|---|---|---|---|"]
        for s in self.steps:
            numbers = json.dumps(s.metrics, default=str)
            lines.append(
                f"| {s.name} | {'yes' if s.ok else 'NO: ' + (s.error or '')} | {s.seconds:.1f} | {numbers[:600]} |"
            )
        for s in self.steps:
            if not s.ok:
                lines += ["", f"## {s.name}: the last lines", "", "```", s.tail.rstrip(), "```"]
        (self.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _log_times(log: str) -> list[tuple[float, str, str]]:
    """(epoch seconds, logger, first word of the message) of each line of a run's launch.log."""
    lines = re.findall(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)\]\[([\w.]+)\]\[\w+\] - (\S+)", log, flags=re.M)
    return [
        (time.mktime(time.strptime(t, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000, who, word) for t, ms, who, word in lines
    ]


def training_start(log: str) -> float:
    """When a run started training: its "run <key> (fits: ...)" line, after the data and the eraser."""
    return next(t for t, who, word in _log_times(log) if who == "mdl.run.experiment" and word == "run")


def training_seconds(log: str) -> float:
    """Seconds from a run's start of training to its last ledger line (timestamps of its launch.log): training
    alone, whatever start-up and data preparation took."""
    return [t for t, who, _ in _log_times(log) if who == "mdl.engine.ledger"][-1] - training_start(log)


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def trained_examples(result: dict[str, Any]) -> int:
    """Examples every member of the run trained on: each block's prefix times its epochs, and the final fit."""
    blocks = sum(b["n_train"] * b["epochs"] for b in result["blocks"])
    return blocks + result["boundaries"][-1] * result.get("final_epochs", 0)


def _job_order(path: Path) -> tuple[int, str]:
    """Multirun job folders start with the job's number; a single run's folder sorts by time."""
    match = re.match(r"(\d+)", path.parent.name)
    return (int(match.group(1)) if match else math.inf, str(path))  # type: ignore[return-value]


def pytest_tally(output: str) -> dict[str, Any]:
    """pytest -v's outcome per test, counted, with the failing tests named and its summary line if it got there."""
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", output, flags=re.M)
    counts = {o.lower(): sum(1 for _, seen in outcomes if seen == o) for o in {o for _, o in outcomes}}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)]
    return {
        **counts,
        "not_passed": [t for t, o in outcomes if o in ("FAILED", "ERROR")],
        "summary": summary[-1].strip("= ") if summary else "no summary line (cut short)",
    }


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


STEPS = ("versions", "default", "convnext", "swin", "epochs", "pack", "pytest", "mlp1024")
FIRST_CALL = ("versions", "default", "convnext", "swin", "epochs", "pack")  # the default --steps: the GPU-hours numbers
SECOND_CALL = ("versions", "pytest", "mlp1024")  # --steps of the call right after: the GPU tests, then the MLP's rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU at toy sizes (the test suite runs this)")
    parser.add_argument(
        "--steps",
        default=None,
        help=f"comma list of {', '.join(STEPS)} (default: {','.join(FIRST_CALL)}; with --dry-run every step)",
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "gpu_check_out"), help="where the record goes (default $OUT)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420, help="the call's seconds: two calls and a start fit a 15-minute lease"
    )
    parser.add_argument("--work", default=None, help="scratch folder for runs (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = ",".join(STEPS if args.dry_run else FIRST_CALL)
    unknown = sorted(set(args.steps.split(",")) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    out = Path(args.out).resolve()
    work = (
        Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    )  # no earlier run reused
    work.mkdir(parents=True, exist_ok=True)
    check = Check(DRY_RUN if args.dry_run else LEASE, work, out, args.budget_s if not args.dry_run else 1800)
    start = time.monotonic()
    for name in args.steps.split(","):
        check.step(name, getattr(check, name))
    failed = [s.name for s in check.steps if not s.ok]
    print(
        f"gpu check: {len(check.steps) - len(failed)} of {len(check.steps)} steps ok in {time.monotonic() - start:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + f"; record in {out}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
