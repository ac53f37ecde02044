"""Models given by import path (``model = "tests.own_models:<name>"``), as a user writes
them (docs/OWN-DATA.md, "Your model"): called as ``name(num_classes=K,
input_shape=...)``, returning a ``torch.nn.Module`` whose forward gives logits.
Importable wherever the repository root is on ``PYTHONPATH`` (the tests that start
Flower processes put it there)."""

from __future__ import annotations

import math

from torch import nn


class TinyConvNet(nn.Module):
    """conv3 (C->8), ReLU, 2x2 adaptive average pool, FC K: any image size; no features."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                 nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)


def tiny_cnn(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return TinyConvNet(num_classes, input_shape)


class FeaturedLinear(nn.Module):
    """Flatten, FC 6, tanh, FC K; ``forward(x, return_features=True)`` also gives the
    6 penultimate features (what RoFL needs)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 6), nn.Tanh())
        self.head = nn.Linear(6, num_classes)

    def forward(self, x, return_features: bool = False):
        feats = self.body(x)
        logits = self.head(feats)
        return (logits, feats) if return_features else logits


def featured(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return FeaturedLinear(num_classes, input_shape)


def one_class_too_many(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A model whose output is (N, K + 1): refused."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes + 1))


def not_a_module(num_classes: int, input_shape: tuple[int, ...]) -> str:
    """Not a torch.nn.Module: refused."""
    return f"a model for {num_classes} classes"
