"""FedEFC's local update, and FedAvg's, which is FedEFC's phase 1.

A local update trains ``job.model`` (the received global model) in place and returns
``(num_examples, metrics, stats)``: the sample count the server weights the reply by,
the metrics the reply carries, and what training measured. The baselines' local
updates are in ``fedefc_client/baselines/``; ``common/methods.py: METHODS`` names them all.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from common.losses import forward_corrected_loss
from common.messages import FitReply
from common.training import TrainStats
from common.transition import (
    count_matrix,
    matrix_agreement,
    shrink_to_identity,
    transition_from_counts,
)

from .job import NOISE_MODEL, LocalJob
from .node_state import load_vector, save_vector

Update = tuple[int, dict, TrainStats]
POOLED_COUNTS = "fedefc-counts"  # context.state: the client's phase-2 count matrices, summed


def fedavg(job: LocalJob) -> Update:
    """Cross-entropy in every round (rho=0 gives 'FedAvg without noise')."""
    return len(job.labels), {FitReply.LOSS: "cross-entropy"}, job.train()


def train_forward_corrected(job: LocalJob, q: np.ndarray) -> Update:
    """Train with the forward-corrected loss for noise matrix ``q`` (rows = observed
    label, columns = true label; docs/FEDEFC.md §4.5). With ``diagnostics`` and the
    simulator's truth, the reply carries Q's cosine similarity and L1 distance to the
    client's true noise matrix (two scalars; docs/FEDEFC.md §5), never Q itself. Under
    the phase-2 guard, ``q`` stays in the node's state for the next round's signal
    (docs/FEDEFC.md §3.4)."""
    metrics: dict = {FitReply.LOSS: "forward-corrected"}
    job.last_q = q
    if job.cfg.guarded and job.state is not None:  # the guard's signal next round (§3.4)
        save_vector(job.state, NOISE_MODEL, np.asarray(q, dtype=np.float64).ravel())
    truth = job.local.true_transition
    if job.cfg.diagnostics and truth is not None:
        metrics[FitReply.Q_COS], metrics[FitReply.Q_L1] = matrix_agreement(q, truth)
    q_t = torch.as_tensor(q, dtype=torch.float32, device=job.device)
    return len(job.labels), metrics, job.train(partial(forward_corrected_loss, q=q_t))


def fedefc(job: LocalJob) -> Update:
    """Phase 1: cross-entropy. Phase 2: Q from the received global model's predictions
    (paper eqs. (4)-(6), docs/FEDEFC.md §4; on the validation share where the run keeps
    one out of training, §3.1; the counts summed over the client's phase-2 rounds with
    ``q-pooling = "cumulative"``, §4.7; each column shrunk towards the identity as far as
    this round's counts in it are few with ``q-estimator = "shrunk"``, §4.8) and the
    forward-corrected loss (eq. (12))."""
    if job.phase != 2:
        return fedavg(job)
    at = job.estimation_positions()
    counts = count_matrix(job.probs[at], job.labels[at], job.cfg.count_rule)
    evidence = counts.sum(axis=0)  # the samples behind each column (pooled rounds recount them)
    if job.cfg.q_pooling_mode == "cumulative":
        counts = pooled_counts(job.state, counts)
    q = transition_from_counts(counts, job.labels[at], job.cfg.weighting)
    if job.cfg.q_estimator_mode == "shrunk":
        q = shrink_to_identity(q, evidence)
    return train_forward_corrected(job, q)


def twin(job: LocalJob, q: np.ndarray | None) -> TrainStats:
    """The twin's local update (docs/FEDEFC.md §3.8), on all of the client's data:
    cross-entropy where the client's probe trained with it (``q`` None: phase 1, FedAvg's
    update), else the forward-corrected loss with the probe's Q of this round."""
    if q is None:
        return job.train()
    q_t = torch.as_tensor(q, dtype=torch.float32, device=job.device)
    return job.train(partial(forward_corrected_loss, q=q_t))


def pooled_counts(state, counts: np.ndarray) -> np.ndarray:
    """``q-pooling = "cumulative"`` (docs/FEDEFC.md §4.7): this round's count matrix plus
    the sum of the client's earlier phase-2 rounds', kept in the node's ``context.state``
    (K x K integers, nothing else); the new sum is stored for the next round."""
    k = counts.shape[0]
    before = load_vector(state, POOLED_COUNTS, k * k)
    total = counts if before is None else counts + before.reshape(k, k).astype(counts.dtype)
    save_vector(state, POOLED_COUNTS, total.ravel())
    return total
