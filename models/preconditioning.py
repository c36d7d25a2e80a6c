"""The optimizer form of the covariance-power transform (preconditioning abstract).

Training on transformed inputs x A (A = c Sigma^{p/2}, symmetric; erasure.covariance_power) with
first-layer weights V is, through W = V A, training on the original inputs with the first layer's
gradient right-multiplied by P = A A = c^2 Sigma^p: exactly so for plain gradient descent
(tests/test_covariance_power.py runs both), and for Adam-like optimizers the same
preconditioner applied before their elementwise normalisation. ``PreconditionFirstLayer`` applies
P to the first layer's weight gradient before every optimizer step, in both kinds of fit (a stacked
weight (M, h, d) is multiplied member by member).
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor, nn


def first_layer_weight(model: nn.Module, in_features: int) -> str:
    """The name of the weight that reads the flattened input: the first 2-D parameter with ``in_features`` columns."""
    for name, p in model.named_parameters():
        if p.ndim == 2 and p.shape[1] == in_features:
            return name
        if p.ndim != 1:
            break
    raise ValueError(
        f"optimizer.precondition needs a model whose first layer is a Linear on the flattened input "
        f"({in_features} features), e.g. model=mlp; {type(model).__name__} starts otherwise"
    )


class PreconditionFirstLayer(L.Callback):
    """grad <- grad @ P for the first layer's weight, before each optimizer step."""

    def __init__(self, preconditioner: Tensor, name: str) -> None:
        self.preconditioner = preconditioner  # (d, d), symmetric, on the training device
        self.name = name

    def weight(self, pl_module: L.LightningModule) -> Tensor:
        return pl_module.stack.param_dict()[self.name]  # looked up each step: members leaving replace it

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        weight = self.weight(pl_module)
        if weight.grad is not None:
            weight.grad.copy_(weight.grad @ self.preconditioner.to(weight.grad.dtype))
