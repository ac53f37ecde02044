"""Patrini et al.'s forward-correction estimator, FL-adapted (ALGORITHM.md section 5)."""

from __future__ import annotations

import numpy as np


def patrini_transition(probs: np.ndarray, percentile: float = 97.0) -> np.ndarray:
    """T with rows = true class: T[i, :] = mean prediction of the samples whose P[:, i]
    is at or above the ``percentile``-th percentile of P[:, i] (the reference code's
    filtered estimator). Rows sum to 1. The forward loss is -log((softmax(h) @ T)[noisy]),
    i.e. :func:`common.losses.forward_corrected_loss` with ``Q = T.T``.
    """
    probs = np.asarray(probs, dtype=float)
    k = probs.shape[1]
    t = np.eye(k)
    if len(probs) == 0:
        return t
    for i in range(k):
        # min(): interpolating between tied values can land one ulp above both of them
        cut = min(np.percentile(probs[:, i], percentile, method="linear"), probs[:, i].max())
        t[i] = probs[probs[:, i] >= cut].mean(axis=0)
    return t / t.sum(axis=1, keepdims=True)
