"""Shared fixtures: compose the real Hydra config with overrides, fast settings for tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent


TEST_CACHE = ""


def pytest_configure(config: pytest.Config) -> None:
    """Tests never read or write the user's erasure cache (stale entries would hide code changes)."""
    import tempfile

    global TEST_CACHE
    TEST_CACHE = os.environ["SLOWING_CACHE_DIR"] = tempfile.mkdtemp(prefix="slowing-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The test session's erasure cache goes with it (repeated runs would fill the disk)."""
    import shutil

    if TEST_CACHE:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


CONF = REPO / "conf"

# A run that takes seconds: few epochs, three blocks.
FAST = ["debug=fast"]  # conf/debug/fast.yaml: tiny data and epochs for any config (test_cli checks what it sets)
# The two groupings the tests compare, by the words results.json's "engine" records: all members in one fit, one per fit.
FITS = {"stacked": "mdl.members_per_fit=all", "sequential": "mdl.members_per_fit=1"}


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def compose_config(overrides: list[str], output_root: Path | None = None) -> DictConfig:
    """The config launch.py composes from ``overrides``, with ``paths.output_root`` set. Composed once per session for
    each list of overrides (Hydra reads and merges every file each time, a tenth of a second: a minute of the fast
    tier), a copy of it each call; the output root, a plain value that the paths interpolate, is set on the copy."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            _COMPOSED[key] = compose("config", overrides=list(overrides))
    cfg = copy.deepcopy(_COMPOSED[key])
    if output_root is not None:
        cfg.paths.output_root = str(output_root)
    return cfg


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH already holds (e.g. carried wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def run_python(code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -c code args...`` in a fresh interpreter with this repository importable: what a module imports
    (``sys.modules``) seen without this test process's imports."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_launch(
    args: list[str], cwd: Path, timeout: float = 600, env: dict[str, str] | None = None, python_flags: list[str] = ()
) -> subprocess.CompletedProcess:
    """Run launch.py in a subprocess exactly as a user would (``python_flags``: the interpreter's, e.g. -X importtime).
    Without WANDB_SERVICE: a test that ran W&B in this process set it, and a launch would join that W&B service."""
    inherited = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    full_env = {**inherited, "PYTHONPATH": python_path(), **(env or {})}
    return subprocess.run(
        [sys.executable, *python_flags, str(REPO / "launch.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_process(overrides: list[str], output_root: Path) -> dict:
    """One run as launch.py runs it, in this process (no interpreter start nor torch import: seconds less), read back
    from the results.json it wrote in its run folder (<output_root>/run)."""
    from mdl.run.experiment import run_experiment

    run_experiment(compose_config(overrides, output_root), output_root / "run", overrides=list(overrides))
    return json.loads((output_root / "run" / "results.json").read_text())


def sweep_report(output_root: Path) -> Path:
    """The one report.md of the one multirun under ``output_root`` (every multirun ends with its report)."""
    (report,) = (output_root / "multirun").glob("*/*/report/report.md")
    return report


# --- one finished run and one small sweep, launched once per session ---------------------------------
# Tests that only read what a launch wrote share these instead of launching their own. They must not write into
# them (copy_output(...) into tmp_path first): the fixtures check at the session's end that nothing changed.

WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_API_KEY": ""}
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the tensorboard extra (not in dev, CI's)
SWEEP_LOGGERS = "logger=[csv,tensorboard,wandb]" if TENSORBOARD else "logger=[csv,wandb]"
# The small sweep: 2 erasers x 2 seeds of debug=fast, every logger on, with W&B tags, its report compared with the
# paper's table (none of which is part of a run's identity or its job folder's name).
SMALL_SWEEP = ["-m", "eraser=none,leace", "seed=0,1", *FAST, SWEEP_LOGGERS, "tags=[baseline,v2]", "report=table16"]


@dataclass(frozen=True)
class Launched:
    """What one launch.py left: its output root, its exit status and console, and its run folders."""

    root: Path  # paths.output_root
    proc: subprocess.CompletedProcess
    run_dirs: tuple[Path, ...]  # a single run's folder, or a sweep's job folders in job order

    @property
    def run_dir(self) -> Path:
        (one,) = self.run_dirs
        return one

    @property
    def results(self) -> dict:
        return json.loads((self.run_dir / "results.json").read_text())

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _launch_once(tmp_path_factory, name: str, args: list[str], env: dict[str, str] | None = None):
    root = tmp_path_factory.mktemp(name)
    proc = run_launch([*args, f"paths.output_root={root}"], cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = sorted(p.parent for p in root.glob("runs/*/*/results.json"))
    jobs = sorted((p.parent for p in root.glob("multirun/*/*/*/results.json")), key=lambda d: int(d.name.split("_")[0]))
    launched = Launched(root, proc, tuple(runs + jobs))
    before = _tree_state(root)
    yield launched
    assert _tree_state(root) == before, f"a test wrote into the shared launch under {root}: copy_output it first"


def _tree_state(root: Path) -> dict[str, tuple[int, int] | str]:
    """Each file's size and mtime; a link by where it points, not by its target: W&B links each run's
    logs/debug-core.log to a log in ~/.cache/wandb that other W&B processes may append to later."""
    return {
        str(p.relative_to(root)): str(p.readlink()) if p.is_symlink() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_symlink() or p.is_file()
    }


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Launched:
    """``python launch.py debug=fast``: the default run, started as a user starts it, once per session."""
    yield from _launch_once(tmp_path_factory, "finished_run", list(FAST))


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory) -> Launched:
    """``python launch.py -m eraser=none,leace seed=0,1 debug=fast`` with every logger (W&B offline), tags and
    report=table16: 4 jobs and the sweep's report, once per session."""
    yield from _launch_once(tmp_path_factory, "small_sweep", SMALL_SWEEP, env=WANDB_OFFLINE)


def copy_output(launched: Launched, to: Path) -> Path:
    """A copy of a shared launch's output root at ``to``, for a test that launches into it or changes it."""
    shutil.copytree(launched.root, to, symlinks=True)
    return to


def pixel_classes(n_per_class: int = 40, d: int = 6, k: int = 3, seed: int = 0, spread: float = 0.1):
    """k classes of pixel-like float64 data in [0, 1]: shifted means, class-specific correlations."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(k):
        mix = torch.randn(d, d, generator=gen, dtype=torch.float64) * spread
        xs.append((torch.randn(n_per_class, d, generator=gen, dtype=torch.float64) @ mix.T + 0.3 + 0.1 * c).clamp(0, 1))
        ys.append(torch.full((n_per_class,), c))
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture
def fast_overrides() -> list[str]:
    return list(FAST)


class RecordOps(TorchDispatchMode):
    """Records every aten op run inside it with the devices of its tensor inputs and outputs, and
    separately the ops that are not views: on a GPU each of those is a kernel launch.
    ``Tensor.tolist`` reads values without an aten op on the CPU; it is recorded as well."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[str]]] = []
        self.kernels: list[str] = []

    def __enter__(self):
        import torch

        entered = super().__enter__()
        self._own_tolist = "tolist" in vars(torch.Tensor)  # an enclosing RecordOps's
        self._tolist = original = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor):
            self.ops.append(("Tensor.tolist", {str(tensor.device)}))
            return original(tensor)

        torch.Tensor.tolist = tolist
        return entered

    def __exit__(self, *exc):
        import torch

        if self._own_tolist:
            torch.Tensor.tolist = self._tolist
        else:
            del torch.Tensor.tolist  # back to TensorBase's
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        out = func(*args, **(kwargs or {}))
        devices: set[str] = set()
        for value in [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out])]:
            if isinstance(value, torch.Tensor):
                devices.add(str(value.device))
        name = str(func)
        if func.name().startswith(("aten::index", "aten::_index_put")) and _has_boolean_index(args):
            name += " (boolean mask)"
        self.ops.append((name, devices))
        if not func.is_view:
            self.kernels.append(name)
        return out


def _has_boolean_index(args: tuple) -> bool:
    import torch

    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


# Ops whose output size depends on the values (the host must learn it), bincount (CUDA reads its
# range) and equal (a Python bool).
VALUE_SIZED_OPS = (
    "aten.nonzero.",
    "aten._unique",
    "aten.unique",
    "aten.masked_select",
    "aten.bincount",
    "aten.equal",
    "(boolean mask)",
)


def host_reads(record: RecordOps) -> list[str]:
    """Ops that read a tensor's value back to Python (.item(), float(), bool(), .tolist()), or whose
    output size depends on values (a boolean mask, nonzero, unique): each one makes the host wait
    for a GPU's queue to drain."""
    return [
        name
        for name, _ in record.ops
        if "_local_scalar_dense" in name
        or name.startswith("aten.item")
        or name == "Tensor.tolist"
        or any(op in name for op in VALUE_SIZED_OPS)
    ]


def cuda_only(reason: str = "needs a CUDA GPU"):
    """Mark a test `gpu` and skip it where torch sees no CUDA device."""
    import torch

    return [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)]


def assert_members_equal_singles(stack, singles, atol: float = 1e-12) -> None:
    """Every member of a StackedClassifier holds the weights of its independently trained stack of one."""
    import torch

    for m, single in enumerate(singles):
        state = single.stack.param_dict()
        for name, p in stack.stack.param_dict().items():
            assert torch.allclose(p.detach()[m], state[name].detach()[0], rtol=0, atol=atol), (m, name)


@pytest.fixture
def float64():
    """Tensors made in float64 during the test (member-by-member comparisons to the last bits), float32 after."""
    import torch

    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)
