"""Confident learning's local update (docs/BASELINE-METHODS.md, "Forward correction and
confident learning"): FedAvg's until prestopping, then cross-entropy on the samples
cleanlab does not flag."""

from __future__ import annotations

import numpy as np

from common.baselines.confident_learning import ConfidentLearningMessages as M
from common.baselines.confident_learning import label_issue_mask
from common.messages import FitReply
from common.training import TrainStats

from ..job import LocalJob
from ..local_update import Update, fedavg


def confident_learning(job: LocalJob) -> Update:
    """After prestopping: drop cleanlab's label issues (recomputed each round), then CE;
    the sample count reported for aggregation is the kept count.

    Under secure aggregation the kept count would tell the server how many of this
    client's labels cleanlab flagged, in the clear: the reply counts the client's
    declared size instead (FedAvg's weight; docs/PRIVACY.md, "What leaves a node"), and
    ``kept`` / ``removed`` stay on the node (``secure_tail_mod``)."""
    if job.phase == 1:
        return fedavg(job)
    issues = label_issue_mask(job.labels, job.probs)
    trainable = job.trainable(np.ones_like(issues))  # less the validation share if held back
    keep = trainable & ~issues
    metrics = {FitReply.LOSS: "cross-entropy", M.KEPT: int(keep.sum()),
               M.REMOVED: int((trainable & issues).sum())}
    count = len(job.labels) if job.cfg.secure_aggregation else int(keep.sum())
    if not keep.any():
        return count, metrics, TrainStats(0.0, 0.0)
    return count, metrics, job.train(keep=keep)
