"""Client-level and sample-level noise detectors of FedCorr and FedNoRo (plain NumPy).

Every detector is a two-component Gaussian mixture (scikit-learn), as in the papers
and their public code (docs/BASELINE-METHODS.md):

- FedCorr (Xu et al., CVPR 2022, section 3.2): on the clients' cumulative LID, the
  component with the larger mean holds the noisy clients
  (:func:`lid_noisy_clients`); on one client's per-sample losses, the fraction of
  samples in the larger-mean component is its estimated noise level
  (:func:`loss_noise_level`).
- FedNoRo (Wu et al., IJCAI 2023, section 3.2): on the clients' per-class mean losses
  under the warm-up global model (a missing class takes its column's minimum, each
  column min-max normalized, :func:`normalized_class_losses`), a mixture is fitted
  with nine seeds, the noisy component being the one with the larger summed mean, and
  the most frequent noisy set wins (:func:`fednoro_noisy_clients`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def _two_component_labels(x: np.ndarray, random_state: int) -> tuple[np.ndarray, np.ndarray]:
    """(component of each row, component means) of a 2-component mixture fitted to x."""
    # lazily: scikit-learn adds 0.9 s to the start of every ClientApp process (a SuperNode
    # starts one per message); only FedCorr's and FedNoRo's detectors fit mixtures
    from sklearn.mixture import GaussianMixture  # 0.9 s

    gmm = GaussianMixture(n_components=2, random_state=random_state).fit(x)
    return gmm.predict(x), gmm.means_


def lid_noisy_clients(lid_sums: np.ndarray, random_state: int) -> np.ndarray:
    """FedCorr: boolean mask of the clients in the higher-mean LID component.

    Fewer than two clients, or identical values, flag nobody (no mixture to fit)."""
    x = np.asarray(lid_sums, dtype=np.float64).reshape(-1, 1)
    if len(x) < 2 or np.ptp(x) == 0:
        return np.zeros(len(x), dtype=bool)
    labels, means = _two_component_labels(x, random_state)
    return labels == int(np.argmax(means[:, 0]))


def loss_noise_level(losses: np.ndarray, random_state: int) -> float:
    """FedCorr: fraction of a client's samples in the higher-mean per-sample-loss component."""
    x = np.asarray(losses, dtype=np.float64).reshape(-1, 1)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    labels, means = _two_component_labels(x, random_state)
    return float(np.mean(labels == int(np.argmax(means[:, 0]))))


def normalized_class_losses(per_class: np.ndarray) -> np.ndarray:
    """FedNoRo's detection features: clients x classes mean losses, NaN (class absent
    on that client) replaced by the column's minimum, then each column min-max scaled
    to [0, 1]. A column without any value, or a constant one, becomes 0."""
    m = np.array(per_class, dtype=np.float64)
    for j in range(m.shape[1]):
        col = m[:, j]
        seen = ~np.isnan(col)
        col[~seen] = col[seen].min() if seen.any() else 0.0
        span = col.max() - col.min()
        m[:, j] = (col - col.min()) / span if span > 0 else 0.0
    return m


def fednoro_noisy_clients(per_class: np.ndarray, votes: int = 9) -> np.ndarray:
    """FedNoRo: boolean mask of the noisy clients by a majority vote of ``votes``
    mixtures (random_state 0..votes-1) on :func:`normalized_class_losses`.

    Each mixture names a noisy set (the component whose mean vector has the larger
    sum); the set named most often wins, ties going to the lowest random_state."""
    m = normalized_class_losses(per_class)
    n = len(m)
    if n < 2 or np.ptp(m) == 0:
        return np.zeros(n, dtype=bool)
    sets = []
    for seed in range(votes):
        labels, means = _two_component_labels(m, seed)
        sets.append(frozenset(np.flatnonzero(labels == int(np.argmax(means.sum(1)))).tolist()))
    winner = Counter(sets).most_common(1)[0][0]
    mask = np.zeros(n, dtype=bool)
    mask[sorted(winner)] = True
    return mask
