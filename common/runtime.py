"""Per-process caches of models and device tensors, so each is built and moved once.

A process serves one client message at a time (a Ray actor in simulation, a fresh
ClientApp process per message in deployment), so clients can share one model instance
whose weights every message overwrites.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .config import RunConfig
from .datasets import Dataset
from .methods import method_of
from .models import ModelError, TaskShape, build_model, provides_features
from .seeds import derive_seed

_MODELS: dict[tuple, nn.Module] = {}
_TENSORS: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def model_for(cfg: RunConfig, task: TaskShape, device: torch.device,
              slot: str = "main") -> nn.Module:
    """The process's model instance for this architecture and device (weights are
    overwritten by every message; ``slot`` keeps a second instance, e.g. Ditto's)."""
    key = (cfg.resolved_model(task.input_shape), task, cfg.method, str(device), slot)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = initial_model(cfg, task).to(device)
        return _MODELS[key]


def initial_model(cfg: RunConfig, task: TaskShape) -> nn.Module:
    """The global model of round 0: a pure function of (model, input shape, K, seed).
    A method that needs the penultimate features (RoFL) refuses a model without them."""
    name = cfg.resolved_model(task.input_shape)
    model = build_model(name, task, derive_seed(cfg.seed, "model"))
    if method_of(cfg).needs_features and not provides_features(model):
        raise ModelError(
            f"method={cfg.method!r} needs the model's penultimate features, but model="
            f"{name!r} does not give them: its forward must accept return_features=True and "
            "then return (logits, features) (subclass common.models.FeatureClassifier: "
            "features(x) and a final Linear named classifier), or choose another method")
    return model


def on_device(data: Dataset, split: str, device: torch.device) -> torch.Tensor:
    """``data.train_x`` / ``data.test_x`` moved to ``device`` once per process."""
    key = (id(data), split, str(device))
    with _LOCK:
        if key not in _TENSORS:
            src = data.train_x if split == "train" else data.test_x
            _TENSORS[key] = src if device.type == "cpu" else src.to(device)
        return _TENSORS[key]
