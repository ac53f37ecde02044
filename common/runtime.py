"""Per-process caches of models and device tensors, so each is built and moved once.

A process serves one client message at a time (a Ray actor in simulation, a fresh
ClientApp process per message in deployment), so clients can share one model instance
whose weights every message overwrites.
"""

from __future__ import annotations

import threading

import torch

from .config import RunConfig
from .datasets import ImageData
from .models import FeatureClassifier, build_model
from .seeds import derive_seed

_MODELS: dict[tuple, FeatureClassifier] = {}
_TENSORS: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def model_for(cfg: RunConfig, data: ImageData, device: torch.device,
              slot: str = "main") -> FeatureClassifier:
    """The process's model instance for this architecture and device (weights are
    overwritten by every message; ``slot`` keeps a second instance, e.g. Ditto's)."""
    key = (cfg.resolved_model(), data.in_channels, data.num_classes,
           int(data.train_x.shape[-1]), str(device), slot)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = initial_model(cfg, data).to(device)
        return _MODELS[key]


def initial_model(cfg: RunConfig, data: ImageData) -> FeatureClassifier:
    """The global model of round 0: a pure function of (model, dataset shape, seed)."""
    return build_model(cfg.resolved_model(), data.in_channels, data.num_classes,
                       int(data.train_x.shape[-1]), derive_seed(cfg.seed, "model"))


def on_device(data: ImageData, split: str, device: torch.device) -> torch.Tensor:
    """``data.train_x`` / ``data.test_x`` (uint8) moved to ``device`` once per process."""
    key = (id(data), split, str(device))
    with _LOCK:
        if key not in _TENSORS:
            src = data.train_x if split == "train" else data.test_x
            _TENSORS[key] = src if device.type == "cpu" else src.to(device)
        return _TENSORS[key]
