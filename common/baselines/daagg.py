"""FedNoRo's distance-aware aggregation (DaAgg; Wu et al., IJCAI 2023, section 3.4).

For the clients of one round with sample counts n_k and a detected clean/noisy split:
d_k = 0 for a clean client; for a noisy client, the smallest parameter distance
||w_k - w_c||_2 to any clean client of the round; then d <- d / max(d), and the
aggregation weights are proportional to n_k * exp(-d_k).

The distance is the Euclidean norm over all floating-point model state (the paper's
||.||); the reference code sums per-tensor norms instead (docs/BASELINE-METHODS.md,
"FedNoRo").
Integer state (BatchNorm's batch counters) is not a parameter and is skipped.
Without a clean client (or without a noisy one) in the round there is nothing to
measure: the weights are plain FedAvg's, n_k / sum(n).
"""

from __future__ import annotations

import numpy as np

Weights = list[np.ndarray]


def model_distance(a: Weights, b: Weights) -> float:
    """||a - b||_2 over every floating-point array of two models' state."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        if np.issubdtype(x.dtype, np.floating):
            total += float(np.sum((x.astype(np.float64) - y.astype(np.float64)) ** 2))
    return float(np.sqrt(total))


def daagg_distances(models: list[Weights], noisy: np.ndarray) -> np.ndarray:
    """Normalized d_k (module docstring); all zero when the round has no clean or no
    noisy client, or every noisy model equals a clean one."""
    noisy = np.asarray(noisy, dtype=bool)
    d = np.zeros(len(models))
    clean = np.flatnonzero(~noisy)
    if len(clean) == 0:
        return d
    for k in np.flatnonzero(noisy):
        d[k] = min(model_distance(models[k], models[c]) for c in clean)
    return d / d.max() if d.max() > 0 else d


def daagg_weights(sizes: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """Aggregation weights proportional to n_k * exp(-d_k), summing to 1."""
    w = np.asarray(sizes, dtype=np.float64) * np.exp(-np.asarray(distances, dtype=np.float64))
    return w / w.sum()


def weighted_average(models: list[Weights], coefficients: np.ndarray) -> Weights:
    """sum_k c_k * w_k per array, computed in float64 and cast back to each array's
    dtype (integer state rounded)."""
    out = []
    for arrays in zip(*models, strict=True):
        acc = sum(c * a.astype(np.float64) for c, a in zip(coefficients, arrays))
        ref = arrays[0].dtype
        out.append((np.rint(acc) if np.issubdtype(ref, np.integer) else acc).astype(ref))
    return out
