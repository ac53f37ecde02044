"""FedProx (Li et al., MLSys 2020): local cross-entropy plus a proximal term
(docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto"). Ditto uses the same term."""

from __future__ import annotations

import torch
from pydantic import Field

from ..config import MethodSettings


class FedProxSettings(MethodSettings):
    """FedProx's key: the proximal coefficient mu (1e-5, the FedEFC reference code's)."""

    mu: float = Field(1e-5, ge=0.0, le=1e4)


def proximal_term(model: torch.nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """0.5 * ||w - w_anchor||^2 over the trainable parameters.

    ``anchor`` holds detached copies of the parameters, in ``model.parameters()`` order.
    """
    return 0.5 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
