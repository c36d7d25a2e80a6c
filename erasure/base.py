"""The eraser contract: fit on (x, y), apply to tensors of the same shape, save without pickle.

Every eraser is a small frozen dataclass holding only tensors and plain metadata. Fitting is
done by a classmethod ``fit`` registered under a name; ``fit_eraser(name, x, y)`` is the one
entry point. Inputs are validated here once so every eraser gets clean float, finite data and
int64 labels in range.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from erasure.files import atomic_write
from erasure.resumable import FitProgress

FORMAT_VERSION = 1
_REGISTRY: dict[str, type["Eraser"]] = {}
# The shipped erasers' modules, imported when their name is first looked up (a run imports only its own eraser's
# code: QLEACE's and the gradient eraser's modules are a LEACE run's dead weight). Importing a module registers it.
SHIPPED = {
    "alf_qleace": "erasure.alf_qleace",
    "gradient": "erasure.gradient",
    "leace": "erasure.leace",
    "none": "erasure.no_erasure",
    "qleace": "erasure.qleace",
    "random": "erasure.random_projection",
}


def register_eraser(name: str) -> Callable[[type["Eraser"]], type["Eraser"]]:
    """Class decorator: make an eraser reachable by ``fit_eraser(name, ...)`` and ``load_eraser``."""

    def wrap(cls: type["Eraser"]) -> type["Eraser"]:
        if name in _REGISTRY:
            raise ValueError(f"eraser name {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_erasers() -> list[str]:
    return sorted(set(_REGISTRY) | set(SHIPPED))


def eraser_class(name: str) -> type["Eraser"]:
    if name not in _REGISTRY and name in SHIPPED:
        importlib.import_module(SHIPPED[name])
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown eraser {name!r}; choose one of {available_erasers()} (e.g. `eraser=leace` on the command line)"
        )
    return _REGISTRY[name]


def check_feature_shape(x: Tensor) -> None:
    """The checks of ``check_features`` that read no value (free on a GPU: no host synchronisation)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2 or x.shape[0] == 0:
        raise ValueError(f"x must have shape (n, ...) with n >= 1, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x.dtype}; convert with x.float() / 255")


def check_features(x: Tensor) -> None:
    """Reject data an eraser cannot use, with a message saying what to change."""
    check_feature_shape(x)
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x contains {bad} NaN or infinite values; clean the data before erasure")


def check_labels(y: Tensor, n: int, num_classes: int | None = None) -> int:
    """Validate labels and return the number of classes."""
    if not isinstance(y, Tensor):
        raise TypeError(f"y must be a torch.Tensor of class indices, got {type(y).__name__}")
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"y must have shape ({n},) to match x, got {tuple(y.shape)}")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise TypeError(f"y must hold integer class indices, got {y.dtype}")
    lo, hi = int(y.min()), int(y.max())
    k = num_classes if num_classes is not None else hi + 1
    if lo < 0 or hi >= k:
        raise ValueError(
            f"labels must lie in [0, {k - 1}], found range [{lo}, {hi}]; remap them to 0..K-1 or pass num_classes"
        )
    return k


class TensorRecord:
    """A frozen dataclass of tensors and plain metadata (an eraser, a covariance-power transform), its tensors
    contiguous: Tensor-valued fields are saved as tensors, everything else as JSON metadata."""

    def __post_init__(self) -> None:
        # Loaded tensors are contiguous; fitted ones must be too, or matmuls take other kernels and
        # the outputs after save -> load differ in the last bit (seen with QR factors).
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and not value.is_contiguous():
                object.__setattr__(self, f.name, value.contiguous())

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}

    def metadata(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not isinstance(getattr(self, f.name), Tensor)}

    def to(self, device: torch.device | str) -> Any:
        """The same record with its tensors on ``device`` (so applying an eraser per batch moves nothing)."""
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})


@dataclass(frozen=True)
class Eraser(TensorRecord, ABC):
    """A fitted, immutable map x -> x' that removes class information from x.

    Subclasses declare their tensors as dataclass fields (Tensor-valued fields are saved as
    tensors, everything else as JSON metadata) and implement ``fit`` and ``_erase``.
    """

    name: ClassVar[str] = ""
    requires_labels: ClassVar[bool] = False
    can_transform_new_data: ClassVar[bool] = True
    # targets class covariances (quadratically available information) too: a held-out quadratic probe
    # far above chance after erasure is warned about (datamodules.erasure_checks.quadratic_leftover)
    erases_quadratic: ClassVar[bool] = False

    # z-score statistics (erasure.preprocess): set by fit_eraser(..., zscore=True), applied to every
    # input before _erase. None = no normalisation. Keyword-only so subclasses declare fields freely.
    input_shift: Tensor | None = field(default=None, kw_only=True)
    input_scale: Tensor | None = field(default=None, kw_only=True)

    @classmethod
    @abstractmethod
    def fit(cls, x: Tensor, y: Tensor, num_classes: int, **options: Any) -> "Eraser":
        """Fit on flattened float data x (n, d) and int64 labels y (n,)."""

    @abstractmethod
    def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
        """Erase flattened data (n, d); ``y`` is given iff ``requires_labels``."""

    def __call__(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """Erase x (n, ...); ``y`` (n,) for erasers that map each class differently. Every value is
        checked first (finite features, labels in range)."""
        check_features(x)
        if y is not None:
            check_labels(y, x.shape[0], self.metadata().get("num_classes"))
        return self.erase_checked(x, y)

    def erase_checked(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """``self(x, y)`` without the checks that read values, for batches of data that passed them
        once (e.g. augmented training batches): on a GPU each such read stalls the host. Labels
        must be integers in [0, num_classes): out of range, a GPU fails with a device-side assert."""
        check_feature_shape(x)
        if self.requires_labels and y is None:
            raise ValueError(
                f"the {self.name!r} eraser maps each class differently and needs labels: "
                f"call eraser(x, y), or predict labels first (eval_labels=predicted)"
            )
        if y is not None and tuple(y.shape) != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},) to match x, got {tuple(y.shape)}")
        if y is not None and (y.is_floating_point() or y.dtype == torch.bool):
            raise TypeError(f"y must hold integer class indices, got {y.dtype}")
        flat = x.reshape(x.shape[0], -1)
        dim = self.metadata().get("dim")
        if dim is not None and flat.shape[1] != dim:
            raise ValueError(
                f"the {self.name!r} eraser was fitted on {dim} features, got {flat.shape[1]} "
                f"(input shape {tuple(x.shape)})"
            )
        if self.input_shift is not None and self.input_scale is not None:
            shift, scale = self.input_shift.to(flat.device), self.input_scale.to(flat.device)
            flat = ((flat.to(torch.float64) - shift) / scale).to(x.dtype)
        out = self._erase(flat, y if self.requires_labels else None)
        return out.to(x.dtype).reshape(x.shape)

    # --- self-assessment (read by the data module to warn when nothing was erased) -----------

    def targeted_gaps(self) -> tuple[str, ...]:
        """The ``erasure.diagnostics.moment_gaps`` keys this eraser is meant to shrink (none: a control)."""
        return ()

    def fit_gaps(self) -> tuple[dict[str, float], dict[str, float]] | None:
        """Moment gaps of the fitting data before and after, for erasers that measure them while fitting."""
        return None

    def tuning_hint(self) -> str:
        """What to change when the eraser did not shrink its targeted gaps."""
        return "check eraser.options"

    # --- persistence -------------------------------------------------------------------------

    def serialized(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """(CPU tensors, safetensors metadata) exactly as ``save`` writes them (``load_eraser`` reads them)."""
        header = {"eraser": self.name, "format_version": FORMAT_VERSION, "metadata": self.metadata()}
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors().items()}
        return tensors, {"header": json.dumps(header)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write tensors and metadata to one safetensors file, atomically (write then rename)."""
        tensors, metadata = self.serialized()
        return save_safetensors(path, tensors, metadata)


def save_safetensors(path: str | os.PathLike, tensors: dict[str, Tensor], metadata: dict[str, str]) -> Path:
    """One safetensors file, written atomically (erasure.files)."""
    from safetensors.torch import save_file

    return atomic_write(path, lambda tmp: save_file_as_oserror(save_file, tensors, str(tmp), metadata))


def save_file_as_oserror(save_file: Any, tensors: dict[str, Tensor], filename: str, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, its I/O failures raised as the OSError they are (it raises its own
    SafetensorError, "... No space left on device (os error 28)"), so callers report a full or read-only
    disk as one; anything else passes through."""
    try:
        save_file(tensors, filename, metadata=metadata)
    except Exception as err:
        match = re.search(r"\(os error (\d+)\)", str(err))
        if type(err).__name__ != "SafetensorError" or match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), filename) from err


def load_safetensors(path: str | os.PathLike, what: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(JSON header, tensors) of a file written by ``save_safetensors``; ``what`` names it in errors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no saved {what} at {path}")
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("header")
        if raw is None:
            raise ValueError(f"{path} is a safetensors file but not a saved {what} (no header)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return json.loads(raw), tensors


def load_eraser(path: str | os.PathLike) -> Eraser:
    """Inverse of ``Eraser.save``: rebuild the exact eraser (bit-identical outputs)."""
    header, tensors = load_safetensors(path, "eraser")
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has eraser format version {header.get('format_version')}, "
            f"this code reads {FORMAT_VERSION}; refit the eraser"
        )
    cls = eraser_class(header["eraser"])
    return cls(**tensors, **header["metadata"])


# Parameters of ``fit`` that say how a fit runs, not what it computes: not options (erasure.resumable)
RUN_PARAMETERS = ("progress",)


def eraser_options(cls: type[Eraser]) -> list[str]:
    """The options an eraser's ``fit`` takes: its keyword parameters after (x, y, num_classes), less RUN_PARAMETERS."""
    params = list(inspect.signature(cls.fit).parameters.values())[3:]
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds and p.name not in RUN_PARAMETERS]


def resumable(cls: type[Eraser]) -> bool:
    """Whether ``cls.fit`` can stop and resume (takes a ``progress``, erasure.resumable)."""
    return "progress" in inspect.signature(cls.fit).parameters


def check_options(cls: type[Eraser], options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(eraser_options(cls)))
    if unknown:
        raise ValueError(
            f"unknown {cls.name!r} eraser options {unknown}; it takes {eraser_options(cls) or 'no options'} "
            f"(set them under eraser.options)"
        )


def fit_eraser(
    name: str,
    x: Tensor,
    y: Tensor,
    num_classes: int | None = None,
    zscore: bool = False,
    progress: FitProgress | None = None,
    **options: Any,
) -> Eraser:
    """Fit the eraser registered as ``name`` on x (n, ...) and integer labels y (n,).

    ``zscore=True`` standardises every feature with the training statistics first (for any eraser;
    the output stays in z-score units, see erasure.preprocess); other options go to the eraser.
    ``progress`` (an erasure.resumable.FitProgress): where a ``resumable`` eraser's fit keeps its state, to
    resume from after a stop; the other erasers fit from the start.
    """
    cls = eraser_class(name)
    check_options(cls, options)
    if progress is not None and resumable(cls):
        options = {**options, "progress": progress}
    check_features(x)
    k = check_labels(y, x.shape[0], num_classes)
    if not isinstance(zscore, bool):
        raise TypeError(f"zscore must be true or false, got {zscore!r}")
    flat = x.reshape(x.shape[0], -1)
    if not zscore:
        return cls.fit(flat, y.long(), k, **options)
    from erasure.preprocess import Standardizer

    standardizer = Standardizer.fit(flat)
    eraser = cls.fit(standardizer(flat), y.long(), k, **options)
    return replace(eraser, input_shift=standardizer.shift, input_scale=standardizer.scale)
