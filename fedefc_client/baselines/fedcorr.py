"""FedCorr's local update (Xu et al., CVPR 2022; docs/BASELINE-METHODS.md, "FedCorr";
schedule in :mod:`common.baselines.fedcorr`).

A training message (every stage) trains with cross-entropy on the client's CURRENT
labels (observed, or corrected by earlier messages) plus, in stage 1,
beta * mu * ||w - w_g|| with the mu the server sent. After a stage-1 update the client
measures the trained local model on its data: the mean LID of its softmax outputs and
the share of samples in the high-loss component of a two-component mixture on the
per-sample cross-entropy (its noise-level estimate); it reports both scalars and
keeps the per-sample losses for a later correction.

A correction message (``fedcorr-task``; no training) relabels with the RECEIVED global
model: the highest-loss samples (stage 1) or every confident sample (after stage 2).

Kept in ``context.state``: the current labels (int16, one per sample) and the last
per-sample losses (float32). Everything exchanged: :class:`FedCorrMessages`.
"""

from __future__ import annotations

import numpy as np
import torch

from common.baselines.fedcorr import FedCorrMessages as M
from common.baselines.fedcorr import (
    FedCorrSettings,
    relabel_confident,
    relabel_highest_loss,
)
from common.baselines.lid import client_lid
from common.baselines.noisy_clients import loss_noise_level
from common.losses import cross_entropy
from common.messages import FitReply
from common.training import TrainStats, predict_logits

from ..job import LocalJob
from ..local_update import Update
from ..node_state import load_vector, save_vector

LABELS = "fedcorr-labels"
LOSSES = "fedcorr-losses"


def current_labels(job: LocalJob) -> np.ndarray:
    """The client's labels as corrected so far (the observed ones before any correction)."""
    stored = load_vector(job.state, LABELS, len(job.labels))
    return job.labels.copy() if stored is None else stored.astype(np.int64)


def fedcorr(job: LocalJob) -> Update:
    labels = current_labels(job)
    task = job.config.get(M.TASK)
    if task is not None:
        return _correct(job, labels, str(task))
    settings = job.cfg.settings(FedCorrSettings)
    coefficient = settings.fedcorr_beta * float(job.config.get(M.MU, 0.0))
    anchor = job.anchor()

    def prox(model):
        return coefficient * proximal_norm(model, anchor)
    stats = job.train(cross_entropy, regularizer=prox if coefficient > 0 else None,
                      labels=labels)
    metrics: dict = {FitReply.LOSS: ("cross-entropy+prox-norm" if coefficient > 0
                                     else "cross-entropy")}
    if int(job.config[M.STAGE]) == 1:
        logits = predict_logits(job.model, job.local.x, job.transform, job.cfg.eval_batch_size)
        log_p = torch.log_softmax(logits.double(), dim=1)
        y = torch.as_tensor(labels, device=job.device)
        losses = (-log_p[torch.arange(len(y)), y]).cpu().numpy()
        metrics[M.LID] = client_lid(log_p.exp().cpu().numpy(), settings.fedcorr_lid_k)
        metrics[M.EST_NOISE] = loss_noise_level(losses, job.cfg.seed)
        save_vector(job.state, LOSSES, losses.astype(np.float32))
    return len(labels), metrics, stats


def _correct(job: LocalJob, labels: np.ndarray, task: str) -> Update:
    """Relabel with the received global model's predictions ``job.probs``; train nothing."""
    threshold = job.cfg.settings(FedCorrSettings).fedcorr_confidence_thres
    if task == M.RELABEL_HIGHEST_LOSS:
        losses = load_vector(job.state, LOSSES, len(labels))
        if losses is None:
            raise ValueError(f"{M.TASK}={task!r}: this client holds no stage-1 losses; the "
                             "server may only correct clients that trained in stage 1")
        new = relabel_highest_loss(labels, losses, job.probs,
                                   float(job.config[M.RELABEL_FRACTION]), threshold)
    elif task == M.RELABEL_CONFIDENT:
        new = relabel_confident(labels, job.probs, threshold)
    else:
        raise ValueError(f"{M.TASK}={task!r} is unknown; expected {M.RELABEL_HIGHEST_LOSS!r} "
                         f"or {M.RELABEL_CONFIDENT!r}")
    save_vector(job.state, LABELS, new.astype(np.int16))
    metrics: dict = {FitReply.LOSS: "none (label correction)"}
    if job.cfg.diagnostics:
        metrics[M.RELABELLED] = int((new != labels).sum())
        metrics[M.CORRECTED] = int((new != job.labels).sum())
    return 0, metrics, TrainStats(0.0, 0.0)


# -- its torch math (here, not in common/: the run-config schema imports no torch) --
def proximal_norm(model: torch.nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """||w - w_g||_2 over the trainable parameters (FedCorr's UNsquared proximal term).

    At w = w_g the norm has no gradient; there the term is 0 with a zero (sub)gradient
    (the reference skips the first batch of every epoch instead)."""
    sq = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
    return sq.sqrt() if float(sq.detach()) > 0 else sq
