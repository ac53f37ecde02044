"""RoFL's local update (Yang et al., IEEE Intelligent Systems 2022; docs/BASELINE-METHODS.md,
"RoFL"; its schedules in :mod:`common.baselines.rofl`, its torch math below).

Each round the client takes global-guided pseudo-labels (argmax of the RECEIVED global
model on its data) and starts its local centroids f_k from the server's f_G (in
round 1, when there is no f_G yet, from the class means of the received model's
features). Per batch it keeps the small-loss samples, checks each against its nearest
centroid, trains with CE + centroid + entropy terms, and moves f_k toward the kept
samples' class means. It returns its weights and f_k.

Nothing persists on the client: pseudo-labels are recomputed from each round's global
model and f_k restarts from f_G every round (so ``context.state`` is not used).
Everything exchanged: :class:`RoFLMessages`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common.baselines.rofl import RoFLMessages as M
from common.baselines.rofl import EPS, RoFLSettings
from common.exchange import pack_array, unpack_array
from common.messages import FitReply
from common.training import make_optimizer, predict_logits_features

from ..job import LocalJob
from ..local_update import Update


def initial_centroids(job: LocalJob) -> torch.Tensor:
    """f_G from the server, or (round 1) the class means of the received model's
    features on the local data, by observed label (0 for an absent class)."""
    if M.CENTROIDS in job.config:
        return torch.as_tensor(unpack_array(job.config[M.CENTROIDS]), dtype=torch.float32,
                               device=job.device)
    _, features = predict_logits_features(job.model, job.local.x, job.transform,
                                          job.cfg.eval_batch_size)
    return class_means(features, job.local.y, job.local.data.num_classes)[0]


def rofl(job: LocalJob) -> Update:
    cfg, settings = job.cfg, job.cfg.settings(RoFLSettings)
    num_classes = job.local.data.num_classes
    pseudo = torch.as_tensor(job.probs.argmax(1), device=job.device)
    rate, lam_cen, use_pseudo = settings.schedule(job.server_round)
    f_k = initial_centroids(job)
    replaced = torch.zeros(len(job.labels), dtype=torch.bool, device=job.device)
    counts = {"kept": 0, "agree": 0}

    def batch_loss(model, xb, yb, idx):
        nonlocal f_k
        logits, features = model(xb, return_features=True)
        keep = small_loss_indices(F.cross_entropy(logits, yb, reduction="none"), rate)
        feats, labels = features[keep], yb[keep]
        agree = nearest_centroid(feats.detach(), f_k) == labels
        targets = rofl_targets(labels, agree, pseudo[idx[keep]], use_pseudo)
        loss = rofl_loss(logits[keep], feats, targets, labels, agree, f_k, lam_cen,
                         settings.rofl_lambda_e, settings.rofl_detach_centroid_feature)
        f_k = update_centroids(f_k, *class_means(feats.detach(), labels, num_classes))
        replaced[idx[keep][targets != labels]] = True
        counts["kept"] += len(keep)
        counts["agree"] += int(agree.sum())
        return loss, logits

    optimizer = make_optimizer(job.model, "sgd", cfg.lr, cfg.momentum, cfg.weight_decay)
    stats = job.train_batches(batch_loss, optimizer)
    metrics: dict = {FitReply.LOSS: "rofl",
                     M.LOCAL_CENTROIDS: pack_array(f_k.cpu().numpy().astype(np.float32))}
    if cfg.diagnostics:
        metrics.update({M.KEPT: counts["kept"], M.AGREE: counts["agree"],
                        M.REPLACED: int(replaced.sum())})
    return len(job.labels), metrics, stats


# -- its torch math (here, not in common/: the run-config schema imports no torch) --
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
