"""RoFL's centroid math, sample selection and loss (Yang et al., IEEE Intelligent Systems
2022, arXiv 2012.01700; docs/BASELINE-METHODS.md, "RoFL").

Client, per batch (``features`` are the model's penultimate features):

1. keep the (1 - forget_rate) fraction of samples with the smallest cross-entropy
   (:func:`small_loss_indices`);
2. for those, y~ = argmax_c cos(f_k[c], feature) (:func:`nearest_centroid`); the
   label is kept where y~ = y, else replaced by the global-guided pseudo-label, from
   round T_pl on (:func:`rofl_targets`);
3. loss = CE(targets) + lambda_cen * sum mask * ||feature - f_k[y]||^2
   + lambda_e * mean entropy (:func:`rofl_loss`); the feature is NOT detached in the
   centroid term (the paper; the reimplementation detaches it, which removes the
   term's gradient: ``rofl-detach-centroid-feature=true`` reproduces that);
4. f_k[c] <- (1 - s^2) f_k[c] + s^2 f^[c], s = cos(f_k[c], f^[c]), f^[c] the mean
   feature of the kept samples labelled c (:func:`update_centroids`).

Server, after each round: f_G[c] = sum_k cos(f_G[c], f_k[c]) f_k[c] / sum_k cos(...)
(:func:`aggregate_centroids`).

Schedules (1-based round t; the reference's 0-based epoch is t - 1): forget rate
linear from 0 to its final value over the first ``num_gradual`` rounds; lambda_cen =
lambda * t / T_pl up to T_pl, then lambda; pseudo-labels replace labels from round
T_pl + 1 (the reference's ``g_epoch >= T_pl``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
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


def small_loss_indices(losses: torch.Tensor, rate: float) -> torch.Tensor:
    """Indices of the max(1, int((1 - rate) n)) smallest losses (stable order)."""
    keep = max(1, int((1.0 - rate) * len(losses)))
    return torch.argsort(losses.detach(), stable=True)[:keep]


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of two equally shaped matrices (0 for a zero row)."""
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(EPS)


def nearest_centroid(features: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """argmax_c cos(centroids[c], feature) for every row of ``features``."""
    f = features / features.norm(dim=1, keepdim=True).clamp_min(EPS)
    c = centroids / centroids.norm(dim=1, keepdim=True).clamp_min(EPS)
    return (f @ c.T).argmax(1)


def rofl_targets(labels: torch.Tensor, agree: torch.Tensor, pseudo: torch.Tensor,
                 use_pseudo: bool) -> torch.Tensor:
    """The label where the nearest centroid agrees with it (or before T_pl), else the
    pseudo-label."""
    return labels if not use_pseudo else torch.where(agree, labels, pseudo)


def rofl_loss(logits: torch.Tensor, features: torch.Tensor, targets: torch.Tensor,
              labels: torch.Tensor, agree: torch.Tensor, centroids: torch.Tensor,
              lambda_cen: float, lambda_e: float, detach_features: bool = False
              ) -> torch.Tensor:
    """CE(logits, targets) + lambda_cen * sum agree * ||features - centroids[labels]||^2
    + lambda_e * mean entropy(softmax(logits)), over the kept samples; with
    ``detach_features`` the centroid term carries no gradient (the reimplementation)."""
    ce = F.cross_entropy(logits, targets)
    feats = features.detach() if detach_features else features
    dist = ((feats - centroids[labels]) ** 2).sum(1)
    cen = (agree.float() * dist).sum()
    log_p = torch.log_softmax(logits, dim=1)
    entropy = -(log_p.exp() * log_p).sum(1).mean()
    return ce + lambda_cen * cen + lambda_e * entropy


def class_means(features: torch.Tensor, labels: torch.Tensor,
                num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K x D class-mean features, K-bool mask of the classes present); absent rows 0."""
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype,
                       device=features.device).index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    return sums / counts.clamp_min(1).unsqueeze(1), counts > 0


def update_centroids(centroids: torch.Tensor, batch_means: torch.Tensor,
                     present: torch.Tensor) -> torch.Tensor:
    """f_k[c] <- (1 - s^2) f_k[c] + s^2 f^[c] for the present classes, s = cos(f_k[c], f^[c])."""
    s2 = (cosine(centroids, batch_means) ** 2).unsqueeze(1)
    moved = (1.0 - s2) * centroids + s2 * batch_means
    return torch.where(present.unsqueeze(1), moved, centroids)


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
