"""Confident learning's local update (docs/BASELINE-METHODS.md, "Forward correction and
confident learning"): FedAvg's until prestopping, then cross-entropy on the samples
cleanlab does not flag."""

from __future__ import annotations

import numpy as np

from common.baselines.confident_learning import label_issue_mask
from common.training import TrainStats

from ..job import LocalJob
from ..local_update import Update, fedavg


def confident_learning(job: LocalJob) -> Update:
    """After prestopping: drop cleanlab's label issues (recomputed each round), then CE;
    the sample count reported for aggregation is the kept count."""
    if job.phase == 1:
        return fedavg(job)
    issues = label_issue_mask(job.labels, job.probs)
    keep = job.trainable(~issues)  # less the validation share if it is held back
    metrics = {"loss": "cross-entropy", "kept": int(keep.sum()),
               "removed": int((issues & job.trainable(np.ones_like(issues))).sum())}
    if not keep.any():
        return 0, metrics, TrainStats(0.0, 0.0)
    return int(keep.sum()), metrics, job.train(keep=keep)
