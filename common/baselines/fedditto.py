"""Ditto (Li et al., ICML 2021): a personalized model per client beside the global one
(docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto")."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..config import MethodSettings


class DittoMessages:
    """What Ditto's training replies add (docs/BASELINE-METHODS.md)."""

    PERSONAL_ACC = "personal-acc"  # float: v's label-weighted test accuracy (simulation)
    PERSONAL_UPDATES = "personal-updates"  # int: how often this client's v was trained


class DittoSettings(MethodSettings):
    """Ditto's key: lambda, the weight of the personal model's proximal term."""

    ditto_lambda: float = Field(0.1, ge=0.0, le=1e4)


def label_weighted_accuracy(per_class_accuracy: np.ndarray, labels: np.ndarray) -> float:
    """A model's per-class test accuracy weighted by a client's label distribution: its
    accuracy on test data distributed like that client's data."""
    share = np.bincount(labels, minlength=len(per_class_accuracy)) / len(labels)
    return float(share @ per_class_accuracy)
