"""FedProx (Li et al., MLSys 2020): local cross-entropy plus a proximal term
(docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto"): its setting here, the term in
:mod:`fedefc_client.baselines.fedprox` (Ditto uses the same term)."""

from __future__ import annotations

from pydantic import Field

from ..config import MethodSettings


class FedProxSettings(MethodSettings):
    """FedProx's key: the proximal coefficient mu (1e-5, the FedEFC reference code's)."""

    mu: float = Field(1e-5, ge=0.0, le=1e4)


