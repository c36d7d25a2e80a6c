"""Quadratic discriminant from class moments: labels for label-dependent erasers at eval time.

``eval_labels: predicted`` maps each validation/test example with the class this classifier
assigns (fitted on the training split's moments only), so no true label reaches evaluation.
Covariances are regularised by ``regularization * trace(Sigma_z) / d`` on the diagonal: image
classes have singular covariances (constant pixels), and an unregularised QDA would divide by 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from erasure import ClassMoments


@dataclass(frozen=True)
class QuadraticDiscriminant:
    means: Tensor  # (k, d) float64
    whiteners: Tensor  # (k, d, d): Sigma_z^{-1} = whiteners_z @ whiteners_z.T
    log_dets: Tensor  # (k,) log det Sigma_z (regularised)
    log_priors: Tensor  # (k,)

    @classmethod
    def from_moments(cls, moments: ClassMoments, regularization: float) -> "QuadraticDiscriminant":
        """The QDA of class moments: each class covariance ridged by ``regularization`` times its mean variance
        (class covariances are often singular: constant pixels, fewer examples than features), class priors from
        the class frequencies."""
        if regularization <= 0:
            raise ValueError(f"QDA regularization must be positive (covariances can be singular), got {regularization}")
        covs = moments.covariances()
        d = covs.shape[-1]
        scale = covs.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(covs.dtype).tiny) / d
        eye = torch.eye(d, dtype=covs.dtype, device=covs.device)
        covs = covs + regularization * scale[:, None, None] * eye
        eigvals, eigvecs = torch.linalg.eigh(covs)
        whiteners = eigvecs * eigvals.rsqrt().unsqueeze(-2)
        return cls(
            means=moments.means,
            whiteners=whiteners,
            log_dets=eigvals.log().sum(-1),
            log_priors=moments.weights.clamp_min(torch.finfo(covs.dtype).tiny).log(),
        )

    def log_posteriors(self, x: Tensor) -> Tensor:
        """Unnormalised log p(z | x), shape (n, k), computed in float64 on x's device."""
        flat = x.reshape(x.shape[0], -1).to(torch.float64)
        means = self.means.to(flat.device)
        whiteners = self.whiteners.to(flat.device)
        scores = []
        for z in range(means.shape[0]):
            white = (flat - means[z]) @ whiteners[z]
            scores.append(-0.5 * white.pow(2).sum(1))
        prior = (self.log_priors - 0.5 * self.log_dets).to(flat.device)
        return torch.stack(scores, 1) + prior

    def predict(self, x: Tensor, batch_size: int = 8192) -> Tensor:
        """Most probable class per example (int64, on x's device)."""
        out = [self.log_posteriors(x[i : i + batch_size]).argmax(1) for i in range(0, x.shape[0], batch_size)]
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=x.device)
