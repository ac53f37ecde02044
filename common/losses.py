"""Loss functions as plain torch functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-12


def forward_corrected_loss(logits: torch.Tensor, targets: torch.Tensor,
                           q: torch.Tensor) -> torch.Tensor:
    """Paper eq. (12) with ALGORITHM.md section 4.5 orientation.

    ``q_i = sum_j Q[i, j] softmax(h)_j`` estimates P(noisy=i | x); the loss is
    ``mean(-log(q[noisy] + 1e-12))``. With ``Q = I`` it equals cross-entropy.
    """
    noisy_probs = F.softmax(logits, dim=1) @ q.T
    picked = noisy_probs.gather(1, targets.view(-1, 1)).squeeze(1)
    return -(picked + EPS).log().mean()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy (phase 1 and FedAvg)."""
    return F.cross_entropy(logits, targets)


def proximal_term(model: torch.nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """0.5 * ||w - w_anchor||^2 over the trainable parameters (FedProx, Ditto).

    ``anchor`` holds detached copies of the parameters, in ``model.parameters()`` order.
    """
    return 0.5 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
