"""FedProx's local update (docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto")."""

from __future__ import annotations

import torch

from common.baselines.fedprox import FedProxSettings
from common.messages import FitReply

from ..job import LocalJob
from ..local_update import Update


def fedprox(job: LocalJob) -> Update:
    """Cross-entropy + mu/2 ||w - w_g||^2."""
    anchor, mu = job.anchor(), job.cfg.settings(FedProxSettings).mu
    stats = job.train(regularizer=lambda m: mu * proximal_term(m, anchor))
    return len(job.labels), {FitReply.LOSS: "cross-entropy+prox"}, stats


# -- its torch math (here, not in common/: the run-config schema imports no torch) --
def proximal_term(model: torch.nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """0.5 * ||w - w_anchor||^2 over the trainable parameters.

    ``anchor`` holds detached copies of the parameters, in ``model.parameters()`` order.
    """
    return 0.5 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
