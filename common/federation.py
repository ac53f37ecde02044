"""The federated data plan: which samples each client holds and their observed labels.

Built from the run config alone (docs/FEDEFC.md §1), so the ServerApp, every
simulated client and every SuperNode that is given ``partition-id`` derive the same
split: noise matrices per noise group (cleanlab), the Bernoulli-Dirichlet or IID
partition on the TRUE labels, then noisy labels for each group's samples. Cached
per process by :meth:`RunConfig.data_key`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .config import RunConfig
from .datasets import Dataset, load_dataset
from .noise import apply_noise, empirical_transition, noise_matrix
from .partition import bernoulli_dirichlet, iid
from .seeds import derive_seed


@dataclass(frozen=True)
class FederatedData:
    """Every client's sample indices into the train set, and the observed labels."""

    data: Dataset
    client_indices: list[np.ndarray]
    noisy_labels: np.ndarray  # observed label of every train sample
    true_labels: np.ndarray
    group_of_client: np.ndarray  # noise group of each client
    noise_matrices: list[np.ndarray]  # generating matrix of each group

    @property
    def realized_noise_rate(self) -> float:
        """Fraction of train labels that were flipped."""
        return float(np.mean(self.noisy_labels != self.true_labels))

    def client_noise_rate(self, cid: int) -> float:
        idx = self.client_indices[cid]
        return float(np.mean(self.noisy_labels[idx] != self.true_labels[idx])) if len(idx) else 0.0

    def client_true_transition(self, cid: int) -> np.ndarray:
        """The client's realized P(noisy=i | true=j) (simulation-only diagnostic truth)."""
        idx = self.client_indices[cid]
        return empirical_transition(self.noisy_labels[idx], self.true_labels[idx],
                                    self.data.num_classes)


_CACHE: dict[str, FederatedData] = {}
_LOCK = threading.Lock()


def federated_data(cfg: RunConfig) -> FederatedData:
    """The data plan of ``cfg``, computed at most once per process."""
    key = cfg.data_key()
    with _LOCK:
        if key not in _CACHE:
            data = load_dataset(cfg)
            _CACHE[key] = build_federated_data(data, cfg)
        return _CACHE[key]


def build_federated_data(data: Dataset, cfg: RunConfig) -> FederatedData:
    """Partition on true labels, then draw each noise group's observed labels."""
    true = data.train_y.numpy()
    k = data.num_classes
    if cfg.iid:
        parts = iid(len(true), cfg.num_clients, derive_seed(cfg.seed, "partition"))
    else:
        parts = bernoulli_dirichlet(true, cfg.num_clients, k, cfg.p, cfg.alpha_dir,
                                    derive_seed(cfg.seed, "partition"))
    prior = np.bincount(true, minlength=k) / len(true)
    groups = cfg.noise_group_list()
    group_of_client = np.arange(cfg.num_clients) * len(groups) // cfg.num_clients
    noisy = true.copy()
    matrices = []
    for g, grp in enumerate(groups):
        nm = noise_matrix(k, grp.rho, grp.zeta, prior, derive_seed(cfg.seed, "noise-matrix", g))
        matrices.append(nm)
        members = np.flatnonzero(group_of_client == g)
        idx = np.concatenate([parts[c] for c in members]) if len(members) else np.zeros(0, int)
        idx = np.sort(idx)
        noisy[idx] = apply_noise(true[idx], nm, derive_seed(cfg.seed, "noise-labels", g))
    return FederatedData(data=data, client_indices=parts, noisy_labels=noisy, true_labels=true,
                         group_of_client=group_of_client, noise_matrices=matrices)
