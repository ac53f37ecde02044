"""Client partitions as pure functions of (labels, parameters, seed) (docs/FEDEFC.md §1.3).

Bernoulli-Dirichlet (FedCorr's non-IID sampling), computed on the TRUE labels:
``Phi ~ Bernoulli(p)`` of shape N x K decides which classes a client holds (rows
without a class are redrawn, then columns without a holder); each class is then split
over its holders with Dirichlet(alpha * 1) shares, every sample drawn to one holder.
"""

from __future__ import annotations

import numpy as np


class PartitionError(ValueError):
    """The partition parameters cannot produce a valid split."""


def bernoulli_dirichlet(labels: np.ndarray, num_clients: int, num_classes: int, p: float,
                        alpha: float, seed: int) -> list[np.ndarray]:
    """Sample indices per client (sorted); every sample is assigned exactly once."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    phi = rng.binomial(1, p, size=(num_clients, num_classes))
    empty = phi.sum(axis=1) == 0
    while empty.any():
        phi[empty] = rng.binomial(1, p, size=(int(empty.sum()), num_classes))
        empty = phi.sum(axis=1) == 0
    # A class no client holds (likely with few clients: 0.5**N per class at p = 0.5) is
    # redrawn too. Adding holders empties no row, and a Phi that needs no redraw is
    # unchanged, as is everything drawn after it: every partition that was valid before
    # this redraw existed stays the same.
    unheld = phi.sum(axis=0) == 0
    while unheld.any():
        phi[:, unheld] = rng.binomial(1, p, size=(num_clients, int(unheld.sum())))
        unheld = phi.sum(axis=0) == 0
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in range(num_classes):
        idx = np.flatnonzero(labels == cls)
        holders = np.flatnonzero(phi[:, cls])
        if len(idx) == 0:
            continue
        shares = rng.dirichlet(np.full(len(holders), alpha))
        owner = rng.choice(holders, size=len(idx), p=shares)
        for k in holders:
            buckets[k].append(idx[owner == k])
    return [np.sort(np.concatenate(b)) if b else np.zeros(0, dtype=np.int64) for b in buckets]


def iid(num_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Equal-size random split (sizes differ by at most one)."""
    if num_clients > num_samples:
        raise PartitionError(
            f"num-clients={num_clients} exceeds the {num_samples} training samples"
        )
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]
