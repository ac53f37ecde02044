"""Forward correction (Patrini et al., CVPR 2017), FL-adapted: after prestopping each
client estimates T from the global model's predictions (docs/BASELINE-METHODS.md,
"Forward correction and confident learning")."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..config import MethodSettings


class ForwardCorrectionSettings(MethodSettings):
    """Forward correction's key: the percentile of its anchor-point estimator."""

    fc_percentile: float = Field(97.0, ge=0.0, le=100.0)


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
