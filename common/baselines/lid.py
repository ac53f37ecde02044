"""Local intrinsic dimension (LID), FedCorr's client-level noise signal.

FedCorr (Xu et al., CVPR 2022, section 3.2; docs/BASELINE-METHODS.md, "FedCorr")
measures, after local training, the LID of the local model's softmax outputs on the
client's own data with the maximum-likelihood estimator of Amsaleg et al. (2015):

    LID(x) = -( (1/k) * sum_{i=1..k} log(r_i(x) / r_k(x)) )^(-1)

where r_i(x) is the distance from x to its i-th nearest neighbour among the OTHER
points of the set. The client's LID is the mean over its points. Limits: a point whose
k-th neighbour is at distance 0 (k duplicates) has LID 0; a point with a duplicate
neighbour (some r_i = 0) also gets 0 (the log term is infinite); a point whose k
neighbours are all at one distance has no finite LID (NaN, left out of the mean).

Distances are computed from the coordinate differences (``torch.cdist`` without its
matrix-product shortcut), not as ||a||^2 + ||b||^2 - 2ab: that expansion cancels
catastrophically for near-duplicate points far from the origin (distances of 0 or
below, hence log 0).
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK_ROWS = 1024  # pairwise distances are computed this many rows at a time


def nearest_distances(points: np.ndarray, k: int) -> np.ndarray:
    """n x k distances from each point to its k nearest OTHER points, ascending."""
    x = torch.as_tensor(np.asarray(points, dtype=np.float64))
    n = len(x)
    if not 1 <= k < n:
        raise ValueError(f"k={k} nearest neighbours need at least k+1={k + 1} points; got {n}")
    out = np.empty((n, k))
    for start in range(0, n, CHUNK_ROWS):
        rows = slice(start, min(start + CHUNK_ROWS, n))
        d = torch.cdist(x[rows], x, compute_mode="donot_use_mm_for_euclid_dist").numpy()
        d[np.arange(d.shape[0]), np.arange(rows.start, rows.stop)] = np.inf  # not itself
        out[rows] = np.sort(np.partition(d, k - 1, axis=1)[:, :k], axis=1)
    return out


def lid_mle(points: np.ndarray, k: int = 20) -> np.ndarray:
    """Per-point LID (module docstring); ``k`` is lowered to n-1 for small sets."""
    n = len(points)
    if n < 2:
        return np.zeros(n)
    k = min(k, n - 1)
    r = nearest_distances(points, k)
    r_k = r[:, -1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        total = np.log(r_k / r).sum(axis=1)  # = -sum log(r_i / r_k) >= 0
        lid = k / total
    lid[total == 0] = np.nan
    lid[(r_k[:, 0] == 0) | ~np.isfinite(total)] = 0.0
    return lid


def client_lid(points: np.ndarray, k: int = 20) -> float:
    """A client's LID: the mean per-point LID of its softmax outputs (0 for no point)."""
    lids = lid_mle(points, k)
    finite = lids[~np.isnan(lids)]
    return float(np.mean(finite)) if len(finite) else 0.0
