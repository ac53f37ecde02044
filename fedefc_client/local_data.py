"""A client's local data: a partition of the run's dataset, or a node's own data, split
into the part it trains on and the part it holds out for federated evaluation.

Three sources, chosen by the node config (docs/DEPLOYMENT.md, "Node data"):

- simulation (``partition-id`` only): :func:`partition_data`, built from the process's
  shared dataset tensors and kept in memory, since a Ray actor serves many messages;
- a SuperNode with ``partition-id`` and ``cache-dir``: the same partition (same split,
  same noisy labels, as a pure function of the run config), stored on disk by
  :mod:`.cache` so that the ClientApp process of every later message loads it;
- a SuperNode with ``data-path``: the node's private data (:mod:`.private_data`),
  decoded once and cached the same way when ``cache-dir`` is set.

With federated evaluation (``evaluation = federated | both``) every client holds out
a seeded ``local-test-fraction`` of its samples (:func:`held_out_positions`, a pure
function of the seed and the partition id) and trains on the rest; the held-out part
only ever yields the global model's loss and accuracy on it (docs/OWN-DATA.md,
"Federated evaluation").

With the ``held-out`` accuracy signal (docs/FEDEFC.md §3.1) a client of a prestopping
method also sets aside a seeded ``validation-fraction`` of the part it trains on
(:func:`validation_positions`, a pure function of the seed and the partition id): the
received global model's accuracy on it is the client's A_k, and it is not trained on
in phase 1. It stays inside the training part, so the client's declared size, and the
count of its replies, are unchanged (``common/data_plan.py: training_size``). With
``validation-labels = "verified"`` (docs/FEDEFC.md §3.7) the share's labels are checked
ones: in a partition of the run's dataset the share carries its true labels, and a node's
own data names its checked samples in a ``verified`` array, which are then its share;
``estimation-share`` then also keeps a seeded part of the other samples out of training
(:func:`estimation_share_positions`), on which Q is counted.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from common.config import RunConfig
from common.data_files import class_map_fingerprint
from common.data_plan import data_plan, held_out_count, training_size, validation_count
from common.datasets import Dataset, DataSpec, make_spec, resolve_augment, task_shape
from common.disk_cache import Arrays, DataCache
from common.methods import validation_share
from common.models import TaskShape
from common.noise import empirical_transition
from common.runtime import on_device
from common.seeds import derive_seed

from .cache import partition_key, private_key
from .private_data import PrivateDataError, load_private_data

DATA_PATH_KEY = "data-path"
CACHE_DIR_KEY = "cache-dir"


@dataclass(frozen=True)
class HeldOut:
    """A client's held-out samples (on its device) and their observed labels; in
    simulation with synthetic noise also their true labels (a diagnostic)."""

    x: torch.Tensor
    y: torch.Tensor
    true_y: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class LocalData:
    """The samples a client trains on (on the training device) with their observed
    labels, the dataset they belong to (its spec; in simulation also its test split),
    and the held-out part (None without federated evaluation). ``validation`` holds
    the sorted positions in ``x`` of the validation share (None without one).

    ``true_transition`` and ``noise_rate`` exist only where the client's labels were
    noised by the federation itself (a partition of the run's dataset, where the true
    labels are known); they feed diagnostics and never leave the client as matrices.
    """

    x: torch.Tensor
    y: torch.Tensor
    labels: np.ndarray
    data: Dataset
    true_transition: np.ndarray | None = None
    noise_rate: float | None = None
    held_out: HeldOut | None = None
    validation: np.ndarray | None = None  # positions of the validation share in x
    estimation: np.ndarray | None = None  # positions of the estimation share in x (§3.7)
    class_map: str | None = None  # the fingerprint of its own data's class names, if any

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def spec(self) -> DataSpec:
        return self.data.spec

    def test_split(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dataset's clean test split on this device (None for private node data or
        a dataset without test set)."""
        if self.true_transition is None or not self.data.has_test_set:
            return None
        device = self.x.device
        return on_device(self.data, "test", device), self.data.test_y.to(device)


def held_out_positions(cfg: RunConfig, partition_id: int, n: int
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """(training positions, held-out positions) among a client's ``n`` samples, both
    sorted: round(local-test-fraction * n) held out (at most n - 1), drawn with a
    generator seeded by (seed, partition id); None without federated evaluation."""
    if not cfg.federated_evaluation:
        return None
    count = held_out_count(cfg, n)
    perm = np.random.default_rng(derive_seed(cfg.seed, "local-test", partition_id)
                                 ).permutation(n)
    return np.sort(perm[count:]), np.sort(perm[:count])


def validation_positions(cfg: RunConfig, partition_id: int, m: int,
                         num_classes: int) -> np.ndarray | None:
    """The sorted positions of the validation share among the ``m`` samples a client
    trains on (docs/FEDEFC.md §3.1): ``common/data_plan.py: validation_count`` of them,
    drawn with a generator seeded by (seed, partition id); None when the run has no
    share (``common/methods.py: validation_share``) or the client has fewer than 2
    samples."""
    share = validation_share(cfg)
    if share == 0.0 or m < 2:
        return None
    count = validation_count(share, cfg.validation_max_per_class * num_classes, m)
    perm = np.random.default_rng(derive_seed(cfg.seed, "validation", partition_id)
                                 ).permutation(m)
    return np.sort(perm[:count])


def guard_slice(validation: np.ndarray) -> np.ndarray:
    """The half of a validation share (sorted positions) that stays out of training in
    phase 2 with ``validation-phase-2 = "guard-slice"``: the phase-2 guard reads it and
    Q is counted on it (docs/FEDEFC.md §3.6): every second position, the first included
    (the share itself is a seeded draw, so its every second position is one too); all of a
    1-sample share."""
    return validation[::2]


def twin_data(local: LocalData, reads_slice: bool) -> LocalData:
    """The twin's view of a client's data (docs/FEDEFC.md §3.8): where the guard reads
    the clients (``reads_slice``), every sample but the guard slice of the validation
    share (:func:`guard_slice`), which the twin never trains on and is read on (the
    delivered model's guard signal, §3.4); else (the guard reads the coordinator's clean
    set, §3.9) every sample. The rest of the share, with its labels (checked ones where
    the share is verified, §3.7), and the estimation share are trained on."""
    keep = local.validation is not None and reads_slice
    return replace(local, validation=guard_slice(local.validation) if keep else None,
                   estimation=None)


def layout(cfg: RunConfig, partition_id: int, n: int, num_classes: int
           ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
    """How a client's ``n`` samples divide: the federated-evaluation split of
    :func:`held_out_positions` (None without one), then the validation share among the
    training part (:func:`validation_positions`, positions within that part)."""
    split = held_out_positions(cfg, partition_id, n)
    m = n if split is None else len(split[0])
    return split, validation_positions(cfg, partition_id, m, num_classes)


def checked_in_partition(cfg: RunConfig, partition_id: int, n: int,
                         num_classes: int) -> np.ndarray | None:
    """The mask, over a partition's ``n`` samples, of the share :func:`verified_share`
    gives true labels (placed by :func:`layout`); None unless the run has
    ``validation-labels = "verified"`` and a share. What ``fedefc deploy export`` marks
    ``verified``, so that a node holding the export has the simulation's share
    (docs/FEDEFC.md §3.7)."""
    split, share = layout(cfg, partition_id, n, num_classes)
    if cfg.validation_labels != "verified" or share is None:
        return None
    mask = np.zeros(n, dtype=bool)
    mask[(np.arange(n) if split is None else split[0])[share]] = True
    return mask


def estimation_share_positions(cfg: RunConfig, partition_id: int,
                               validation: np.ndarray | None,
                               m: int) -> np.ndarray | None:
    """The sorted positions of the estimation share among the ``m`` samples a client
    trains on (docs/FEDEFC.md §3.7): with verified labels and ``estimation-share`` > 0,
    round(estimation-share * r) of the r samples outside the verified share
    ``validation`` (at least 1, at most r - 1), drawn with a generator seeded by (seed,
    partition id); kept out of training, Q is counted on them. None otherwise."""
    if cfg.validation_labels != "verified" or not cfg.estimation_share or validation is None:
        return None
    rest = np.setdiff1d(np.arange(m), validation)
    if len(rest) < 2:
        return None
    count = validation_count(cfg.estimation_share, 0, len(rest))
    perm = np.random.default_rng(derive_seed(cfg.seed, "estimation", partition_id)
                                 ).permutation(len(rest))
    return np.sort(rest[perm[:count]])


def verified_share(cfg: RunConfig, share: np.ndarray | None, labels: np.ndarray,
                   true_labels: np.ndarray | None, verified: np.ndarray | None,
                   where: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(validation positions, labels) of a client's training part, given its seeded
    ``share`` (:func:`layout`; docs/FEDEFC.md §3.1, §3.7). Observed labels: the share,
    labels unchanged. Verified labels: the samples a ``verified`` mask names, where the
    data has one (a node's own data, labels as stored; a simulation of such a file, its
    checked labels put in place of the noised ones); else, in a partition of the run's
    dataset, the share with its true labels put in place of the observed ones (a
    simulated check of those samples)."""
    if cfg.validation_labels != "verified" or share is None:
        return share, labels
    if true_labels is not None and verified is None:
        checked = labels.copy()
        checked[share] = true_labels[share]
        return share, checked
    if verified is None or not verified.any():
        raise PrivateDataError(
            f"{where}: validation-labels=\"verified\" but the data names no verified "
            "sample; store a boolean array 'verified' beside 'labels' (True where the "
            "label was checked; docs/OWN-DATA.md, \"Verified labels\"), or set "
            "validation-labels=\"observed\"")
    positions = np.flatnonzero(verified)
    if len(positions) >= len(labels):
        raise PrivateDataError(
            f"{where}: all {len(labels)} samples it trains on are verified, so none is left "
            "to train on; mark only a sample of them verified (docs/OWN-DATA.md, "
            "\"Verified labels\")")
    if true_labels is not None:  # a simulation of a file that marks its checked samples
        labels = labels.copy()
        labels[positions] = true_labels[positions]
    return positions, labels


def make_local(cfg: RunConfig, partition_id: int, x: torch.Tensor, labels: np.ndarray,
               true_labels: np.ndarray | None, data: Dataset,
               verified: np.ndarray | None = None, where: str = "") -> LocalData:
    """LocalData from a client's samples (``x`` on the training device), split for
    federated evaluation, its validation share marked in the training part
    (:func:`verified_share`); with true labels, the diagnostics of the training part.
    ``verified`` marks a node's checked samples (its own data only)."""
    device = x.device
    held = None
    split, share = layout(cfg, partition_id, len(labels), data.num_classes)
    true_held = None
    if split is not None:
        train, out = split
        held_x = x.index_select(0, torch.as_tensor(out, device=device))
        if true_labels is not None:
            true_held = torch.as_tensor(true_labels[out], dtype=torch.int64).to(device)
            true_labels = true_labels[train]
        held = HeldOut(held_x, torch.as_tensor(labels[out], dtype=torch.int64).to(device),
                       true_held)
        x, labels = x.index_select(0, torch.as_tensor(train, device=device)), labels[train]
        verified = None if verified is None else verified[train]
    validation, labels = verified_share(cfg, share, labels, true_labels, verified, where)
    estimation = estimation_share_positions(cfg, partition_id, validation, len(labels))
    truth, rate = None, None
    if true_labels is not None:
        truth = empirical_transition(labels, true_labels, data.num_classes)
        rate = float(np.mean(labels != true_labels)) if len(labels) else 0.0
    return LocalData(x=x, y=torch.as_tensor(labels, dtype=torch.int64).to(device),
                     labels=labels, data=data, true_transition=truth, noise_rate=rate,
                     held_out=held, validation=validation, estimation=estimation)


_CACHE: dict[tuple, LocalData] = {}
_LOCK = threading.Lock()


def partition_data(cfg: RunConfig, partition_id: int, device: torch.device) -> LocalData:
    """Client ``partition_id`` of the run's federated data plan, cached per process."""
    key = (cfg.data_key(), cfg.evaluation_mode, cfg.local_test_fraction, validation_share(cfg),
           cfg.validation_max_per_class, cfg.validation_labels, cfg.estimation_share,
           partition_id, str(device))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    fed = data_plan(cfg)
    idx = fed.client_indices[partition_id]
    idx_t = torch.as_tensor(idx, dtype=torch.int64)
    x = on_device(fed.data, "train", device).index_select(0, idx_t.to(device))
    marked = fed.data.train_verified
    local = make_local(cfg, partition_id, x, fed.noisy_labels[idx], fed.true_labels[idx],
                       fed.data, None if marked is None else marked[idx],
                       f"partition {partition_id} of data-path={cfg.data_path!r}")
    with _LOCK:
        _CACHE[key] = local
    return local


def partition_sizes(cfg: RunConfig, partition_id: int) -> tuple[int, int]:
    """How many samples partition ``partition_id`` of the run's data plan trains on and
    holds out (what its node declares), without building its data: the registry asks
    every node of a simulation once, and only the sampled ones train
    (docs/BENCHMARKS.md, "Planning a round")."""
    n = len(data_plan(cfg).client_indices[partition_id])
    return training_size(cfg, n), held_out_count(cfg, n)


def check_node_config(node_config: dict[str, Any], node: str) -> None:
    """Fail early (before any data is read) on a bad ``data-path`` or ``cache-dir``."""
    for key in (DATA_PATH_KEY, CACHE_DIR_KEY):
        value = node_config.get(key)
        if value is not None and not (isinstance(value, str) and os.path.isabs(value)):
            raise PrivateDataError(
                f"{node}: node config {key}={value!r} is not an absolute path; write it "
                f"quoted, e.g. --node-config '{key}=\"/srv/fedefc/...\"'")
    path = node_config.get(DATA_PATH_KEY)
    if path is not None and not os.path.exists(path):
        raise PrivateDataError(f"{node}: data-path={path!r} does not exist; point it at an "
                               ".npz file (images or features, and labels) or an "
                               "ImageFolder directory")


def node_data(cfg: RunConfig, partition_id: int, node_config: dict[str, Any], node: str,
              device: torch.device) -> LocalData:
    """The node's local data, from the source its node config names (module docstring)."""
    check_node_config(node_config, node)
    path = node_config.get(DATA_PATH_KEY)
    cache_dir = node_config.get(CACHE_DIR_KEY)
    if path is None and cache_dir is None:
        return partition_data(cfg, partition_id, device)
    if path is not None:
        task = task_shape(cfg, node)
        key = private_key(task, path)
        build = partial(_private_arrays, path, task, node)
    else:
        key = partition_key(cfg, partition_id)
        build = partial(_partition_arrays, cfg, partition_id)
    arrays = DataCache(cache_dir).get_or_build(key, build) if cache_dir else build()
    where = node if path is None else f"{node}: data-path={path!r}"
    return _local_from_arrays(cfg, partition_id, arrays, node, device, where)


def _partition_arrays(cfg: RunConfig, partition_id: int) -> Arrays:
    """A partition before its held-out split, with the run dataset's spec."""
    fed = data_plan(cfg)
    idx = fed.client_indices[partition_id]
    spec = fed.data.spec
    return {"x": fed.data.train_x[torch.as_tensor(idx)].numpy(),
            "labels": fed.noisy_labels[idx], "true_labels": fed.true_labels[idx],
            "test_x": fed.data.test_x.numpy(), "test_y": fed.data.test_y.numpy(),
            "mean": np.asarray(spec.mean), "std": np.asarray(spec.std),
            "num_classes": np.int64(spec.num_classes)}


def _private_arrays(path: str, task: TaskShape, node: str) -> Arrays:
    samples = load_private_data(path, task, node)
    arrays = {"x": samples.x, "labels": samples.y}
    if samples.class_names is not None:
        arrays["class_map"] = np.array(class_map_fingerprint(samples.class_names))
    return arrays if samples.verified is None else {**arrays, "verified": samples.verified}


def _local_from_arrays(cfg: RunConfig, partition_id: int, arrays: Arrays, node: str,
                       device: torch.device, where: str) -> LocalData:
    """LocalData from prepared arrays. A partition keeps the run dataset's spec (stored
    with it); private data gets the run's normalization or, unless the run config
    gives it, its own training part's (docs/OWN-DATA.md, "Normalization")."""
    x = torch.from_numpy(arrays["x"])
    labels = arrays["labels"]
    if "num_classes" in arrays:
        shape = tuple(x.shape[1:])
        spec = DataSpec(shape, int(arrays["num_classes"]),
                        tuple(float(v) for v in arrays["mean"]),
                        tuple(float(v) for v in arrays["std"]), resolve_augment(cfg, shape))
        test_x, test_y = torch.from_numpy(arrays["test_x"]), torch.from_numpy(arrays["test_y"])
        true_labels = arrays["true_labels"]
    else:
        split = held_out_positions(cfg, partition_id, len(labels))
        train_x = arrays["x"] if split is None else arrays["x"][split[0]]
        spec = make_spec(cfg, task_shape(cfg, node), train_x)
        test_x = torch.zeros((0, *spec.input_shape), dtype=x.dtype)
        test_y = torch.zeros(0, dtype=torch.int64)
        true_labels = None
    data = Dataset(cfg.dataset, spec, x, torch.from_numpy(labels), test_x, test_y)
    local = make_local(cfg, partition_id, x.to(device), labels, true_labels, data,
                       arrays.get("verified"), where)
    if "class_map" not in arrays:
        return local
    return replace(local, class_map=str(arrays["class_map"]))
