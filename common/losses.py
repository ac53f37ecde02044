"""Loss functions as plain torch functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-12


def forward_corrected_loss(logits: torch.Tensor, targets: torch.Tensor,
                           q: torch.Tensor) -> torch.Tensor:
    """Paper eq. (12) with the orientation of docs/FEDEFC.md §4.5.

    ``q_i = sum_j Q[i, j] softmax(h)_j`` estimates P(noisy=i | x); the loss is
    ``mean(-log(q[noisy] + 1e-12))``. With ``Q = I`` it equals cross-entropy.
    """
    noisy_probs = F.softmax(logits, dim=1) @ q.T
    picked = noisy_probs.gather(1, targets.view(-1, 1)).squeeze(1)
    return -(picked + EPS).log().mean()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy (phase 1 and FedAvg)."""
    return F.cross_entropy(logits, targets)
