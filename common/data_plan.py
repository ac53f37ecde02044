"""The federated data plan: which samples each client holds and their observed labels.

Built from the run config alone (docs/FEDEFC.md §1), so the ServerApp, every
simulated client and every SuperNode that is given ``partition-id`` derive the same
split: noise matrices per noise group (cleanlab), the Bernoulli-Dirichlet or IID
partition on the TRUE labels, then noisy labels for each group's samples. The noise
derives from ``noise-seed`` (default: ``seed``); ``noise-draw = "reference"`` draws it
as the authors' reference code does (one matrix and one labelling of the whole training
set, seed 42 unless ``noise-seed`` is given).

Cached per process by :meth:`RunConfig.data_key`, and on disk (:func:`plan_cache_dir`):
the processes of a simulation (the launcher's preflight, the ServerApp, every Ray actor)
compute the plan once and load it after, so only the first imports cleanlab (0.9 s and
90 MB per process; docs/BENCHMARKS.md, "Memory"). An entry's key hashes the data keys,
the true labels it was built on and the code that builds it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field, replace
from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.common.logger import log

from . import noise, partition
from .config import RunConfig
from .data_files import DatasetError
from .datasets import Dataset, load_dataset
from .disk_cache import Arrays, DataCache
from .noise import apply_noise, empirical_transition, noise_matrix, reference_noise
from .partition import bernoulli_dirichlet, iid
from .sample_roles import training_size
from .seeds import derive_seed

REFERENCE_SEED = 42  # the reference code's noise seed, the same for every trial


@dataclass(frozen=True)
class DataPlan:
    """Every client's sample indices into the train set, and the observed labels."""

    data: Dataset
    client_indices: list[np.ndarray]
    noisy_labels: np.ndarray  # observed label of every train sample
    true_labels: np.ndarray
    group_of_client: np.ndarray  # noise group of each client
    noise_matrices: list[np.ndarray]  # generating matrix of each group
    # the coordinator's clean validation set drawn from the pool (clean-validation-per-class:
    # docs/FEDEFC.md §3.9), taken out of the clients' indices; read with its true labels
    coordinator_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

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


_CACHE: dict[str, DataPlan] = {}
_LOCK = threading.Lock()


def plan_cache_dir() -> Path:
    """Where simulations keep their data plans: ``$FEDEFC_CACHE_DIR/plans``, by default
    ``~/.cache/fedefc/plans`` (about 1 MB per plan of 60,000 samples)."""
    root = os.environ.get("FEDEFC_CACHE_DIR") or Path.home() / ".cache" / "fedefc"
    return Path(root) / "plans"


def data_plan(cfg: RunConfig) -> DataPlan:
    """The data plan of ``cfg``: from this process's cache, else from the disk cache,
    else built (and stored for the run's other processes)."""
    key = cfg.data_key()
    with _LOCK:
        if key not in _CACHE:
            data = load_dataset(cfg)
            _CACHE[key] = _cached_plan(data, cfg)
        return _CACHE[key]


def _plan_key(data: Dataset, cfg: RunConfig) -> str:
    digest = hashlib.sha256(cfg.data_key().encode())
    digest.update(np.ascontiguousarray(data.train_y.numpy()).tobytes())
    for module in (noise, partition):  # the code that builds a plan
        digest.update(Path(module.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return f"plan-{digest.hexdigest()[:24]}"


def _cached_plan(data: Dataset, cfg: RunConfig) -> DataPlan:
    cache, key = DataCache(plan_cache_dir()), _plan_key(data, cfg)
    arrays = cache.load(key)
    if arrays is not None:
        return _plan_from_arrays(data, arrays)
    fed = build_data_plan(data, cfg)
    try:
        cache.store(key, _plan_arrays(fed))
    except OSError as err:  # an unwritable cache only costs the other processes time
        log(WARNING, "data plan not cached (%s); each process builds its own", err)
    return fed


def _plan_arrays(fed: DataPlan) -> Arrays:
    sizes = np.array([len(ix) for ix in fed.client_indices], dtype=np.int64)
    return {"indices": np.concatenate(fed.client_indices).astype(np.int64), "sizes": sizes,
            "noisy_labels": fed.noisy_labels, "group_of_client": fed.group_of_client,
            "noise_matrices": np.stack(fed.noise_matrices),
            "coordinator_indices": fed.coordinator_indices.astype(np.int64)}


def _plan_from_arrays(data: Dataset, arrays: Arrays) -> DataPlan:
    bounds = np.cumsum(arrays["sizes"])[:-1]
    return DataPlan(data=data, client_indices=np.split(arrays["indices"], bounds),
                         noisy_labels=arrays["noisy_labels"], true_labels=data.train_y.numpy(),
                         group_of_client=arrays["group_of_client"],
                         noise_matrices=list(arrays["noise_matrices"]),
                         coordinator_indices=arrays["coordinator_indices"])


def secure_weight(cfg: RunConfig, plan: DataPlan | None) -> int | None:
    """M, the sample count that weighs 1 in every secure sum of the run (SecAgg+'s
    ``max_weight``): ``max-client-samples`` when set, else the largest training size of
    a partition in the data plan ``plan``; None with neither. A pure function of the run
    config (and its dataset), so a node derives the same M as the server and refuses a
    setup that weighs it by another (docs/THREAT-MODEL.md, "A dishonest server and the
    node"): a server that sent M = 10^12 to every node but one had the others' weights
    round to 0 and unmasked that node's update alone."""
    if cfg.max_client_samples:
        return cfg.max_client_samples
    if plan is None:
        return None
    return max(training_size(cfg, len(ix)) for ix in plan.client_indices)


def build_data_plan(data: Dataset, cfg: RunConfig) -> DataPlan:
    """Partition on true labels, then draw each noise group's observed labels; then the
    coordinator's clean validation set, if the run draws one (:func:`coordinator_draw`)."""
    fed = _partition_and_noise(data, cfg)
    if not cfg.clean_validation_per_class:
        return fed
    chosen = coordinator_draw(fed.true_labels, fed.client_indices,
                              cfg.clean_validation_per_class, data.num_classes, cfg.seed)
    return replace(fed, coordinator_indices=chosen,
                   client_indices=[ix[~np.isin(ix, chosen)] for ix in fed.client_indices])


def coordinator_draw(true: np.ndarray, parts: list[np.ndarray], per_class: int, k: int,
                     seed: int) -> np.ndarray:
    """The coordinator's clean validation set of a simulation (``clean-validation-per-class
    = per_class``, docs/FEDEFC.md §3.9): ``per_class`` samples of each TRUE class drawn
    without replacement from the samples the clients hold (seeded by ``seed``), sorted.
    The caller takes them out of the clients, so that no sample is both the coordinator's
    and a client's; the partition and every other sample's observed label stay those of
    the run without the set. Refused where a class has fewer than twice ``per_class``
    samples (the coordinator would hold more of it than all the clients)."""
    pool = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    rng = np.random.default_rng(derive_seed(seed, "clean-validation"))
    chosen = []
    for j in range(k):
        of_j = pool[true[pool] == j]
        if len(of_j) < 2 * per_class:
            raise DatasetError(
                f"clean-validation-per-class={per_class}: the clients hold {len(of_j)} "
                f"samples of class {j}, and the coordinator's set would take more than "
                f"half of them; lower clean-validation-per-class to at most {len(of_j) // 2}")
        chosen.append(rng.choice(of_j, size=per_class, replace=False))
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def _partition_and_noise(data: Dataset, cfg: RunConfig) -> DataPlan:
    """The clients' partition on true labels and each noise group's observed labels."""
    true = data.train_y.numpy()
    k = data.num_classes
    seed = derive_seed(cfg.seed, "partition")
    if cfg.iid:
        parts = iid(len(true), cfg.num_clients, seed)
    else:
        parts = bernoulli_dirichlet(true, cfg.num_clients, k, cfg.p, cfg.alpha_dir, seed)
    prior = np.bincount(true, minlength=k) / len(true)
    groups = cfg.noise_group_list()
    group_of_client = np.arange(cfg.num_clients) * len(groups) // cfg.num_clients
    noise_seed = cfg.seed if cfg.noise_seed < 0 else cfg.noise_seed
    if cfg.noise_draw == "reference":  # one group (checked by RunConfig)
        nm, noisy = reference_noise(true, k, cfg.rho, cfg.zeta, prior,
                                    REFERENCE_SEED if cfg.noise_seed < 0 else cfg.noise_seed)
        return DataPlan(data=data, client_indices=parts, noisy_labels=noisy,
                             true_labels=true, group_of_client=group_of_client,
                             noise_matrices=[nm])
    noisy = true.copy()
    matrices = []
    for g, grp in enumerate(groups):
        nm = noise_matrix(k, grp.rho, grp.zeta, prior, derive_seed(noise_seed, "noise-matrix", g))
        matrices.append(nm)
        members = np.flatnonzero(group_of_client == g)
        idx = np.concatenate([parts[c] for c in members]) if len(members) else np.zeros(0, int)
        idx = np.sort(idx)
        noisy[idx] = apply_noise(true[idx], nm, derive_seed(noise_seed, "noise-labels", g))
    return DataPlan(data=data, client_indices=parts, noisy_labels=noisy, true_labels=true,
                         group_of_client=group_of_client, noise_matrices=matrices)
