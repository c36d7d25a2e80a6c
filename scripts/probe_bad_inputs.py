"""Run every known bad input and fault through `python launch.py` (or another entry point) and class how it ends.

Each case is a real subprocess in a temporary output, cache and data folder, with the fast
settings of tests/conftest.py. A bad input must end in one paragraph: exit code 2, `error: ...`
on stderr naming the setting or the file, and no traceback. Inputs that a run survives (a probe
that cannot be fitted, an eraser that did not erase) must exit 0 with a warning that says so.
Each case is printed with its class: ok (as it should), raw (a traceback or another exit code),
silent (exit 0 where the input should have been refused), unclear (refused, but the message does
not name the setting and the fix), hang (still running after the time limit); then the counts.
A preemption case sends SIGTERM once a file appears (or after some seconds): it must exit 143 with
the `preempted:` line, no traceback, within Slurm's usual grace (PREEMPT_GRACE_S) of the signal.

    python scripts/probe_bad_inputs.py            # all cases, two at a time
    python scripts/probe_bad_inputs.py -k cifar   # the cases whose name contains "cifar"

Exits 1 when any case ends otherwise, printing what it got.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FAST = ["debug=fast"]  # conf/debug/fast.yaml: a smoke of any config in seconds
ERROR_EXIT = 2
PREEMPTED_EXIT = 128 + signal.SIGTERM  # mdl/engine/preemption.py EXIT_CODE
PREEMPT_GRACE_S = 30  # Slurm's KillWait is often 30 s: a SIGTERM must be honoured within it
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --- CIFAR-10 files in the real format, damaged on purpose ----------------------------------


def write_cifar10(root: Path, per_batch: int = 40, n_test: int = 40, seed: int = 0) -> Path:
    """data_batch_1..5, test_batch and batches.meta as in cifar-10-python.tar.gz; returns the folder."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [(f"data_batch_{b}", per_batch) for b in range(1, 6)] + [("test_batch", n_test)]
    for name, n in names:
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(n)],
        }
        write_pickle(folder / name, entry)
    write_pickle(
        folder / "batches.meta", {"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}
    )
    return folder


def write_pickle(path: Path, payload: object) -> None:
    with open(path, "wb") as f:
        pickle.dump(payload, f)


def read_pickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


def truncate(path: Path) -> None:
    """Keep the first half of a file, as an interrupted copy would."""
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def reshape_batch(path: Path) -> None:
    """Rows of 1024 pixels (a greyscale re-pack) instead of 3072."""
    entry = read_pickle(path)
    n = len(entry["labels"])
    entry["data"] = np.zeros((n, 1024), dtype=np.uint8)
    write_pickle(path, entry)


def bad_label(path: Path, label: int = 10) -> None:
    """One label outside 0..9 (in the test batch it would never meet an eraser's checks)."""
    entry = read_pickle(path)
    entry["labels"][0] = label
    write_pickle(path, entry)


def directory_instead_of_file(path: Path) -> None:
    path.unlink()
    path.mkdir()


# --- the cases -------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    overrides: list[str]
    must_name: list[str]  # substrings of the message (the setting or the file, and the fix)
    expect_error: bool = True
    prepare: Callable[[Path], list[str]] | None = None  # builds files in the case's folder, returns more overrides
    extra: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=lambda: ["launch.py"])  # or ["-m", "mdl.sweeps.cost"], ...
    env: dict[str, str] = field(default_factory=dict)
    fast: bool = True  # prepend the fast settings (tests/conftest.py FAST)
    # SIGTERM once a file matching this glob (under the case folder) exists, "after:S" seconds, or "log:TEXT" once a
    # log file under the case folder holds TEXT
    terminate_at: str | None = None
    signal_group: bool = True  # SIGTERM to the process group (as Slurm signals a job), or to the launched process alone
    exit_code: int | None = (
        None  # the exit status expected instead of the class's (rehash_store.py: 1 when runs are left)
    )


def cifar(damage: Callable[[Path], None] | None) -> Callable[[Path], list[str]]:
    """A small CIFAR-10 copy under the case folder, damaged by ``damage(folder)``."""

    def prepare(tmp: Path) -> list[str]:
        folder = write_cifar10(tmp / "data")
        if damage is not None:
            damage(folder)
        return [
            "data=cifar10",
            f"paths.data_root={tmp / 'data'}",
            "data.options.verify_checksums=false",
            "data.val_size=20",
            "data.first_block=40",
            "data.augment=false",
        ]

    return prepare


def read_only_cache(tmp: Path) -> list[str]:
    """A cache folder that cannot be created (a file is in the way: root ignores chmod)."""
    (tmp / "not-a-folder").write_text("")
    return [f"data.cache_dir={tmp / 'not-a-folder' / 'erased'}"]


def write_checked(path: Path, record: dict) -> None:
    """A results.json as runs write it (with its checksum: the report leaves out records without one)."""
    sys.path.insert(0, str(REPO))
    from mdl.results import write_checked_json

    write_checked_json(path, record)


def one_result(tmp: Path) -> list[str]:
    """A sweep folder holding one results.json (what the report reads, checksummed as runs write it) and a file where
    --out should go."""
    (tmp / "0_seed=0").mkdir()
    write_checked(tmp / "0_seed=0" / "results.json", {"config": {"seed": 0}, "paper_mdl": 1.0})
    return a_file(tmp)


def a_file(tmp: Path) -> list[str]:
    """A regular file where a folder is expected ({tmp}/a-file)."""
    (tmp / "a-file").write_text("")
    return []


def damaged_multirun(tmp: Path) -> list[str]:
    """A sweep folder whose multirun.yaml (Hydra's record of the sweep, read by the report) is cut short."""
    one_result(tmp)
    (tmp / "multirun.yaml").write_text("hydra:\n  run: {dir: [")
    return []


def hand_edited_result(tmp: Path) -> list[str]:
    """A sweep folder of two checked results.json (as runs write them), one with its paper MDL edited by hand."""
    for seed in (0, 1):
        (tmp / f"{seed}_seed={seed}").mkdir()
        record = {"config": {"seed": seed, "model": {"name": "mlp"}, "eraser": {"name": "none"}}, "paper_mdl": 4.39}
        write_checked(tmp / f"{seed}_seed={seed}" / "results.json", record)
    edited = tmp / "1_seed=1" / "results.json"
    edited.write_text(edited.read_text().replace('"paper_mdl": 4.39', '"paper_mdl": 94.39'))
    return []


def fragment_store_record(tmp: Path) -> list[str]:
    """A store entry whose config.json holds a fragment of a config (a damaged or hand-written record)."""
    entry = tmp / "outputs" / "store" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{"config": {"callbacks": {}, "probes": {"enabled": false}}}')
    return [str(tmp / "outputs" / "store")]


def truncated_run_config(tmp: Path) -> list[str]:
    """A store entry whose config.json (the record of a started run) was cut short by a full disk."""
    entry = tmp / "outputs" / "store" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{"config": {"seed": 0, "wid')
    return []


PACKED = ["-m", "hydra/launcher=packed", "seed=0,1"]
# Long enough to be interrupted (tests/test_preemption.py LONG_RUN), checkpointing every epoch.
LONG = ["trainer.kwargs.max_epochs=300", "trainer.patience=300", "mdl.checkpoint_every_s=0", "mdl.num_blocks=3"]
PACK_CHECKPOINT = "outputs/store/packs/*/checkpoints/*.ckpt"
# A synthetic data set of CIFAR-10's size and shape (50000 + 10000 images of 3x32x32, 10 classes).
CIFAR_SIZED = [
    "data=synthetic",
    "data.options.shape=[3,32,32]",
    "data.options.n_train=50000",
    "data.options.n_test=10000",
    "data.options.num_classes=10",
    "data.val_size=5000",
]

CASES = [
    Case("val_size=0", ["data.val_size=0"], ["data.val_size"]),
    Case("batch_size=0", ["data.batch_size=0"], ["data.batch_size"]),
    Case("eval_batch_size=0", ["data.eval_batch_size=0"], ["data.eval_batch_size"]),
    Case("width=0", ["width=0"], ["width=0"]),
    Case("depth=0", ["depth=0"], ["depth=0"]),
    Case("num_blocks=0", ["mdl.num_blocks=0"], ["mdl.num_blocks"]),
    Case("val_size too large", ["data.val_size=5000"], ["data.val_size", "data.test_size"]),
    Case("unknown source", ["data.source=nope"], ["data.source", "digits"]),
    Case(
        "missing data set",
        ["data=cifar10", "paths.data_root={tmp}/empty"],
        ["cifar-10-batches-py", "data.options.download=true"],
    ),
    Case(
        "folder where a batch file should be",
        [],
        ["data_batch_1", "folder"],
        prepare=cifar(lambda f: directory_instead_of_file(f / "data_batch_1")),
    ),
    Case(
        "truncated batch",
        [],
        ["data_batch_2", "truncated", "download=true"],
        prepare=cifar(lambda f: truncate(f / "data_batch_2")),
    ),
    Case("wrong batch shape", [], ["data_batch_3", "3072"], prepare=cifar(lambda f: reshape_batch(f / "data_batch_3"))),
    Case(
        "label out of range in the test split",
        [],
        ["test_batch", "outside 0..9"],
        prepare=cifar(lambda f: bad_label(f / "test_batch")),
    ),
    Case("intact cifar10 copy", [], [], expect_error=False, prepare=cifar(None)),
    Case(
        "cifar10 copy that is not the official one",
        ["data.options.verify_checksums=true"],
        ["MD5", "data.options.verify_checksums=false"],
        prepare=cifar(None),
    ),
    Case("NaN pixels (synthetic center=nan)", ["data=synthetic", "data.options.center=nan"], ["data.options.center"]),
    Case(
        "infinite pixels (synthetic cov_shift=1e4)",
        ["data=synthetic", "data.options.cov_shift=1e4"],
        ["NaN or infinite", "synthetic"],
    ),
    Case("synthetic std=1e-30", ["data=synthetic", "data.options.std=1e-30"], ["data.options.std"]),
    Case("cache folder not writable", [], ["data.cache_dir=null", "not-a-folder"], prepare=read_only_cache),
    Case(
        "three classes in four rows",
        [
            "data=synthetic",
            "data.options.num_classes=3",
            "data.options.n_train=16",
            "data.options.n_test=10",
            "data.val_size=12",
            "mdl.num_blocks=2",
            "data.first_block=1",
        ],
        ["skipped"],
        expect_error=False,
    ),
    Case(
        "gradient eraser, one step",
        ["eraser=gradient", "eraser.options.steps=1"],
        ["did not erase", "eraser.options.steps"],
        expect_error=False,
    ),
    # --- issue "Preemption, run identity and disks": raw or silent before ---
    Case("unknown data option", ["+data.options.foo=1"], ["data.options.foo"]),
    Case("misspelled trainer key", ["+trainer.patiense=1"], ["trainer.patiense", "patience"]),
    Case(
        "single_index n_test=0",
        ["data=single_index", "data.options.n_test=0", "data.test_size=100"],
        [],
        expect_error=False,
    ),
    Case(
        "multiscale_linear n_test=0",
        ["data=multiscale_linear", "data.options.n_test=0", "data.test_size=100"],
        [],
        expect_error=False,
    ),
    Case("steps_per_group=abc", ["mdl.steps_per_group=abc"], ["mdl.steps_per_group"]),
    Case("steps_per_group=2.5", ["mdl.steps_per_group=2.5"], ["mdl.steps_per_group"]),
    Case("checkpoint_every_s=abc", ["mdl.checkpoint_every_s=abc"], ["mdl.checkpoint_every_s"]),
    Case("checkpoint_every_s=inf", ["mdl.checkpoint_every_s=inf"], ["mdl.checkpoint_every_s"]),
    Case("trainer.compile=foo", ["trainer.compile=foo"], ["trainer.compile"]),
    Case(
        "covariance power p=-50",
        ["data.transform={name:covariance_power,p:-50,eps:1.0e-6,order:before_eraser}"],
        ["data.transform", "p closer to 0"],
    ),
    Case(
        "download without network",
        ["data=cifar10", "data.options.download=true"],
        ["could not fetch", "by hand"],
        env={k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    ),
    Case(
        "output root is a file",
        ["paths.output_root={tmp}/a-file"],
        ["paths.output_root", "not a folder"],
        prepare=a_file,
    ),
    Case("sweep_cost unknown model", ["model=nope"], ["model"], command=["-m", "mdl.sweeps.cost"], fast=False),
    Case("sweep_cost width=0", ["width=0"], ["width=0"], command=["-m", "mdl.sweeps.cost"], fast=False),
    Case(
        "sweep_cost num_blocks=1",
        ["mdl.num_blocks=1"],
        ["mdl.num_blocks"],
        command=["-m", "mdl.sweeps.cost"],
        fast=False,
    ),
    Case(
        "report --out in a file",
        ["{tmp}", "--out", "{tmp}/a-file/report"],
        ["--out"],
        command=["-m", "mdl.report"],
        fast=False,
        prepare=one_result,
    ),
    # --- issue 34, "a pack fails like a run": raw, silent or late before ---
    *[
        Case(f"packed pack_data_gb={v}", [*PACKED, f"mdl.pack_data_gb={v}"], ["mdl.pack_data_gb"])
        for v in ("0", "-1", "x", "nan")
    ],
    Case("single run pack_data_gb=0", ["mdl.pack_data_gb=0"], ["mdl.pack_data_gb"]),
    Case(
        "packed sweep, output root is a file",
        [*PACKED, "paths.output_root={tmp}/a-file"],
        ["paths.output_root", "not a folder"],
        prepare=a_file,
    ),
    Case("packed sweep, lock lease 0", [*PACKED, "mdl.lock_lease_s=0"], ["mdl.lock_lease_s"]),
    Case("sweep_cost seed=abc", ["-m", "seed=abc"], ["seed"], command=["-m", "mdl.sweeps.cost"], fast=False),
    Case(
        "sweep_cost pack_data_gb=0",
        ["-m", "seed=0,1", "mdl.pack_data_gb=0"],
        ["mdl.pack_data_gb"],
        command=["-m", "mdl.sweeps.cost"],
        fast=False,
    ),
    Case(
        "report on a damaged multirun.yaml",
        ["{tmp}"],
        ["multirun.yaml", "damaged"],
        expect_error=False,
        command=["-m", "mdl.report"],
        fast=False,
        prepare=damaged_multirun,
    ),
    Case(
        "runs: a truncated config.json",
        [],
        ["0123456789abcdef", "config.json"],
        expect_error=False,
        command=["-m", "mdl.runs"],
        fast=False,
        prepare=truncated_run_config,
    ),
    # --- issue 47, "a sweep that survives chaos": raw or silent before ---
    Case("reuse_across_environments=foo", ["mdl.reuse_across_environments=foo"], ["mdl.reuse_across_environments"]),
    Case("skip_if_done=foo", ["skip_if_done=foo"], ["skip_if_done", "true"]),
    Case(
        "report on a hand-edited results.json",
        ["{tmp}"],
        ["1_seed=1", "checksum"],
        expect_error=False,
        command=["-m", "mdl.report"],
        fast=False,
        prepare=hand_edited_result,
    ),
    Case(
        "rehash_store.py, a store record holding a fragment",
        [],
        ["left 0123456789abcdef", "config lacks"],
        expect_error=False,
        exit_code=1,
        command=["scripts/rehash_store.py"],
        fast=False,
        prepare=fragment_store_record,
    ),
    Case(
        "sweep_cost suby packs by data seed",
        ["-m", "hydra/launcher=packed", "data.balance=suby", "data_seed=0,1", "seed=0,1"],
        ["4 jobs in 2 packs"],
        expect_error=False,
        command=["-m", "mdl.sweeps.cost"],
        fast=False,
    ),
    Case(
        "local launcher, plain kill of the launcher",
        ["-m", "hydra/launcher=local", "seed=0", *LONG],
        [],
        terminate_at="outputs/store/*/checkpoints/*.ckpt",
        signal_group=False,
    ),
    Case("packed sweep SIGTERM mid-fit", [*PACKED, *LONG], [], terminate_at=PACK_CHECKPOINT),
    Case(
        "packed sweep of two packs SIGTERM in the first",
        [*PACKED, "width=16,32", *LONG],
        [],
        terminate_at=PACK_CHECKPOINT,
    ),
    Case(
        "packed sweep of a pack per data set SIGTERM",
        [*PACKED, "eraser=none,leace", "mdl.pack_data_gb=1e-9", *LONG],
        [],
        terminate_at=PACK_CHECKPOINT,
    ),
    Case(
        "local launcher SIGTERM",
        ["-m", "hydra/launcher=local", "seed=0", *LONG],
        [],
        terminate_at="outputs/store/*/checkpoints/*.ckpt",
    ),
    Case(
        "SIGTERM during a CIFAR-sized eraser fit",
        [*CIFAR_SIZED, "eraser=qleace"],
        [],
        terminate_at="log:fitting eraser",
    ),
]


@dataclass
class Outcome:
    case: Case
    returncode: int
    stdout: str
    stderr: str
    problems: list[str]


def run_case(case: Case, timeout: float = 600) -> Outcome:
    """Run launch.py for one case in its own temporary folders and judge how it ended."""
    with tempfile.TemporaryDirectory(prefix="probe-") as name:
        tmp = Path(name)
        overrides = [o.replace("{tmp}", str(tmp)) for o in case.overrides]
        overrides = (case.prepare(tmp) if case.prepare else []) + overrides
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "SLOWING_OUTPUT_ROOT": str(tmp / "outputs"),
            "SLOWING_CACHE_DIR": str(tmp / "cache"),
            "SLOWING_DATA_ROOT": str(tmp / "data"),
            "WANDB_MODE": "offline",
            **case.env,
        }
        entry = [str(REPO / case.command[0])] if case.command[0].endswith(".py") else case.command
        flags = [o for o in overrides if o in ("-m", "--multirun")]  # before the overrides, as argparse wants them
        cmd = [sys.executable, *entry, *flags, *(FAST if case.fast else []), *(o for o in overrides if o not in flags)]
        process = subprocess.Popen(
            cmd,
            cwd=REPO if entry[0] == "-m" else tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        sent = terminate_when_due(case, process, tmp, timeout) if case.terminate_at else None
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            return Outcome(case, -1, stdout, stderr, [f"still running after {timeout:.0f} s"])
        done = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
        late = (
            []
            if sent is None or time.monotonic() - sent <= PREEMPT_GRACE_S
            else [f"exited {time.monotonic() - sent:.0f} s after SIGTERM (Slurm kills after {PREEMPT_GRACE_S} s)"]
        )
    return Outcome(case, done.returncode, done.stdout, done.stderr, judge(case, done) + late)


def terminate_when_due(case: Case, process: subprocess.Popen, tmp: Path, timeout: float) -> float | None:
    """Send SIGTERM to the case's process group once ``case.terminate_at`` is due (a file exists, or seconds passed); when it was sent."""
    assert case.terminate_at is not None
    start = time.monotonic()
    while time.monotonic() - start < timeout and process.poll() is None:
        if case.terminate_at.startswith("after:"):
            due = time.monotonic() - start >= float(case.terminate_at.split(":", 1)[1])
        elif case.terminate_at.startswith("log:"):
            due = any(case.terminate_at[4:] in log.read_text(errors="replace") for log in tmp.glob("outputs/**/*.log"))
        else:
            due = any(tmp.glob(case.terminate_at))
        if due:
            if case.signal_group:
                os.killpg(process.pid, signal.SIGTERM)  # as Slurm signals every process of a job (a launcher's too)
            else:
                process.send_signal(signal.SIGTERM)  # `kill <pid>`: the launcher alone
            return time.monotonic()
        time.sleep(0.05)
    return None


def judge(case: Case, done: subprocess.CompletedProcess) -> list[str]:
    """What is wrong with how the run ended (empty: as it should)."""
    problems = []
    text = done.stderr + done.stdout
    if "Traceback" in done.stderr:
        problems.append("a traceback on stderr")
    if case.terminate_at:
        if done.returncode != PREEMPTED_EXIT:
            problems.append(f"exit code {done.returncode} after SIGTERM, expected {PREEMPTED_EXIT}")
        if "preempted: " not in done.stderr:
            problems.append("no `preempted: ...` line on stderr")
    elif case.expect_error:
        if done.returncode != ERROR_EXIT:
            problems.append(f"exit code {done.returncode}, expected {ERROR_EXIT}")
        if "error: " not in done.stderr:
            problems.append("no `error: ...` line on stderr")
        text = done.stderr
    elif done.returncode != (case.exit_code or 0):
        problems.append(f"exit code {done.returncode}, expected {case.exit_code or 0}")
    problems += [f"message does not mention {s!r}" for s in case.must_name if s not in text]
    return problems


CLASSES = ("ok", "raw", "silent", "unclear", "hang")


def classify(outcome: Outcome) -> str:
    """One word for how a case ended (see the module docstring)."""
    if not outcome.problems:
        return "ok"
    if outcome.returncode == -1:
        return "hang"
    if outcome.case.expect_error and outcome.returncode == 0:
        return "silent"
    expected = (
        PREEMPTED_EXIT
        if outcome.case.terminate_at
        else ERROR_EXIT
        if outcome.case.expect_error
        else outcome.case.exit_code or 0
    )
    if "Traceback" in outcome.stderr or outcome.returncode != expected:
        return "raw"
    return "unclear"


def report(outcome: Outcome) -> str:
    status = classify(outcome).ljust(7)
    lines = [f"{status} {outcome.case.name} (exit {outcome.returncode})"]
    if outcome.problems:
        lines += [f"     - {p}" for p in outcome.problems]
        tail = "\n".join(outcome.stderr.strip().splitlines()[-8:])
        lines += ["     stderr (last lines):"] + [f"       {line}" for line in tail.splitlines()]
    else:
        message = next((line for line in outcome.stderr.splitlines() if line.startswith("error: ")), "")
        if message:
            lines.append(f"     {message[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-k", action="append", default=[], help="run only the cases whose name contains this (repeatable)"
    )
    parser.add_argument("-j", type=int, default=2, help="cases run at once")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.k or any(k in c.name for k in args.k)]
    with ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        outcomes = list(pool.map(run_case, cases))
    for outcome in outcomes:
        print(report(outcome), flush=True)
    failed = [o for o in outcomes if o.problems]
    counts = {c: sum(classify(o) == c for o in outcomes) for c in CLASSES}
    print("classes: " + ", ".join(f"{c} {n}" for c, n in counts.items()))
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} cases end as they should")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
