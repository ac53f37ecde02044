"""A client's local training data, built from the shared process-level tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from common.config import RunConfig
from common.datasets import ImageData
from common.federation import federated_data
from common.runtime import on_device


@dataclass(frozen=True)
class LocalData:
    """Images (uint8, on the training device) and observed labels of one client.

    ``true_transition`` and ``noise_rate`` exist only in simulation (the simulator
    knows the true labels); they feed diagnostics and never leave the client as matrices.
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
