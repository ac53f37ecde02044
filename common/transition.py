"""FedEFC's noise transition matrix from a client's predictions (docs/FEDEFC.md §4).

All functions are plain NumPy on ``probs`` (n x K softmax of the received global
model) and ``labels`` (the client's observed labels). Orientation everywhere:
rows = observed label i, columns = true label j, so ``Q[i, j] ~ P(noisy=i | true=j)``.
"""

from __future__ import annotations

import numpy as np

COUNT_RULES = ("cleanlab", "cleanlab-present", "masked", "paper")
# cleanlab's fuzzy comparison (cleanlab.internal.constants.FLOATING_POINT_COMPARISON).
TOLERANCE = 1e-6
# cleanlab's floor on thresholds (CONFIDENT_THRESHOLDS_LOWER_BOUND), so a class the
# model gives ~0 probability everywhere does not count every sample.
THRESHOLD_FLOOR = 2 * TOLERANCE


def class_thresholds(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Paper eq. (5): tau_j = mean of P[n, j] over samples labelled j; +inf if none."""
    k = probs.shape[1]
    counts = np.bincount(labels, minlength=k)
    sums = np.zeros(k)
    np.add.at(sums, labels, probs[np.arange(len(labels)), labels])
    tau = np.full(k, np.inf)
    seen = counts > 0
    tau[seen] = sums[seen] / counts[seen]
    return np.maximum(tau, THRESHOLD_FLOOR)


def count_matrix(probs: np.ndarray, labels: np.ndarray, rule: str = "cleanlab") -> np.ndarray:
    """Paper eq. (4): C[i, j] = #samples labelled i whose P[., j] meets tau_j.

    ``rule`` decides a sample that meets two or more thresholds (docs/FEDEFC.md §4.2):
    ``cleanlab`` counts it at the argmax over all classes (cleanlab's confident joint,
    calibrate=False), ``cleanlab-present`` at the argmax over the classes with a local
    label (so a class the client does not hold is never counted), ``masked`` at the
    argmax among the classes that met their threshold, ``paper`` in every such column.
    Diagonal entries are raised to >= 1.
    """
    probs = np.asarray(probs, dtype=float)
    labels = np.asarray(labels, dtype=np.int64)
    k = probs.shape[1]
    tau = class_thresholds(probs, labels)
    confident = probs >= tau - TOLERANCE
    counts = np.zeros((k, k), dtype=np.int64)
    if rule == "paper":
        np.add.at(counts, labels, confident.astype(np.int64))
    elif rule in ("cleanlab", "cleanlab-present", "masked"):
        n_conf = confident.sum(axis=1)
        if rule == "cleanlab":
            several = probs.argmax(axis=1)
        elif rule == "cleanlab-present":
            several = np.where(np.isfinite(tau), probs, -np.inf).argmax(axis=1)
        else:
            several = np.where(confident, probs, -np.inf).argmax(axis=1)
        guess = np.where(n_conf > 1, several, confident.argmax(axis=1))
        keep = n_conf > 0
        np.add.at(counts, (labels[keep], guess[keep]), 1)
    else:
        raise ValueError(f"count-rule={rule!r} is unknown; use one of {COUNT_RULES}")
    np.fill_diagonal(counts, np.maximum(counts.diagonal(), 1))
    return counts


def label_prior_weighting(counts: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """docs/FEDEFC.md §4.4: rescale row i of C to sum to p~_i, the local fraction labelled i."""
    k = counts.shape[0]
    prior = np.bincount(np.asarray(labels, dtype=np.int64), minlength=k) / max(len(labels), 1)
    rows = counts.sum(axis=1, keepdims=True).astype(float)
    return prior[:, None] * counts / np.where(rows > 0, rows, 1.0)


def column_normalize(counts: np.ndarray) -> np.ndarray:
    """docs/FEDEFC.md §4.3: Q[i, j] = C[i, j] / sum_i' C[i', j]; an all-zero column gives e_j."""
    counts = np.asarray(counts, dtype=float)
    cols = counts.sum(axis=0)
    q = np.eye(counts.shape[0])
    seen = cols > 0
    q[:, seen] = counts[:, seen] / cols[seen]
    return q


def estimate_transition(probs: np.ndarray, labels: np.ndarray, rule: str = "cleanlab",
                        weighting: str = "none") -> np.ndarray:
    """The client's Q (paper eq. (6), columns normalized; optional label-prior weighting)."""
    return transition_from_counts(count_matrix(probs, labels, rule), labels, weighting)


def transition_from_counts(counts: np.ndarray, labels: np.ndarray,
                           weighting: str = "none") -> np.ndarray:
    """Q from a count matrix (one round's, or several rounds' summed: docs/FEDEFC.md §4.7),
    its columns normalized after the optional label-prior weighting by ``labels``."""
    if weighting == "label-prior":
        return column_normalize(label_prior_weighting(counts, labels))
    if weighting != "none":
        raise ValueError(f"weighting={weighting!r} is unknown; use 'none' or 'label-prior'")
    return column_normalize(counts)


def shrink_to_identity(q: np.ndarray, evidence: np.ndarray) -> np.ndarray:
    """docs/FEDEFC.md §4.8: each column of Q pulled towards the identity's column e_j as
    far as its evidence is thin, by the James-Stein shrinkage of cell frequencies
    (Hausser and Strimmer, JMLR 2009, eq. 8)::

        lambda_j = (1 - sum_i Q[i, j]**2) / ((n_j - 1) * sum_i (delta_ij - Q[i, j])**2)
        Q*[:, j] = lambda_j * e_j + (1 - lambda_j) * Q[:, j],  lambda_j clipped to [0, 1]

    ``evidence[j]`` = n_j, the number of samples counted in column j. lambda_j estimates
    the share of the column's mean squared error that is sampling noise: a column of one
    sample (or none) is e_j, a column of many samples keeps its counted frequencies, and
    a column that already is e_j stays so. Columns still sum to 1."""
    q = np.asarray(q, dtype=float)
    k = q.shape[0]
    eye = np.eye(k)
    n = np.asarray(evidence, dtype=float)
    spread = ((eye - q) ** 2).sum(axis=0)  # sum_i (delta_ij - Q[i, j])**2
    noise = 1.0 - (q ** 2).sum(axis=0)
    weak = (n <= 1) | (spread == 0)
    lam = np.ones(k)
    lam[~weak] = noise[~weak] / ((n[~weak] - 1) * spread[~weak])
    lam = np.clip(lam, 0.0, 1.0)
    return lam * eye + (1.0 - lam) * q


def cross_fitted_accuracy(probs: np.ndarray, labels: np.ndarray, rule: str = "cleanlab",
                          weighting: str = "none", shrunk: bool = True) -> float:
    """The phase-2 guard's score with ``guard-score = "cross-fit"`` (docs/FEDEFC.md §3.4):
    how well a model's predictions tell the observed labels, read through a Q counted on
    OTHER samples. The samples split in two halves (even and odd positions); each half is
    read through the Q counted on the other half's predictions and labels as phase 2
    counts it (paper eqs. (4)-(6); each column shrunk towards the identity by its
    evidence when ``shrunk``, §4.8), a sample's predicted observed label being the argmax
    of ``Q p`` (eq. (12)'s implied P(noisy | x)). The fraction of all samples predicted
    right; with fewer than two samples, the plain accuracy. The same score for a model
    trained with cross-entropy or with the correction, so the two compare."""
    probs = np.asarray(probs, dtype=float)
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if n < 2:
        return float(np.mean(probs.argmax(axis=1) == labels)) if n else 0.0
    halves = (np.arange(0, n, 2), np.arange(1, n, 2))
    right = 0
    for scored, counted in (halves, halves[::-1]):
        counts = count_matrix(probs[counted], labels[counted], rule)
        q = transition_from_counts(counts, labels[counted], weighting)
        if shrunk:
            q = shrink_to_identity(q, counts.sum(axis=0))
        right += int(np.sum((probs[scored] @ q.T).argmax(axis=1) == labels[scored]))
    return right / n


def matrix_agreement(estimate: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """Cosine similarity of the flattened matrices and their L1 distance (docs/FEDEFC.md §5)."""
    a, b = np.ravel(estimate), np.ravel(truth)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return cos, float(np.abs(a - b).sum())
