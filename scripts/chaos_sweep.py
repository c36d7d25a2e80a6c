"""A chaos run: a small digits sweep under both local launchers, with faults injected at random moments, relaunched
until it is done, then compared record by record with the same sweep run undisturbed.

    python scripts/chaos_sweep.py --jobs 20 --faults 30 --seed 0 [--wandb]

The sweep (``debug=fast`` on digits, several erasers and seeds) is split between ``hydra/launcher=local`` (one
process per job, hydra_plugins/mdl_local) and ``hydra/launcher=packed`` (one process training packs,
hydra_plugins/mdl_packed), each with its own output root and both with one erasure cache. First both run undisturbed
(the reference, and its time); then a seeded schedule of (time, fault, target) is built and printed, both sweeps are
launched again in a fresh folder, and the faults are applied as their times come:

    sigkill-job / sigterm-job       a job process of the local launcher (Slurm's preemption: SIGTERM)
    sigkill-pack / sigterm-pack     the packed launcher's process, which trains the packs
    sigkill-group / sigterm-group   a launcher's whole process group (a node failure; Slurm's scancel)
    disk-full                       the output folder's disk filled (a small tmpfs, or where none can be mounted a
                                    quota-like stand-in that raises ENOSPC at the write layer: scripts/chaos_disk/),
                                    then freed
    stopped-lock                    a run's lock (its store folder's run.lock) taken by a process that is then
                                    SIGSTOPped (Slurm's gang scheduling), later resumed and released
    cache-flip                      one byte flipped in an erasure cache file
    edit-results                    a finished run's stored results.json edited by hand (its checksum then wrong)

A sweep that stops is launched again with the same command (as a user or Slurm's requeue would); one that runs far
longer than the reference is a hang, killed and launched again. Once both are done (and launched once more if a
stored record was edited after their last launch began, so that the edit is met), every job's results.json numbers,
CSV series and W&B offline series (``--wandb``; and no finished run logged to W&B twice) are compared with the
reference's. It prints the faults per kind and
how each ended (a clean message, a silent recovery or a problem), the relaunches, the time against the undisturbed
sweep, and last ``<k> of <n> runs bit-identical, <l> records lost, <h> hangs``; the exit status is 1 unless all runs
are identical, nothing is lost and nothing hung.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the W&B offline reader and the series the tests compare

KINDS = (
    "sigkill-job",
    "sigterm-job",
    "sigkill-pack",
    "sigterm-pack",
    "sigkill-group",
    "sigterm-group",
    "disk-full",
    "stopped-lock",
    "cache-flip",
    "edit-results",
)
LAUNCHERS = {"local": "hydra/launcher=local", "packed": "hydra/launcher=packed"}
ERASERS = ("none", "leace", "random")
LOCK_LEASE_S = 20  # the sweeps' mdl.lock_lease_s: a stopped holder is named after this long (default: minutes)
NUMBERS = (
    "paper_mdl",
    "paper_mdl_last_block",
    "paper_mdl_val_min",
    "online_codelength_bits",
    "online_bits_per_example",
    "final_val_loss",
    "final_epochs",
    "boundaries",
    "blocks",
)  # and every *_curve
ENDING = re.compile(r"^(error|preempted): .*$", re.MULTILINE)  # launch.py's last words (mdl.run.exits)
TMPFS_SIZE = "256M"
POLL_S = 0.2
GAP_S = 2.0  # least seconds between two faults on one target
HOLD_LOCK = """
import sys, time
from pathlib import Path
from mdl.run.storage import run_lock
with run_lock(Path(sys.argv[1]), lease_s=float(sys.argv[2])):
    Path(sys.argv[3]).touch()
    while not Path(sys.argv[4]).exists():
        time.sleep(0.1)
"""


# --- the sweep -------------------------------------------------------------------------------------------------------


def sweep_values(jobs: int) -> tuple[list[str], list[int]]:
    """Erasers and seeds whose product is ``jobs`` runs (as many erasers as divide it, at most three)."""
    erasers = next(ERASERS[:e] for e in (3, 2, 1) if jobs % e == 0 and jobs >= e)
    return list(erasers), list(range(jobs // len(erasers)))


def sweep_command(launcher: str, jobs: int, root: Path, wandb: bool) -> list[str]:
    erasers, seeds = sweep_values(jobs)
    return [
        sys.executable,
        str(REPO / "launch.py"),
        "-m",
        LAUNCHERS[launcher],
        f"eraser={','.join(erasers)}",
        f"seed={','.join(map(str, seeds))}",
        "debug=fast",
        "logger=[csv,wandb]" if wandb else "logger=csv",
        "mdl.checkpoint_every_s=0",  # a resumable checkpoint at every epoch end: kills land between them
        f"mdl.lock_lease_s={LOCK_LEASE_S}",
        "trainer.torch_threads=1",
        "report=none",  # the report is not under test (it reads job folders' results.json without their checksum)
        f"paths.output_root={root / launcher}",
        f"data.cache_dir={root / 'cache'}",
    ]


@dataclass
class Launch:
    """One launch of one sweep: its process (a process group of its own), when it began, its console files."""

    number: int
    process: subprocess.Popen
    started: float
    out: Path
    before: set[Path]  # the sweep folders there before it: the new one is its own
    ended: str = ""  # how it ended (classify)
    line: str = ""  # its last error:/preempted: line or traceback's last line

    def console(self) -> str:
        return self.out.read_text(errors="replace")


@dataclass
class Sweep:
    name: str
    jobs: int
    root: Path  # the run root; its output root is root / name
    wandb: bool
    env: dict[str, str]
    launches: list[Launch] = field(default_factory=list)
    done: bool = False

    @property
    def output(self) -> Path:
        return self.root / self.name

    @property
    def current(self) -> Launch | None:
        launch = self.launches[-1] if self.launches else None
        return launch if launch is not None and launch.process.poll() is None else None

    def launch(self) -> Launch:
        logs = self.root.parent / f"consoles-{self.root.name}"  # beside the run root: a full disk keeps them
        logs.mkdir(parents=True, exist_ok=True)
        out = logs / f"{self.name}-{len(self.launches) + 1}.txt"
        with open(out, "w") as console:
            process = subprocess.Popen(
                sweep_command(self.name, self.jobs, self.root, self.wandb),
                cwd=self.root,
                env=self.env,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a process group of its own: a group fault hits this launch only
            )
        launch = Launch(len(self.launches) + 1, process, time.monotonic(), out, set(sweep_folders(self.output)))
        self.launches.append(launch)
        return launch

    def folder_of(self, launch: Launch) -> Path | None:
        new = sorted(set(sweep_folders(self.output)) - launch.before)
        return new[0] if new else None


def sweep_folders(output: Path) -> list[Path]:
    return sorted(output.glob("multirun/*/*"))


def launch_env(root: Path, stand_in_flag: Path | None) -> dict[str, str]:
    paths = [str(REPO), *([str(REPO / "scripts" / "chaos_disk")] if stand_in_flag else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "WANDB_MODE": "offline", "WANDB_API_KEY": ""}
    env.pop("MDL_TRACEBACK", None)
    if stand_in_flag is not None:
        env |= {"CHAOS_DISK_FULL_FLAG": str(stand_in_flag), "CHAOS_DISK_ROOT": str(root)}
    return env


def classify(launch: Launch) -> tuple[str, str]:
    """How a launch that exited ended: completed, message (its error:/preempted: line), killed (by SIGKILL, or by
    SIGTERM's default action while it starts: no word is possible) or problem (a traceback, another exit)."""
    code, text = launch.process.returncode, launch.console()
    endings = [m.group(0) for m in ENDING.finditer(text)]
    if code == 0:
        return "completed", ""
    if code in (-signal.SIGKILL, -signal.SIGTERM):  # SIGTERM before its handler is installed (startup): no work lost
        return "killed", signal.Signals(-code).name
    if "Traceback" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        return "problem", f"exit {code}: traceback ending {lines[-1][:200]!r}"
    if endings and code in (1, 2, 143):
        return "message", endings[-1][:200]
    return "problem", f"exit {code} without a message"


# --- the schedule ----------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    at: float  # seconds after the chaos launch began
    kind: str
    target: str  # which sweep (or what) it aims at
    hold: float = 0.0  # disk-full, stopped-lock: seconds before it is undone
    applied: float | None = None
    what: str = ""  # the concrete victim
    sweeps: dict[str, int] = field(default_factory=dict)  # sweep name -> the launch it hit
    outcome: str = ""  # clean message / silent recovery / problem / not applied
    detail: str = ""
    undo: object = None  # a callable that undoes it (disk, lock)
    undone: bool = False


def build_schedule(rng: random.Random, faults: int, reference_s: dict[str, float]) -> list[Fault]:
    """``faults`` faults, every kind before any repeats, each with its target, a random moment within 0.05 to 0.9 of
    its target's undisturbed time (a stopped sweep's relaunch delays what is left of it), and, where it is undone, how
    long it holds; in order of time."""
    kinds: list[str] = []
    while len(kinds) < faults:
        batch = list(KINDS)
        rng.shuffle(batch)
        kinds += batch
    schedule = []
    for kind in kinds[:faults]:
        if kind.endswith("-job"):
            target = "local"
        elif kind.endswith("-pack"):
            target = "packed"
        elif kind in ("disk-full", "cache-flip"):
            target = "both"
        else:
            target = rng.choice(["local", "packed"])
        hold = (
            rng.uniform(2, 8)
            if kind == "disk-full"
            else rng.uniform(5, 2 * LOCK_LEASE_S)
            if kind == "stopped-lock"
            else 0
        )
        span = min(reference_s.values()) if target == "both" else reference_s[target]
        schedule.append(Fault(round(rng.uniform(0.05, 0.9) * span, 1), kind, target, round(hold, 1)))
    return sorted(schedule, key=lambda fault: fault.at)


# --- applying a fault ------------------------------------------------------------------------------------------------


class Disk:
    """The run root's disk: a tmpfs of its own where one can be mounted (root), else the write-layer stand-in."""

    def __init__(self, root: Path) -> None:
        self.root, self.filler, self.flag = root, root / ".chaos-filler", root.parent / f".{root.name}-disk-full"
        self.mounted = os.geteuid() == 0 and self._mount()
        self.stand_in = None if self.mounted else self.flag

    def _mount(self) -> bool:
        self.root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.root)], capture_output=True
        )
        return done.returncode == 0

    def fill(self) -> str:
        if not self.mounted:
            self.flag.touch()
            return "write-layer stand-in: ENOSPC at the atomic write, no free space reported"
        written = 0
        try:
            with open(self.filler, "wb") as f:
                while True:
                    f.write(b"\0" * 2**20)
                    written += 2**20
        except OSError:
            pass
        return f"tmpfs filled ({written / 2**20:.0f} MiB)"

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.flag.unlink(missing_ok=True)

    def unmount(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)


def alive_job_pids(sweep: Sweep) -> list[int]:
    """The local launcher's job processes training now: the holders of its store's run locks in its process group."""
    launch = sweep.current
    if launch is None:
        return []
    pids = []
    for record in sweep.output.glob("store/*/run.lock.holder.json"):
        try:
            pid = json.loads(record.read_text())["pid"]
            if os.getpgid(pid) == launch.process.pid and pid != launch.process.pid:
                pids.append(pid)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(set(pids))


def apply(fault: Fault, sweeps: dict[str, Sweep], disk: Disk, rng: random.Random, env: dict[str, str]) -> bool:
    """Apply the fault if its target exists now (else False: it waits). Records what it hit."""
    running = [s for s in sweeps.values() if s.current is not None]
    targets = [s for s in running if fault.target in (s.name, "both")]
    kind = fault.kind
    if kind.startswith(("sigkill", "sigterm")):
        sig = signal.SIGKILL if kind.startswith("sigkill") else signal.SIGTERM
        sweep = sweeps[fault.target] if fault.target in sweeps else None
        if sweep is None or sweep.current is None:
            return False
        if kind.endswith("-job"):
            pids = alive_job_pids(sweep)
            if not pids:
                return False
            pid = rng.choice(pids)
            os.kill(pid, sig)
            fault.what = f"job pid {pid}"
        elif kind.endswith("-pack"):
            os.kill(sweep.current.process.pid, sig)
            fault.what = f"packed launcher pid {sweep.current.process.pid}"
        else:
            os.killpg(sweep.current.process.pid, sig)
            fault.what = f"{sweep.name} launcher's process group {sweep.current.process.pid}"
        targets = [sweep]
    elif kind == "disk-full":
        if not running:
            return False
        fault.what = disk.fill()
        fault.undo = disk.free
    elif kind == "stopped-lock":
        sweep = sweeps[fault.target]
        if sweep.current is None:
            return False
        stores = [p for p in sweep.output.glob("store/*") if p.name != "packs" and not (p / "results.json").exists()]
        if not stores:
            return False
        fault.undo = hold_lock(rng.choice(sorted(stores)), env)
        fault.what = f"lock of {fault.undo.store.name}"
        targets = [sweep]
    elif kind == "cache-flip":
        files = [p for p in (disk.root / "cache").glob("*.safetensors") if p.stat().st_size > 0]
        if not running or not files:
            return False
        victim = rng.choice(sorted(files))
        data = bytearray(victim.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))  # in place, as a bad sector or a bit flip in memory would
        fault.what = f"byte {at} of {victim.name}"
    elif kind == "edit-results":
        sweep = sweeps[fault.target]
        finished = sorted(sweep.output.glob("store/*/results.json"))
        if not finished:
            return False
        victim = rng.choice(finished)
        record = json.loads(victim.read_text())
        record["paper_mdl"] = round(record["paper_mdl"] + 1.0, 4)  # a "corrected" number, its checksum left as it was
        victim.write_text(json.dumps(record, indent=2))
        fault.what = f"paper_mdl of {victim.parent.name}"
        targets = [sweep]
    fault.applied = time.monotonic()
    fault.sweeps = {s.name: s.launches[-1].number for s in targets if s.launches}
    return True


class HeldLock:
    """A process holding a run's lock, stopped with SIGSTOP once it holds it; ``__call__`` resumes and releases it."""

    def __init__(self, store: Path, env: dict[str, str]) -> None:
        tag = f"{store.name}-{time.monotonic_ns()}"
        self.store, self.held, self.release = store, store.parent / f".held-{tag}", store.parent / f".release-{tag}"
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(store), str(LOCK_LEASE_S), str(self.held), str(self.release)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.stopped = False

    def poll(self) -> None:
        """Stop the holder as soon as it holds the lock (it may first wait for the run's own process)."""
        if not self.stopped and self.held.exists():
            os.kill(self.process.pid, signal.SIGSTOP)
            self.stopped = True

    def __call__(self) -> None:
        self.release.touch()
        os.kill(self.process.pid, signal.SIGCONT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for marker in (self.held, self.release):
            marker.unlink(missing_ok=True)


def hold_lock(store: Path, env: dict[str, str]) -> HeldLock:
    return HeldLock(store, env)


def undo(fault: Fault) -> None:
    if fault.undo is not None and not fault.undone:
        fault.undo()
        fault.undone = True


# --- the run ---------------------------------------------------------------------------------------------------------


def run_undisturbed(root: Path, jobs: dict[str, int], wandb: bool) -> tuple[dict[str, Sweep], dict[str, float]]:
    """Both sweeps at once, as the chaos run launches them; each one's wall time."""
    root.mkdir(parents=True, exist_ok=True)
    sweeps = {name: Sweep(name, n, root, wandb, launch_env(root, None)) for name, n in jobs.items() if n}
    start = time.monotonic()
    for sweep in sweeps.values():
        sweep.launch()
    took = {}
    while len(took) < len(sweeps):
        for sweep in sweeps.values():
            launch = sweep.launches[-1]
            if sweep.name in took or launch.process.poll() is None:
                continue
            if launch.process.returncode != 0:
                raise SystemExit(f"the undisturbed {sweep.name} sweep failed:\n{launch.console()[-3000:]}")
            sweep.done, took[sweep.name] = True, time.monotonic() - start
        time.sleep(POLL_S)
    return sweeps, took


def run_chaos(
    disk: Disk, jobs: dict[str, int], wandb: bool, schedule: list[Fault], rng: random.Random, hang_s: float
) -> tuple[dict[str, Sweep], float, int]:
    """Launch both sweeps on ``disk``'s root, apply the schedule, relaunch what stops until both are done (or have
    been launched too often); returns the sweeps, the wall time and the hangs."""
    root = disk.root
    env = launch_env(root, disk.stand_in)
    sweeps = {name: Sweep(name, n, root, wandb, env) for name, n in jobs.items() if n}
    print(
        f"disk faults: {'a ' + TMPFS_SIZE + ' tmpfs at the run root' if disk.mounted else 'the write-layer stand-in'}"
    )
    hangs, start, max_launches = 0, time.monotonic(), 10 + 3 * len(schedule)
    last_applied: dict[str, float] = {}  # target -> when a fault last hit it
    for sweep in sweeps.values():
        sweep.launch()
    pending = list(schedule)
    try:
        while True:
            now = time.monotonic() - start
            for fault in [f for f in pending if f.at <= now]:  # one whose target is not there yet waits
                finished = all(sweeps[s].done for s in sweeps if fault.target in (s, "both"))
                if finished and fault.kind != "edit-results":  # an edit after the end is met by one more launch
                    fault.outcome, fault.detail = "not applied", "its sweep had finished"
                    pending.remove(fault)
                elif now - last_applied.get(fault.target, -GAP_S) < GAP_S:
                    continue  # faults that waited for one target land apart, not all on one process at once
                elif apply(fault, sweeps, disk, rng, env):
                    print(f"  {now:6.1f} s  {fault.kind:<14} {fault.what}", flush=True)
                    pending.remove(fault)
                    last_applied[fault.target] = now
            for fault in schedule:
                if isinstance(fault.undo, HeldLock):
                    fault.undo.poll()
                if fault.applied is not None and not fault.undone and time.monotonic() - fault.applied > fault.hold:
                    undo(fault)
            for sweep in sweeps.values():
                hangs += step(sweep, schedule, hang_s, max_launches)
            if all(s.done or len(s.launches) >= max_launches for s in sweeps.values()):
                break
            time.sleep(POLL_S)
        for fault in pending:
            fault.outcome, fault.detail = "not applied", "the sweep finished first"
        for sweep in sweeps.values():  # an edit after the last launch began is met by one more
            last = sweep.launches[-1]
            edits = [
                f for f in schedule if f.kind == "edit-results" and sweep.name in f.sweeps and f.applied > last.started
            ]
            if sweep.done and edits:
                print(
                    f"  launching the {sweep.name} sweep once more: a stored record was edited after its last launch began"
                )
                again = sweep.launch()
                for fault in edits:  # judged by the launch that meets the edit
                    fault.sweeps[sweep.name], fault.outcome, fault.detail = again.number, "", ""
                try:
                    again.process.wait(timeout=hang_s)
                    ended(sweep, again, schedule)
                except subprocess.TimeoutExpired:
                    os.killpg(again.process.pid, signal.SIGKILL)
                    again.process.wait()
                    ended(sweep, again, schedule, hung=True)
                    hangs += 1
    finally:
        for fault in schedule:
            undo(fault)
        for sweep in sweeps.values():
            for launch in sweep.launches:
                if launch.process.poll() is None:
                    os.killpg(launch.process.pid, signal.SIGKILL)
                    launch.process.wait()
        wall = time.monotonic() - start
    return sweeps, wall, hangs


def step(sweep: Sweep, schedule: list[Fault], hang_s: float, max_launches: int) -> int:
    """Relaunch a sweep that stopped, kill one that hangs; 1 when it hung."""
    if sweep.done or not sweep.launches or sweep.launches[-1].ended:
        return 0
    launch = sweep.launches[-1]
    if launch.process.poll() is None:
        if time.monotonic() - launch.started < hang_s:
            return 0
        os.killpg(launch.process.pid, signal.SIGKILL)
        launch.process.wait()
        ended(sweep, launch, schedule, hung=True)
        print(f"  {sweep.name} launch {launch.number} hung ({hang_s:.0f} s): killed")
    else:
        ended(sweep, launch, schedule)
    if sweep.done or len(sweep.launches) >= max_launches:
        return int(launch.ended == "hang")
    for fault in schedule:  # the user follows the message: a stopped holder resumed, the disk freed
        if sweep.name in fault.sweeps or fault.target == "both":
            undo(fault)
    time.sleep(1)
    sweep.launch()
    return int(launch.ended == "hang")


def ended(sweep: Sweep, launch: Launch, schedule: list[Fault], hung: bool = False) -> None:
    """Record how the launch ended, and so how the faults that hit it ended."""
    launch.ended, launch.line = ("hang", "no end within the hang limit") if hung else classify(launch)
    sweep.done = launch.ended == "completed"
    text = launch.console() + job_logs(sweep.folder_of(launch))
    stoppers = [f for f in schedule if f.kind.startswith("sig") and f.sweeps.get(sweep.name) == launch.number]
    for fault in schedule:
        if fault.sweeps.get(sweep.name) != launch.number:
            continue
        if stoppers and fault is not stoppers[-1] and launch.ended != "completed":
            if fault.kind.startswith("sig"):  # an earlier signal's ending is hidden by a later one's
                fault.outcome, fault.detail = "silent recovery", "overtaken by a later fault; resumed by the relaunch"
            else:  # met (or not) by the next launch
                fault.sweeps[sweep.name] = launch.number + 1
            continue
        if launch.ended == "completed":
            outcome, detail = "silent recovery", warning_for(fault.kind, text)
            if detail:
                outcome = "clean message"
        elif launch.ended == "message":
            outcome, detail = "clean message", launch.line
        elif launch.ended == "killed":
            outcome, detail = "silent recovery", "killed outright (no word is possible), resumed by the relaunch"
        else:
            outcome, detail = "problem", launch.line
        if RANK[outcome] >= RANK.get(fault.outcome, -1):  # the worst of the sweeps it hit
            fault.outcome, fault.detail = outcome, detail


RANK = {"silent recovery": 0, "clean message": 1, "problem": 2}


WARNINGS = {
    "cache-flip": re.compile(r"erasure cache: .*rebuilding it"),
    "edit-results": re.compile(r"the stored results are damaged, so this run is done again"),
}


def warning_for(kind: str, text: str) -> str:
    found = WARNINGS.get(kind) and WARNINGS[kind].search(text)
    return found.group(0)[:200] if found else ""


def job_logs(folder: Path | None) -> str:
    """What a launch's jobs wrote to their own logs (launch.log, submitit's logs)."""
    if folder is None:
        return ""
    files = [*folder.glob("*/launch.log"), *folder.glob(".submitit/*/*_log.*")]
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


# --- the comparison --------------------------------------------------------------------------------------------------


def numbers(results: dict) -> dict:
    return {k: v for k, v in results.items() if k in NUMBERS or k.endswith("_curve")}


def final_jobs(sweep: Sweep) -> dict[str, Path]:
    """The job folders of the sweep's last launch (completed), by overrides."""
    folder = sweep.folder_of(sweep.launches[-1])
    return {job.name.split("_", 1)[1]: job for job in folder.iterdir() if job.is_dir() and not job.name.startswith(".")}


def computed_in(sweep: Sweep, job: str) -> Path | None:
    """The folder of the last launch that computed the job (its results.json not marked skipped)."""
    for launch in reversed(sweep.launches):
        folder = sweep.folder_of(launch)
        if folder is None:
            continue
        for candidate in folder.glob(f"*_{glob_escape(job)}"):
            try:
                if not json.loads((candidate / "results.json").read_text()).get("skipped"):
                    return candidate
            except (OSError, ValueError):
                continue
    return None


def logged_again(sweep: Sweep, job: str, computed: Path) -> list[Path]:
    """Job folders of later launches that skipped the job yet logged it to W&B again, though the launch that computed
    it finished its W&B run (one that did not is logged again from the store, rightly)."""
    from wandb_records import records

    when = (computed.parent.parent.name, computed.parent.name)  # multirun/<date>/<time>
    later = [f for f in sweep_folders(sweep.output) if (f.parent.name, f.name) > when]
    again = [j for f in later for j in f.glob(f"*_{glob_escape(job)}") if list(j.glob("wandb/offline-run-*"))]
    if not again:
        return []
    (own,) = computed.glob("wandb/offline-run-*/run-*.wandb")
    finished = any(r.WhichOneof("record_type") == "exit" for r in records(own))
    return again if finished else []


def glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def compare(reference: Sweep, chaos: Sweep, wandb: bool) -> tuple[int, int, list[str]]:
    """(runs bit-identical, records lost, what differs) for one sweep."""
    from mdl.results import DamagedRecord, read_checked_json
    from test_pack_logs import csv_series, wandb_series, wandb_summary

    expected = final_jobs(reference)
    got = final_jobs(chaos)
    identical, lost, differences = 0, 0, []
    for job, ref in sorted(expected.items()):
        where = f"{chaos.name} {job}"
        if job not in got:
            lost, _ = lost + 1, differences.append(f"{where}: no job folder")
            continue
        try:
            results = read_checked_json(got[job] / "results.json")
        except (DamagedRecord, FileNotFoundError) as err:
            lost, _ = lost + 1, differences.append(f"{where}: results.json lost ({err})")
            continue
        same = numbers(results) == numbers(read_checked_json(ref / "results.json"))
        if not same:
            differences.append(f"{where}: results.json numbers differ")
        logs = computed_in(chaos, job)
        if logs is None:
            lost, _ = lost + 1, differences.append(f"{where}: no launch computed it")
            continue
        series = [("CSV", csv_series)] + ([("W&B", wandb_series), ("W&B summary", wandb_summary)] if wandb else [])
        for name, read in series:
            try:
                if read(logs) != read(ref):
                    same = False
                    differences.append(f"{where}: {name} differs ({logs})")
            except (OSError, ValueError, AssertionError) as err:
                same, lost = False, lost + 1
                differences.append(f"{where}: {name} record lost ({type(err).__name__}: {err})")
        again = logged_again(chaos, job, logs) if wandb else []
        if again:
            same = False
            differences.append(f"{where}: W&B has it {1 + len(again)} times (logged again by {again[0]})")
        identical += same
    return identical, lost, differences


# --- the report ------------------------------------------------------------------------------------------------------


def print_schedule(schedule: list[Fault], reference_s: dict[str, float]) -> None:
    took = ", ".join(f"{name} {s:.0f} s" for name, s in reference_s.items())
    print(f"schedule ({len(schedule)} faults, times from the chaos launch; the undisturbed sweeps took {took}):")
    for fault in schedule:
        hold = f", undone after {fault.hold:.1f} s" if fault.hold else ""
        print(f"  {fault.at:6.1f} s  {fault.kind:<14} target {fault.target}{hold}")


def print_faults(schedule: list[Fault]) -> int:
    """Faults per kind and how they ended; the number of problems."""
    print("faults injected, by kind and how they ended:")
    problems = 0
    for kind in KINDS:
        faults = [f for f in schedule if f.kind == kind]
        if not faults:
            continue
        applied = [f for f in faults if f.applied is not None]
        ends = Counter(f.outcome or "open" for f in applied)
        missed = len(faults) - len(applied)
        print(
            f"  {kind:<14} {len(applied)}: "
            + ", ".join(f"{n} {outcome}" for outcome, n in sorted(ends.items()))
            + (f" ({missed} not applied: the sweep finished first)" if missed else "")
        )
        for f in applied:
            if f.outcome != "silent recovery" and f.detail:
                print(f"      {f.outcome}: {f.detail}")
        problems += ends["problem"] + ends["open"]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20, help="runs in all, split between the two launchers")
    parser.add_argument("--faults", type=int, default=30, help="faults to inject")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed")
    parser.add_argument("--wandb", action="store_true", help="log to W&B (offline) too and compare its series")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the two sweeps run (default: a temporary folder)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.jobs < 2 or args.faults < 0:
        parser.error("--jobs must be at least 2 (one per launcher) and --faults at least 0")
    jobs = {"local": args.jobs // 2, "packed": args.jobs - args.jobs // 2}
    work = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.workdir))
    rng = random.Random(args.seed)
    disk = Disk(work / "chaos")
    try:
        print(
            f"sweep: {jobs['local']} jobs under hydra/launcher=local, {jobs['packed']} under hydra/launcher=packed ({work})"
        )
        reference, reference_s = run_undisturbed(work / "reference", jobs, args.wandb)
        schedule = build_schedule(rng, args.faults, reference_s)
        print_schedule(schedule, reference_s)
        hang_s = 3 * max(reference_s.values()) + 120
        chaos, chaos_s, hangs = run_chaos(disk, jobs, args.wandb, schedule, rng, hang_s)
        problems = print_faults(schedule)
        relaunches = sum(len(s.launches) - 1 for s in chaos.values())
        print(f"relaunches: {relaunches} ({', '.join(f'{s.name} {len(s.launches) - 1}' for s in chaos.values())})")
        undisturbed = max(reference_s.values())
        print(f"time: {chaos_s:.0f} s against {undisturbed:.0f} s undisturbed ({chaos_s / undisturbed:.2f}x)")
        identical, lost, differences = 0, 0, []
        for name, sweep in chaos.items():
            if not sweep.done:
                lost += sweep.jobs
                differences.append(f"{name}: the sweep never finished")
                continue
            k, missing, diffs = compare(reference[name], sweep, args.wandb)
            identical, lost, differences = identical + k, lost + missing, differences + diffs
        for line in differences:
            print(f"  {line}")
        print(f"{identical} of {args.jobs} runs bit-identical, {lost} records lost, {hangs} hangs")
        return 0 if identical == args.jobs and not lost and not hangs and not problems else 1
    finally:
        disk.unmount()  # a tmpfs takes the chaos run's files with it (--keep keeps the reference and the consoles)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
