"""A client's local training data: a partition of the run's dataset, or a node's own data.

Three sources, chosen by the node config (docs/DEPLOYMENT.md, "Node data"):

- simulation (``partition-id`` only): :func:`partition_data`, built from the process's
  shared dataset tensors and kept in memory, since a Ray actor serves many messages;
- a SuperNode with ``partition-id`` and ``cache-dir``: the same partition (same split,
  same noisy labels, as a pure function of the run config), stored on disk by
  :mod:`.cache` so that the ClientApp process of every later message loads it;
- a SuperNode with ``data-path``: the node's private data (:mod:`.private_data`),
  decoded once and cached the same way when ``cache-dir`` is set.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from common.config import RunConfig
from common.datasets import ImageData
from common.disk_cache import Arrays, DataCache
from common.federation import federated_data
from common.runtime import on_device

from .cache import partition_key, private_key
from .private_data import ImageSpec, PrivateDataError, load_private_data

DATA_PATH_KEY = "data-path"
CACHE_DIR_KEY = "cache-dir"


@dataclass(frozen=True)
class LocalData:
    """Images (uint8, on the training device) and observed labels of one client.

    ``true_transition`` and ``noise_rate`` exist only where the client's labels were
    noised by the federation itself (a partition of the run's dataset, where the true
    labels are known); they feed diagnostics and never leave the client as matrices.
    """

    x: torch.Tensor
    y: torch.Tensor
    labels: np.ndarray
    data: ImageData
    true_transition: np.ndarray | None = None
    noise_rate: float | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def test_split(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dataset's clean test split on this device (None for private node data)."""
        if self.true_transition is None:
            return None
        device = self.x.device
        return on_device(self.data, "test", device), self.data.test_y.to(device)


_CACHE: dict[tuple, LocalData] = {}
_LOCK = threading.Lock()


def partition_data(cfg: RunConfig, partition_id: int, device: torch.device) -> LocalData:
    """Client ``partition_id`` of the run's federated data plan, cached per process."""
    key = (cfg.data_key(), partition_id, str(device))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    fed = federated_data(cfg)
    idx = fed.client_indices[partition_id]
    labels = fed.noisy_labels[idx]
    idx_t = torch.as_tensor(idx, dtype=torch.int64)
    local = LocalData(
        x=on_device(fed.data, "train", device)[idx_t.to(device)],
        y=torch.as_tensor(labels, dtype=torch.int64).to(device),
        labels=labels,
        data=fed.data,
        true_transition=fed.client_true_transition(partition_id),
        noise_rate=fed.client_noise_rate(partition_id),
    )
    with _LOCK:
        _CACHE[key] = local
    return local


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
                               ".npz file (images, labels) or an ImageFolder directory")


def node_data(cfg: RunConfig, partition_id: int, node_config: dict[str, Any], node: str,
              device: torch.device) -> LocalData:
    """The node's local data, from the source its node config names (module docstring)."""
    check_node_config(node_config, node)
    path = node_config.get(DATA_PATH_KEY)
    cache_dir = node_config.get(CACHE_DIR_KEY)
    if path is None and cache_dir is None:
        return partition_data(cfg, partition_id, device)
    if path is not None:
        key = private_key(cfg.dataset, path)
        build = partial(_private_arrays, cfg, path, node)
    else:
        key = partition_key(cfg, partition_id)
        build = partial(_partition_arrays, cfg, partition_id)
    arrays = DataCache(cache_dir).get_or_build(key, build) if cache_dir else build()
    return _local_from_arrays(cfg, arrays, device)


def _partition_arrays(cfg: RunConfig, partition_id: int) -> Arrays:
    local = partition_data(cfg, partition_id, torch.device("cpu"))
    return {"x": local.x.numpy(), "labels": local.labels,
            "true_transition": local.true_transition,
            "noise_rate": np.float64(local.noise_rate),
            "test_x": local.data.test_x.numpy(), "test_y": local.data.test_y.numpy()}


def _private_arrays(cfg: RunConfig, path: str, node: str) -> Arrays:
    spec = ImageSpec.of(cfg.dataset)
    images, labels = load_private_data(path, spec, node)
    empty = np.zeros((0, spec.channels, spec.size, spec.size), dtype=np.uint8)
    return {"x": images, "labels": labels, "test_x": empty,
            "test_y": np.zeros(0, dtype=np.int64)}


def _local_from_arrays(cfg: RunConfig, arrays: Arrays, device: torch.device) -> LocalData:
    """LocalData from prepared arrays; ``data`` carries the run dataset's name (for the
    normalization and augmentation) and the node's own images as its train split."""
    x = torch.from_numpy(arrays["x"])
    labels = arrays["labels"]
    y = torch.from_numpy(labels)
    data = ImageData(cfg.dataset, x, y, torch.from_numpy(arrays["test_x"]),
                     torch.from_numpy(arrays["test_y"]), ImageSpec.of(cfg.dataset).num_classes)
    noise_rate = float(arrays["noise_rate"]) if "noise_rate" in arrays else None
    return LocalData(x=x.to(device), y=y.to(device), labels=labels, data=data,
                     true_transition=arrays.get("true_transition"), noise_rate=noise_rate)
