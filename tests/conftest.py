"""Shared fixtures: compose the real Hydra config with overrides, fast settings for tests."""

from __future__ import annotations

import os
import subprocess
import sys
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


def compose_config(overrides: list[str], output_root: Path | None = None) -> DictConfig:
    extra = [f"paths.output_root={output_root}"] if output_root is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides) + extra)


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH already holds (e.g. carried wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def run_launch(
    args: list[str], cwd: Path, timeout: float = 600, env: dict[str, str] | None = None, python_flags: list[str] = ()
) -> subprocess.CompletedProcess:
    """Run launch.py in a subprocess exactly as a user would (``python_flags``: the interpreter's, e.g. -X importtime)."""
    full_env = {**os.environ, "PYTHONPATH": python_path(), **(env or {})}
    return subprocess.run(
        [sys.executable, *python_flags, str(REPO / "launch.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sweep_report(output_root: Path) -> Path:
    """The one report.md of the one multirun under ``output_root`` (every multirun ends with its report)."""
    (report,) = (output_root / "multirun").glob("*/*/report/report.md")
    return report


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
    """Every member of a StackedClassifier holds the weights of its independently trained Classifier."""
    import torch

    for m, single in enumerate(singles):
        for name, p in single.model.named_parameters():
            assert torch.allclose(stack.stack.member_state(m)[name], p.detach(), rtol=0, atol=atol), (m, name)
