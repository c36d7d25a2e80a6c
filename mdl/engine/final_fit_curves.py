"""Accuracy (and loss) of the final model on extra evaluation sets after each of its epochs.

Used for the max-ent probes (datamodules.maxent_probes): the probe set next to the real
validation split, so the report can plot one against the other over the final fit. ``StackedProtocol`` calls it
for the final member with that member's evaluation weights at each of its epoch ends; it also sits in the
Trainer's callbacks so its curves are saved in (and restored from) every checkpoint. Evaluation draws no
random numbers and changes no state, so a run trains exactly as it would without it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from torch import Tensor

from datamodules.loader import EvalBatches

Weights = tuple[dict[str, Tensor], dict[str, Tensor]]


class FinalFitCurves(L.Callback):
    """Per epoch of the final fit, accuracy on every named set and mean loss (nats) on each set in
    ``with_loss``. results() gives ``<name>_accuracy_curve`` and ``<name>_loss_curve`` lists."""

    def __init__(
        self,
        sets: dict[str, tuple[Tensor, Tensor]],
        batch_size: int,
        with_loss: tuple[str, ...] = (),
        info: dict[str, Any] | None = None,
    ) -> None:
        self.sets = sets
        self.batch_size = batch_size
        self.with_loss = tuple(with_loss)
        self.info = dict(info or {})  # recorded beside the curves (e.g. how the probe set was drawn)
        self.curves: dict[str, list[float]] = {key: [] for key in self._keys()}

    def _keys(self) -> list[str]:
        return [f"{n}_accuracy_curve" for n in self.sets] + [
            f"{n}_loss_curve" for n in self.sets if n in self.with_loss
        ]

    def _batches(self, name: str) -> EvalBatches:
        x, y = self.sets[name]
        return EvalBatches(x, y, self.batch_size)

    # --- called by StackedProtocol for the final member -----------------------------------------

    def __call__(self, module: Any, weights: Weights) -> None:
        """``module`` a StackedClassifier, ``weights`` one member's evaluation weights (leading dim 1)."""
        for name in self.sets:
            total, count, correct = module.loss_sums(weights, self._batches(name), with_correct=True)
            self._record(name, int(correct[0]), float(total[0]) if name in self.with_loss else None, count)

    def _record(self, name: str, correct: int, loss_sum: float | None, count: int) -> None:
        self.curves[f"{name}_accuracy_curve"].append(correct / count if count else math.nan)
        if loss_sum is not None:
            self.curves[f"{name}_loss_curve"].append(loss_sum / count if count else math.nan)

    def results(self) -> dict[str, Any]:
        return {k: list(v) for k, v in self.curves.items()}

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"curves": {k: list(v) for k, v in self.curves.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves = {k: list(v) for k, v in state_dict["curves"].items()}
