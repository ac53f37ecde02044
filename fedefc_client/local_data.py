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

Which samples play which role is drawn once per client, as a pure function of the seed
and the partition id (:class:`common.sample_roles.SampleRoles`): with federated
evaluation (``evaluation = federated | both``) a seeded ``local-test-fraction`` held
out, which only ever yields the global model's loss and accuracy on it
(docs/OWN-DATA.md, "Federated evaluation"); with the ``held-out`` accuracy signal a
validation share of the part it trains on (docs/FEDEFC.md §3.1), which stays inside the
training part, so the client's declared size is unchanged; with ``validation-labels =
"verified"`` (docs/FEDEFC.md §3.7) the share's labels are checked ones: in a partition
of the run's dataset the share carries its true labels (:func:`make_local`), and a
node's own data names its checked samples in a ``verified`` array, which are then its
share.
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
from common.data_plan import data_plan
from common.datasets import Dataset, DataSpec, make_spec, resolve_augment, task_shape
from common.disk_cache import Arrays, DataCache
from common.models import TaskShape
from common.noise import empirical_transition
from common.runtime import on_device
from common.sample_roles import SampleRoles, declared_sizes, roles_key

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
    the roles of its samples (:class:`common.sample_roles.SampleRoles`), and the held-out
    part (None without federated evaluation). :attr:`validation` and :attr:`estimation`
    are the sorted positions in ``x`` of the validation share and the estimation share.

    ``true_transition`` and ``noise_rate`` exist only where the client's labels were
    noised by the federation itself (a partition of the run's dataset, where the true
    labels are known); they feed diagnostics and never leave the client as matrices.
    """

    x: torch.Tensor
    y: torch.Tensor
    labels: np.ndarray
    data: Dataset
    roles: SampleRoles
    true_transition: np.ndarray | None = None
    noise_rate: float | None = None
    held_out: HeldOut | None = None
    class_map: str | None = None  # the fingerprint of its own data's class names, if any

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def validation(self) -> np.ndarray | None:
        """The validation share's positions in ``x`` (docs/FEDEFC.md §3.1; None without)."""
        return self.roles.share

    @property
    def estimation(self) -> np.ndarray | None:
        """The estimation share's positions in ``x`` (docs/FEDEFC.md §3.7; None without)."""
        return self.roles.estimation

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


def make_local(roles: SampleRoles, x: torch.Tensor, labels: np.ndarray,
               true_labels: np.ndarray | None, data: Dataset) -> LocalData:
    """LocalData from a client's samples (``x`` on the training device) and their
    ``roles``: the held-out part split off for federated evaluation; with verified labels
    (docs/FEDEFC.md §3.7) and true labels known (a simulated check of those samples) the
    share's true labels put in place of its observed ones; with true labels, the
    diagnostics of the training part."""
    device = x.device
    held = None
    if roles.held_out is not None:
        train, out = roles.train, roles.held_out
        held_x = x.index_select(0, torch.as_tensor(out, device=device))
        true_held = None
        if true_labels is not None:
            true_held = torch.as_tensor(true_labels[out], dtype=torch.int64).to(device)
            true_labels = true_labels[train]
        held = HeldOut(held_x, torch.as_tensor(labels[out], dtype=torch.int64).to(device),
                       true_held)
        x, labels = x.index_select(0, torch.as_tensor(train, device=device)), labels[train]
    if roles.verified and roles.share is not None and true_labels is not None:
        labels = labels.copy()
        labels[roles.share] = true_labels[roles.share]
    truth, rate = None, None
    if true_labels is not None:
        truth = empirical_transition(labels, true_labels, data.num_classes)
        rate = float(np.mean(labels != true_labels)) if len(labels) else 0.0
    return LocalData(x=x, y=torch.as_tensor(labels, dtype=torch.int64).to(device),
                     labels=labels, data=data, roles=roles, true_transition=truth,
                     noise_rate=rate, held_out=held)


_CACHE: dict[tuple, LocalData] = {}
_LOCK = threading.Lock()


def partition_data(cfg: RunConfig, partition_id: int, device: torch.device) -> LocalData:
    """Client ``partition_id`` of the run's federated data plan, cached per process."""
    key = (cfg.data_key(), roles_key(cfg), partition_id, str(device))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    fed = data_plan(cfg)
    idx = fed.client_indices[partition_id]
    idx_t = torch.as_tensor(idx, dtype=torch.int64)
    x = on_device(fed.data, "train", device).index_select(0, idx_t.to(device))
    marked = fed.data.train_verified
    roles = SampleRoles.build(cfg, partition_id, len(idx), fed.data.num_classes,
                              None if marked is None else marked[idx], simulated=True,
                              where=f"partition {partition_id} of data-path={cfg.data_path!r}")
    local = make_local(roles, x, fed.noisy_labels[idx], fed.true_labels[idx], fed.data)
    with _LOCK:
        _CACHE[key] = local
    return local


def partition_sizes(cfg: RunConfig, partition_id: int) -> tuple[int, int]:
    """How many samples partition ``partition_id`` of the run's data plan trains on and
    holds out (what its node declares), without building its data: the registry asks
    every node of a simulation once, and only the sampled ones train
    (docs/BENCHMARKS.md, "Planning a round")."""
    return declared_sizes(cfg, len(data_plan(cfg).client_indices[partition_id]))


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
    task = None
    if path is not None:
        task = task_shape(cfg, node)
        key = private_key(task, path)
        build = partial(_private_arrays, path, task, node)
    else:
        key = partition_key(cfg, partition_id)
        build = partial(_partition_arrays, cfg, partition_id)
    arrays = DataCache(cache_dir).get_or_build(key, build) if cache_dir else build()
    where = node if path is None else f"{node}: data-path={path!r}"
    return _local_from_arrays(cfg, partition_id, arrays, task, device, where)


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


def _local_from_arrays(cfg: RunConfig, partition_id: int, arrays: Arrays,
                       task: TaskShape | None, device: torch.device, where: str) -> LocalData:
    """LocalData from prepared arrays. A partition keeps the run dataset's spec (stored
    with it); private data (of the run's ``task``) gets the run's normalization or,
    unless the run config gives it, its own training part's (docs/OWN-DATA.md,
    "Normalization")."""
    x = torch.from_numpy(arrays["x"])
    labels = arrays["labels"]
    simulated = "num_classes" in arrays
    num_classes = int(arrays["num_classes"]) if simulated else task.num_classes
    roles = SampleRoles.build(cfg, partition_id, len(labels), num_classes,
                              arrays.get("verified"), simulated, where)
    if simulated:
        shape = tuple(x.shape[1:])
        spec = DataSpec(shape, int(arrays["num_classes"]),
                        tuple(float(v) for v in arrays["mean"]),
                        tuple(float(v) for v in arrays["std"]), resolve_augment(cfg, shape))
        test_x, test_y = torch.from_numpy(arrays["test_x"]), torch.from_numpy(arrays["test_y"])
        true_labels = arrays["true_labels"]
    else:
        train_x = arrays["x"] if roles.held_out is None else arrays["x"][roles.train]
        spec = make_spec(cfg, task, train_x)
        test_x = torch.zeros((0, *spec.input_shape), dtype=x.dtype)
        test_y = torch.zeros(0, dtype=torch.int64)
        true_labels = None
    data = Dataset(cfg.dataset, spec, x, torch.from_numpy(labels), test_x, test_y)
    local = make_local(roles, x.to(device), labels, true_labels, data)
    if "class_map" not in arrays:
        return local
    return replace(local, class_map=str(arrays["class_map"]))
