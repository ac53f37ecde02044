"""RoFL's server (Yang et al., IEEE Intelligent Systems 2022; docs/BASELINE-METHODS.md,
"RoFL"; math in :mod:`common.baselines.rofl`).

The server keeps the global class centroids f_G (K x D, D the model's feature width),
sends them to every sampled client from round 2 on, and after each round replaces
them by the cosine-weighted average of the clients' returned centroids (round 1: their
plain mean). The model is aggregated with the project's FedAvg.

A reply whose f_k is missing, undecodable, not a finite float K x D matrix of this
model's shape (:meth:`RoFLServer.check_metrics`), or whose counts are not integers >= 0
(its declared reply metrics, common/methods.py), is rejected like any invalid reply.

Records per round: the forget rate, lambda_cen and whether pseudo-labels are active,
the clients' summed counts (kept samples, nearest-centroid agreement, replaced
labels), and how far f_G moved.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import Parameters, Scalar

from common.baselines.rofl import RoFLMessages as M
from common.baselines.rofl import RoFLSettings, aggregate_centroids
from common.config import RunConfig
from common.exchange import pack_array, unpack_array
from common.models import ClassifierShape

from ..method_server import Aggregated
from .noise_robust import NoiseRobustServer


def bad_centroids(value: Any, shape: tuple[int, int]) -> str | None:
    """Why a reply's local centroids f_k are unusable (None: they are usable): they must
    be .npy bytes of a finite float matrix of ``shape`` (K classes x D features)."""
    try:
        f_k = unpack_array(value)
    except (TypeError, ValueError) as err:  # missing (None), not bytes, or not .npy
        return f"undecodable {M.LOCAL_CENTROIDS} ({type(err).__name__})"
    if f_k.shape != shape or f_k.dtype.kind != "f":
        return (f"{M.LOCAL_CENTROIDS} holds {f_k.dtype} of shape {f_k.shape}, expected "
                f"{shape} floats")
    if not np.isfinite(f_k).all():
        return f"{M.LOCAL_CENTROIDS} holds NaN or Inf"
    return None


class RoFLServer(NoiseRobustServer):
    """FedAvg plus RoFL's global class centroids."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        if model_shape.feature_dim is None:
            raise ValueError("RoFL's server needs the model's K and feature width "
                             "(model_shape with a feature_dim)")
        self.centroids: np.ndarray | None = None
        self._centroid_bytes: bytes | None = None  # f_G as sent, packed once per change

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        return {} if self._centroid_bytes is None else {M.CENTROIDS: self._centroid_bytes}

    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """Every RoFL reply's f_k (:func:`bad_centroids`, K x D of the model's
        features); its counts are checked as the method's declared reply metrics."""
        shape = (self.model_shape.num_classes, self.model_shape.feature_dim)
        return bad_centroids(metrics.get(M.LOCAL_CENTROIDS), shape)

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        replies = [(p, r.metrics) for p, r in result.replies]
        rate, lambda_cen, pseudo = self.cfg.settings(RoFLSettings).schedule(result.round)
        info: dict[str, Any] = {"rofl_forget_rate": rate, "rofl_lambda_cen": lambda_cen,
                                "rofl_pseudo_labels": pseudo}
        kept, agree = (sum(int(m.get(k, 0)) for _, m in replies) for k in (M.KEPT, M.AGREE))
        if kept:
            info["rofl_agree_rate"] = agree / kept
        if replies and result.parameters is not None:  # a skipped round keeps f_G too
            new = aggregate_centroids(self.centroids, [unpack_array(m[M.LOCAL_CENTROIDS])
                                                       for _, m in replies])
            if self.centroids is not None:
                info["rofl_centroid_shift"] = float(np.linalg.norm(new - self.centroids, axis=1)
                                                    .mean())
            info["rofl_centroid_norm"] = float(np.linalg.norm(new, axis=1).mean())
            self._set_centroids(new)
        return result.parameters, info

    def _set_centroids(self, centroids: np.ndarray) -> None:
        self.centroids = centroids
        self._centroid_bytes = pack_array(centroids.astype(np.float32))

    def state(self) -> dict[str, Any]:
        f_g = None if self.centroids is None else self.centroids.tolist()
        return {**super().state(), "rofl": {"centroids": f_g}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        f_g = state["rofl"]["centroids"]
        if f_g is not None:
            self._set_centroids(np.array(f_g, dtype=np.float64))
