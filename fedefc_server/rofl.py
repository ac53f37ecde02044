"""RoFL's server (Yang et al., IEEE Intelligent Systems 2022; docs/BASELINES.md; math
in :mod:`common.rofl`).

The server keeps the global class centroids f_G (K x D, D the model's feature width),
sends them to every sampled client from round 2 on, and after each round replaces
them by the cosine-weighted average of the clients' returned centroids (round 1: their
plain mean). The model is aggregated with the project's FedAvg.

Records per round: the forget rate, lambda_cen and whether pseudo-labels are active,
the clients' summed counts (kept samples, nearest-centroid agreement, replaced
labels), and how far f_G moved.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import FitRes, Parameters, Scalar
from flwr.server.client_proxy import ClientProxy

from common.exchange import pack_array, unpack_array
from common.rofl import (RoFLMessages as M, aggregate_centroids, centroid_weight, forget_rate,
                         uses_pseudo_labels)

from .noise_robust import NoiseRobustStrategy


class RoFLStrategy(NoiseRobustStrategy):
    """FedAvg plus RoFL's global class centroids."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.centroids: np.ndarray | None = None
        self._centroid_bytes: bytes | None = None  # f_G as sent, packed once per round

    def client_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        config = super().client_config(partition_id, server_round)
        if self._centroid_bytes is not None:
            config[M.CENTROIDS] = self._centroid_bytes
        return config

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        params, metrics = super().aggregate_fit(server_round, results, failures)
        replies = [(p, r.metrics) for p, r in self.accepted_replies()
                   if M.LOCAL_CENTROIDS in r.metrics]
        c = self.cfg
        info: dict[str, Any] = {
            "rofl_forget_rate": forget_rate(server_round, c.rofl_forget_rate, c.rofl_num_gradual),
            "rofl_lambda_cen": centroid_weight(server_round, c.rofl_lambda_cen, c.rofl_t_pl),
            "rofl_pseudo_labels": uses_pseudo_labels(server_round, c.rofl_t_pl)}
        for key in (M.KEPT, M.AGREE, M.REPLACED):
            if any(key in m for _, m in replies):
                info[key.replace("-", "_")] = int(sum(int(m.get(key, 0)) for _, m in replies))
        if info.get("rofl_kept"):
            info["rofl_agree_rate"] = info["rofl_agree"] / info["rofl_kept"]
        if replies and params is not None:  # a skipped round keeps f_G with the model
            new = aggregate_centroids(self.centroids, [unpack_array(m[M.LOCAL_CENTROIDS])
                                                       for _, m in replies])
            if self.centroids is not None:
                info["rofl_centroid_shift"] = float(np.linalg.norm(new - self.centroids, axis=1)
                                                    .mean())
            info["rofl_centroid_norm"] = float(np.linalg.norm(new, axis=1).mean())
            self._set_centroids(new)
        self.record(**info)
        return params, metrics

    def _set_centroids(self, centroids: np.ndarray) -> None:
        self.centroids = centroids
        self._centroid_bytes = pack_array(centroids.astype(np.float32))

    def server_state(self) -> dict[str, Any]:
        f_g = None if self.centroids is None else self.centroids.tolist()
        return {**super().server_state(), "rofl": {"centroids": f_g}}

    def load_server_state(self, state: dict[str, Any]) -> None:
        super().load_server_state(state)
        f_g = state["rofl"]["centroids"]
        if f_g is not None:
            self._set_centroids(np.array(f_g, dtype=np.float64))
