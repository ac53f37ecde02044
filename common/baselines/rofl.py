"""RoFL (Yang et al., IEEE Intelligent Systems 2022, arXiv 2012.01700;
docs/BASELINE-METHODS.md, "RoFL"): its settings, schedules and the server's centroid
aggregation here; the client's torch math (selection, loss, centroid update) in
:mod:`fedefc_client.baselines.rofl`.

Client, per batch (``features`` are the model's penultimate features):

1. keep the (1 - forget_rate) fraction of samples with the smallest cross-entropy
   (:func:`fedefc_client.baselines.rofl.small_loss_indices`);
2. for those, y~ = argmax_c cos(f_k[c], feature) (:func:`fedefc_client.baselines.rofl.nearest_centroid`); the
   label is kept where y~ = y, else replaced by the global-guided pseudo-label, from
   round T_pl on (:func:`fedefc_client.baselines.rofl.rofl_targets`);
3. loss = CE(targets) + lambda_cen * sum mask * ||feature - f_k[y]||^2
   + lambda_e * mean entropy (:func:`fedefc_client.baselines.rofl.rofl_loss`); the feature is NOT detached in the
   centroid term (the paper; the reimplementation detaches it, which removes the
   term's gradient: ``rofl-detach-centroid-feature=true`` reproduces that);
4. f_k[c] <- (1 - s^2) f_k[c] + s^2 f^[c], s = cos(f_k[c], f^[c]), f^[c] the mean
   feature of the kept samples labelled c (:func:`fedefc_client.baselines.rofl.update_centroids`).

Server, after each round: f_G[c] = sum_k cos(f_G[c], f_k[c]) f_k[c] / sum_k cos(...)
(:func:`aggregate_centroids`).

Schedules (1-based round t; the reference's 0-based epoch is t - 1): forget rate
linear from 0 to its final value over the first ``num_gradual`` rounds; lambda_cen =
lambda * t / T_pl up to T_pl, then lambda; pseudo-labels replace labels from round
T_pl + 1 (the reference's ``g_epoch >= T_pl``).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..config import MethodSettings

EPS = 1e-8


class RoFLSettings(MethodSettings):
    """RoFL's keys, with the reimplementation's defaults; ``rofl-detach-centroid-feature
    = true`` reproduces its no-gradient centroid term (module docstring, step 3)."""

    rofl_forget_rate: float = Field(0.2, ge=0.0, lt=1.0)
    rofl_num_gradual: int = Field(10, ge=1, le=100_000)
    rofl_t_pl: int = Field(100, ge=1, le=100_000)
    rofl_lambda_cen: float = Field(1.0, ge=0.0, le=1e4)
    rofl_lambda_e: float = Field(0.8, ge=0.0, le=1e4)
    rofl_detach_centroid_feature: bool = False

    def schedule(self, server_round: int) -> tuple[float, float, bool]:
        """(forget rate, lambda_cen, pseudo-labels active) of ``server_round``."""
        return (forget_rate(server_round, self.rofl_forget_rate, self.rofl_num_gradual),
                centroid_weight(server_round, self.rofl_lambda_cen, self.rofl_t_pl),
                uses_pseudo_labels(server_round, self.rofl_t_pl))


class RoFLMessages:
    """Everything RoFL exchanges beyond the model weights (docs/BASELINE-METHODS.md)."""

    # server -> client, fit config of every round from round 2 on (round 1 has no f_G)
    CENTROIDS = "rofl-centroids"  # bytes: .npy float32 K x D global centroids f_G
    # client -> server, fit metrics of every round
    LOCAL_CENTROIDS = "rofl-local-centroids"  # bytes: .npy float32 K x D local centroids f_k
    KEPT = "rofl-kept"  # int: small-loss sample visits over the local epochs
    AGREE = "rofl-agree"  # int: kept visits whose nearest centroid matched the label
    REPLACED = "rofl-replaced"  # int: local samples whose label was replaced at least once


def forget_rate(server_round: int, final: float, num_gradual: int) -> float:
    """The fraction of each batch left out in round ``server_round`` (1-based)."""
    if server_round > num_gradual:
        return final
    return float(np.linspace(0.0, final, num_gradual)[server_round - 1]) if num_gradual > 1 \
        else final


def centroid_weight(server_round: int, lambda_cen: float, t_pl: int) -> float:
    """lambda_cen(t) = lambda_cen * min(t, T_pl) / T_pl."""
    return lambda_cen * min(server_round, t_pl) / t_pl


def uses_pseudo_labels(server_round: int, t_pl: int) -> bool:
    return server_round > t_pl


def aggregate_centroids(global_centroids: np.ndarray | None,
                        local_centroids: list[np.ndarray]) -> np.ndarray:
    """The server's f_G update (module docstring), in float64.

    Round 1 has no f_G yet: f_G[c] is then the plain mean of the clients' non-zero
    f_k[c] (the reimplementation starts from a random f_G, whose cosine weights can
    sum to ~0). A class whose cosine weights do not sum to a positive number keeps its
    previous centroid (or 0)."""
    stack = np.stack([np.asarray(f, dtype=np.float64) for f in local_centroids])  # n x K x D
    norms = np.linalg.norm(stack, axis=2)  # n x K
    if global_centroids is None:
        held = (norms > 0).astype(np.float64)
        counts = held.sum(0)
        sums = np.einsum("nk,nkd->kd", held, stack)
        return np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], 0.0)
    g = np.asarray(global_centroids, dtype=np.float64)
    g_norm = np.linalg.norm(g, axis=1)  # K
    sim = np.einsum("kd,nkd->nk", g, stack) / np.maximum(norms * g_norm[None, :], EPS)
    den = sim.sum(0)
    num = np.einsum("nk,nkd->kd", sim, stack)
    return np.where(den[:, None] > 0, num / np.where(den > 0, den, 1.0)[:, None], g)
