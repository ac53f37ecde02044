"""Loss functions as plain torch functions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-12
LOG_EPS = math.log(EPS)


def forward_corrected_loss(logits: torch.Tensor, targets: torch.Tensor,
                           q: torch.Tensor) -> torch.Tensor:
    """Paper eq. (12) with the orientation of docs/FEDEFC.md §4.5, in log space.

    ``q_i = sum_j Q[i, j] softmax(h)_j`` estimates P(noisy=i | x); the loss is
    ``mean(-log q[noisy])``, computed as ``log q_i = logsumexp_j(log_softmax(h)_j +
    log Q[i, j])`` (a zero entry of Q is -inf), so its gradient does not vanish when
    q is far below float precision: at a logit margin of 120 against the observed label
    it is cross-entropy's, where ``-log(q + 1e-12)`` gave none. With ``Q = I`` it
    equals cross-entropy. A sample whose observed label has a row of zeros in Q (no
    true class can produce it) contributes the constant ``-log(1e-12)``, as it did
    in the linear form.
    """
    rows = q[targets]  # n x K: Q[noisy_n, j]
    impossible = ~(rows > 0).any(dim=1)
    log_rows = torch.where(impossible.unsqueeze(1), torch.zeros_like(rows), rows.log())
    log_q = torch.logsumexp(F.log_softmax(logits, dim=1) + log_rows, dim=1)
    return -torch.where(impossible, torch.full_like(log_q, LOG_EPS), log_q).mean()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy (phase 1 and FedAvg)."""
    return F.cross_entropy(logits, targets)
