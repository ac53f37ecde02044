"""FedNoRo's local losses and distillation schedule (Wu et al., IJCAI 2023;
docs/BASELINE-METHODS.md, "FedNoRo"): the settings, the label prior and the schedule
here; the two losses, torch's, in :mod:`fedefc_client.baselines.fednoro`.

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

from typing import Literal

import numpy as np
from pydantic import Field

from ..config import MethodSettings, RunConfig


class FedNoRoSettings(MethodSettings):
    """FedNoRo's keys, with the reference code's defaults (the optimizer excepted: the
    project's SGD unless ``fednoro-optimizer=adam``)."""

    fednoro_warmup: int = Field(10, ge=1, le=100_000)
    fednoro_kd_begin: int = Field(10, ge=0, le=100_000)
    fednoro_kd_end: int = Field(49, ge=0, le=100_000)
    fednoro_kd_weight: float = Field(0.8, ge=0.0, le=1.0)
    fednoro_temperature: float = Field(0.8, gt=0.0, le=100.0)
    fednoro_gmm_votes: int = Field(9, ge=1, le=1000)
    fednoro_optimizer: Literal["sgd", "adam"] = "sgd"
    fednoro_adam_lr: float = Field(3e-4, gt=0.0, le=10.0)
    fednoro_adam_weight_decay: float = Field(5e-4, ge=0.0, le=1.0)

    def check(self, cfg: RunConfig) -> None:
        if self.fednoro_warmup >= cfg.rounds:
            raise ValueError(
                f"fednoro-warmup={self.fednoro_warmup} is not below rounds={cfg.rounds}: the "
                "noisy-client detection would never run; lower fednoro-warmup or raise rounds"
            )

    def kd_weight(self, server_round: int) -> float:
        """The distillation weight w of ``server_round`` (:func:`distillation_weight`)."""
        return distillation_weight(server_round, self.fednoro_kd_begin, self.fednoro_kd_end,
                                   self.fednoro_kd_weight)


class FedNoRoMessages:
    """Everything FedNoRo exchanges beyond the model weights (docs/BASELINE-METHODS.md)."""

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
