"""Local updates of FedEFC and the baselines of ALGORITHM.md section 5.

Each function trains ``job.model`` (the received global model) in place and returns
``(num_examples, metrics, stats)``. Phase 2 exists for every method (the server
reports T_e for all), but only fedefc, forward-correction and confident-learning act
on it, as in the paper.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord

from common.confident_learning import label_issue_mask
from common.forward_correction import patrini_transition
from common.losses import forward_corrected_loss, proximal_term
from common.runtime import model_for
from common.training import TrainStats, evaluate_per_class
from common.transition import estimate_transition, matrix_agreement

from .fedcorr import fedcorr
from .fednoro import fednoro
from .job import LocalJob
from .rofl import rofl

Update = tuple[int, dict, TrainStats]


def _forward(job: LocalJob, q: np.ndarray, metrics: dict) -> Update:
    """Train with the forward-corrected loss for noise matrix ``q`` (rows = observed)."""
    metrics["loss"] = "forward-corrected"
    job.last_q = q
    truth = job.local.true_transition
    if job.cfg.diagnostics and truth is not None:
        metrics["q-cos"], metrics["q-l1"] = matrix_agreement(q, truth)
    q_t = torch.as_tensor(q, dtype=torch.float32, device=job.device)
    return len(job.labels), metrics, job.train(partial(forward_corrected_loss, q=q_t))


def fedavg(job: LocalJob) -> Update:
    """Cross-entropy in every round (rho=0 gives 'FedAvg without noise')."""
    return len(job.labels), {"loss": "cross-entropy"}, job.train()


def fedefc(job: LocalJob) -> Update:
    """Phase 1: cross-entropy. Phase 2: Q from the global model's predictions (paper
    eqs. (4)-(6), ALGORITHM.md section 4) and the forward-corrected loss (eq. (12))."""
    if job.phase == 1:
        return fedavg(job)
    q = estimate_transition(job.probs, job.labels, job.cfg.count_rule, job.cfg.weighting)
    return _forward(job, q, {})  # nothing about Q leaves the client (q-cos: diagnostics only)


def forward_correction(job: LocalJob) -> Update:
    """After prestopping: Patrini's 97th-percentile estimator T (rows = true class)."""
    if job.phase == 1:
        return fedavg(job)
    t = patrini_transition(job.probs, job.cfg.fc_percentile)
    return _forward(job, t.T, {})


def confident_learning(job: LocalJob) -> Update:
    """After prestopping: drop cleanlab's label issues (recomputed each round), then CE;
    the sample count reported for aggregation is the kept count."""
    if job.phase == 1:
        return fedavg(job)
    keep = ~label_issue_mask(job.labels, job.probs)
    metrics = {"loss": "cross-entropy", "kept": int(keep.sum()), "removed": int((~keep).sum())}
    if not keep.any():
        return 0, metrics, TrainStats(0.0, 0.0)
    return int(keep.sum()), metrics, job.train(keep=keep)


def fedprox(job: LocalJob) -> Update:
    """Cross-entropy + mu/2 ||w - w_g||^2."""
    anchor, mu = job.anchor(), job.cfg.mu
    stats = job.train(regularizer=lambda m: mu * proximal_term(m, anchor))
    return len(job.labels), {"loss": "cross-entropy+prox"}, stats


DITTO_KEY = "ditto-personal"
DITTO_COUNT = "ditto-updates"


def fedditto(job: LocalJob) -> Update:
    """Ditto: the personalized model v (persistent in the node's context.state) trains
    with CE + lambda/2 ||v - w_g||^2; the global model trains as in FedAvg.

    Reports ``personal-acc``: v's accuracy on the clean test set, per class, weighted
    by this client's local label distribution (its share of the test distribution).
    """
    personal = model_for(job.cfg, job.local.data, job.device, slot="ditto")
    if DITTO_KEY in job.state:
        arrays = job.state[DITTO_KEY].to_torch_state_dict()
        personal.load_state_dict({k: v.to(job.device) for k, v in arrays.items()})
    else:
        personal.load_state_dict(job.model.state_dict())
    anchor, lam = job.anchor(), job.cfg.ditto_lambda
    job.train(regularizer=lambda m: lam * proximal_term(m, anchor), model=personal)
    job.state[DITTO_KEY] = ArrayRecord(
        torch_state_dict={k: v.detach().cpu() for k, v in personal.state_dict().items()})
    updates = int(job.state[DITTO_COUNT]["updates"]) + 1 if DITTO_COUNT in job.state else 1
    job.state[DITTO_COUNT] = ConfigRecord({"updates": updates})
    metrics = {"loss": "cross-entropy", "personal-updates": updates}
    test = job.local.test_split()
    if test is not None:
        per_class = evaluate_per_class(personal, *test, job.transform, job.cfg.eval_batch_size)
        share = np.bincount(job.labels, minlength=len(per_class)) / len(job.labels)
        metrics["personal-acc"] = float(share @ per_class)
    return len(job.labels), metrics, job.train()


METHODS: dict[str, Callable[[LocalJob], Update]] = {
    "fedefc": fedefc,
    "fedavg": fedavg,
    "fedprox": fedprox,
    "fedditto": fedditto,
    "forward-correction": forward_correction,
    "confident-learning": confident_learning,
    "fedcorr": fedcorr,  # noise-robust baselines: fedefc_client/{fedcorr,fednoro,rofl}.py
    "fednoro": fednoro,
    "rofl": rofl,
}
