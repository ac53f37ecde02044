"""Forward correction's local update (docs/BASELINE-METHODS.md, "Forward correction and
confident learning"): FedAvg's until prestopping, then FedEFC's loss with Patrini's T."""

from __future__ import annotations

from common.baselines.forward_correction import ForwardCorrectionSettings, patrini_transition

from ..job import LocalJob
from ..local_update import Update, fedavg, train_forward_corrected


def forward_correction(job: LocalJob) -> Update:
    """After prestopping: Patrini's estimator T (rows = true class), so Q = T^T."""
    if job.phase == 1:
        return fedavg(job)
    t = patrini_transition(job.probs[job.estimation_positions()],
                           job.cfg.settings(ForwardCorrectionSettings).fc_percentile)
    return train_forward_corrected(job, t.T)
