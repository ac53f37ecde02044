"""Model state <-> lists of NumPy arrays (all state, BatchNorm statistics included)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """Every entry of the state dict, in its order, as NumPy arrays of their own (one
    copy per tensor: the device's transfer, or on the CPU a copy that the next message's
    weights cannot overwrite)."""
    return [t.detach().to("cpu", copy=True).numpy() for t in model.state_dict().values()]


def set_weights(model: nn.Module, weights: list[np.ndarray]) -> None:
    """Load arrays produced by :func:`get_weights` (same order, shapes and dtypes)."""
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"expected {len(state)} arrays for the model, got {len(weights)}")
    new = {}
    for (name, ref), arr in zip(state.items(), weights):
        if tuple(arr.shape) != tuple(ref.shape):
            raise ValueError(f"array for {name!r} has shape {arr.shape}, "
                             f"expected {tuple(ref.shape)}")
        new[name] = torch.as_tensor(np.asarray(arr), dtype=ref.dtype)
    model.load_state_dict(new)


def state_dict_of(model: nn.Module, weights: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """``weights`` (the :func:`get_weights` order) as a CPU state dict of ``model``'s
    architecture, for ``torch.save`` (the model's own tensors are left untouched)."""
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"expected {len(state)} arrays for the model, got {len(weights)}")
    return {name: torch.as_tensor(np.asarray(arr), dtype=ref.dtype).clone()
            for (name, ref), arr in zip(state.items(), weights)}
