"""FedNoRo's local losses and distillation schedule (Wu et al., IJCAI 2023; docs/BASELINES.md).

- Logit adjustment: CE(z + log pi, y), pi the client's observed label frequencies
  (log 0 = -inf for a class the client lacks, which then gets probability 0).
- Noisy clients after warm-up: w * KL(softmax(teacher / T) || log_softmax(z + log pi))
  + (1 - w) * NLL(log_softmax(z + log pi), y); the teacher is the received global
  model. As the reference, the -inf log-probabilities of absent classes are set to 0
  in both terms (the paper does not say how absent classes enter the KL).
- w ramps as a * exp(-5 (1 - r)^2), r = clip((t - begin) / (end - begin), 0, 1), with
  t the 0-based round (the reference's ``rnd``; this project's rounds are 1-based).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class FedNoRoMessages:
    """Everything FedNoRo exchanges beyond the model weights (docs/BASELINES.md)."""

    # server -> every client, once after warm-up: an extra fit message that trains nothing
    TASK = "fednoro-task"  # str: CLASS_LOSSES
    # client -> server, reply to it
    CLASS_LOSSES = "fednoro-class-losses"  # bytes: .npy float64 K-vector, NaN = class absent
    # server -> client, fit config of every round after warm-up
    NOISY = "fednoro-noisy"  # int 0 | 1: the client was detected noisy
    KD_WEIGHT = "fednoro-kd-weight"  # float: the distillation weight w of this round

    CLASS_LOSSES_TASK = "class-losses"


def log_prior(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """log of the client's label frequencies; -inf for a class it does not hold."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    with np.errstate(divide="ignore"):
        return np.log(counts / counts.sum())


def logit_adjusted_ce(logits: torch.Tensor, labels: torch.Tensor,
                      log_pi: torch.Tensor) -> torch.Tensor:
    """CE(z + log pi, y), mean over the batch."""
    return F.cross_entropy(logits + log_pi, labels)


def _adjusted_log_probs(logits: torch.Tensor, log_pi: torch.Tensor) -> torch.Tensor:
    log_pred = torch.log_softmax(logits + log_pi, dim=1)
    return torch.where(torch.isinf(log_pred), torch.zeros_like(log_pred), log_pred)


def distillation_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor,
                      log_pi: torch.Tensor, weight: float, temperature: float) -> torch.Tensor:
    """The noisy clients' loss (module docstring); KL averaged over the batch."""
    log_pred = _adjusted_log_probs(logits, log_pi)
    soft = torch.softmax(teacher_logits / temperature, dim=1)
    kl = F.kl_div(log_pred, soft, reduction="batchmean")
    return weight * kl + (1.0 - weight) * F.nll_loss(log_pred, labels)


def distillation_weight(server_round: int, begin: int, end: int, scale: float) -> float:
    """w of round ``server_round`` (1-based): scale * exp(-5 (1 - r)^2)."""
    t = server_round - 1
    r = 1.0 if end <= begin else float(np.clip((t - begin) / (end - begin), 0.0, 1.0))
    return float(scale * np.exp(-5.0 * (1.0 - r) ** 2))


def per_class_mean_loss(losses: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Mean per-sample loss of each class; NaN for a class without samples."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    sums = np.bincount(labels, weights=losses, minlength=num_classes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, np.nan)
