"""Training-loss options: plain cross-entropy, or cross-entropy plus spectral decoupling.

Spectral decoupling (SD; gradient-starvation thesis, Sec. 6.3.4, Eq. 6.3.17) penalises the
logits instead of the weights, lambda/2 ||y_hat||^2, which decouples the learning dynamics of
features so a fast one cannot starve slower ones of gradient. The regulariser enters only the
objective that is minimised: every number the MDL driver records (validation loss, early
stopping, code lengths, the training-loss curve) stays plain cross-entropy, so runs with and
without it are scored in the same units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

LOSSES = ("ce", "spectral_decoupling")


@dataclass(frozen=True)
class SpectralDecoupling:
    """Per example, lambda_y/2 * ||y_hat - gamma_y e_y||^2, averaged like the cross-entropy.

    Without the class lists this is Eq. 6.3.17 (lambda_c = lambda, gamma_c = 0). With them it is
    the per-class variant the thesis used on CelebA (Sec. 6.4.4, App. 4.5: lambda_0 = 0.088,
    gamma_0 = 0.44, lambda_1 = 0.012, gamma_1 = 2.5 for its single binary logit): an example of
    class c is penalised with lambda_c and pulled towards gamma_c. For K softmax logits (ours) the
    target is gamma_c on the example's own logit and 0 on the others; a shift of all logits would
    be invisible to the softmax, so this is the reading under which gamma_c means something.
    """

    lam: float = 0.0
    class_lambda: tuple[float, ...] | None = None
    class_gamma: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        values = [self.lam, *(self.class_lambda or ()), *(self.class_gamma or ())]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
            raise ValueError(
                f"spectral decoupling needs finite numbers, got lambda={self.lam!r}, "
                f"class_lambda={self.class_lambda!r}, class_gamma={self.class_gamma!r}"
            )
        if self.lam < 0 or any(v < 0 for v in self.class_lambda or ()):
            raise ValueError(f"loss.lambda={self.lam} and loss.class_lambda={self.class_lambda} must be >= 0")

    def check(self, num_classes: int) -> None:
        """Fail before training on per-class lists of the wrong length."""
        for key, values in (("class_lambda", self.class_lambda), ("class_gamma", self.class_gamma)):
            if values is not None and len(values) != num_classes:
                raise ValueError(
                    f"loss.{key} has {len(values)} values but the data has {num_classes} classes; "
                    f"give one per class, e.g. loss.{key}=[{','.join(['0.01'] * num_classes)}]"
                )


def spectral_penalty(logits: Tensor, targets: Tensor, sd: SpectralDecoupling) -> Tensor:
    """lambda_y/2 * ||logits - gamma_y e_y||^2 per example: logits (..., K), targets (...) -> (...)."""
    if sd.class_gamma is not None:
        gamma = _on_device(sd.class_gamma, logits.dtype, logits.device)[targets]
        logits = logits.scatter_add(-1, targets.unsqueeze(-1), -gamma.unsqueeze(-1))  # one_hot would read y on the host
    squared = logits.square().sum(-1)
    if sd.class_lambda is None:
        return 0.5 * sd.lam * squared
    lam = _on_device(sd.class_lambda, logits.dtype, logits.device)[targets]
    return 0.5 * lam * squared


@lru_cache(maxsize=16)
def _on_device(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Per-class values copied to the device once, not at every step (a copy from pageable host
    memory makes the host wait for the GPU's queue)."""
    return torch.tensor(values, dtype=dtype, device=device)


def loss_from_options(options: Mapping[str, Any] | None, num_classes: int | None = None) -> SpectralDecoupling | None:
    """The ``loss`` config group as a setting: None for plain cross-entropy (also for a config
    without the group, as a stored run's may be), a checked ``SpectralDecoupling`` otherwise."""
    options = dict(options or {"name": "ce"})
    name = options.pop("name", "ce")
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES} with loss=<name>")
    if name == "ce":
        if options:
            raise ValueError(f"loss=ce takes no options, got {sorted(options)}; use loss=spectral_decoupling")
        return None
    unknown = set(options) - {"lambda", "class_lambda", "class_gamma"}
    if unknown:
        raise ValueError(
            f"unknown spectral decoupling options {sorted(unknown)}; use lambda, class_lambda, class_gamma"
        )
    sd = SpectralDecoupling(
        options.get("lambda", 0.0), _tuple(options.get("class_lambda")), _tuple(options.get("class_gamma"))
    )
    if num_classes is not None:
        sd.check(num_classes)
    return sd


def _tuple(values: Sequence[float] | None) -> tuple[float, ...] | None:
    if values is not None and not isinstance(values, (list, tuple)):
        raise ValueError(f"per-class options are lists, one value per class, e.g. [0.1,0.2]; got {values!r}")
    return None if values is None else tuple(values)
