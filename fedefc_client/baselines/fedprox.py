"""FedProx's local update (docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto")."""

from __future__ import annotations

from common.baselines.fedprox import FedProxSettings, proximal_term
from common.messages import FitReply

from ..job import LocalJob
from ..local_update import Update


def fedprox(job: LocalJob) -> Update:
    """Cross-entropy + mu/2 ||w - w_g||^2."""
    anchor, mu = job.anchor(), job.cfg.settings(FedProxSettings).mu
    stats = job.train(regularizer=lambda m: mu * proximal_term(m, anchor))
    return len(job.labels), {FitReply.LOSS: "cross-entropy+prox"}, stats
