"""Confident learning's local update (docs/BASELINE-METHODS.md, "Forward correction and
confident learning"): FedAvg's until prestopping, then cross-entropy on the samples
cleanlab does not flag."""

from __future__ import annotations

from common.baselines.confident_learning import ConfidentLearningMessages as M
from common.baselines.confident_learning import label_issue_mask
from common.messages import FitReply
from common.training import TrainStats

from ..job import LocalJob
from ..local_update import Update, fedavg


def confident_learning(job: LocalJob) -> Update:
    """After prestopping: drop cleanlab's label issues (recomputed each round), then CE;
    the sample count reported for aggregation is the kept count."""
    if job.phase == 1:
        return fedavg(job)
    keep = ~label_issue_mask(job.labels, job.probs)
    metrics = {FitReply.LOSS: "cross-entropy", M.KEPT: int(keep.sum()),
               M.REMOVED: int((~keep).sum())}
    if not keep.any():
        return 0, metrics, TrainStats(0.0, 0.0)
    return int(keep.sum()), metrics, job.train(keep=keep)
