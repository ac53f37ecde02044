"""The models of docs/FEDEFC.md §2.2, each returning logits and (on request) features.

- ``lenet``: LeNet-5 for CPU runs (the mnist-lite preset).
- ``cnn9``: Co-teaching's 9-conv CNN (the paper's MNIST model); dropout is off in
  eval mode (the reference code's dropout-in-eval bug is not reproduced).
- ``resnet18`` / ``resnet34``: CIFAR-style ResNets (3x3 stride-1 stem, no max-pool).

Every conv and linear layer is Xavier-uniform initialized with zero bias, as the
reference code. ``forward(x, return_features=True)`` also returns the penultimate
feature vector (RoFL's class centroids need it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeatureClassifier(nn.Module):
    """A feature extractor followed by one linear classifier."""

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor, return_features: bool = False):
        feats = self.features(x)
        logits = self.classifier(feats)
        return (logits, feats) if return_features else logits


class LeNet5(FeatureClassifier):
    """conv5 (C->6), ReLU, pool, conv5 (6->16), ReLU, pool, FC 120, FC 84, FC K."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.classifier = nn.Linear(84, num_classes)

    def features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))


def _conv_bn(cin: int, cout: int, pad: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=pad), nn.BatchNorm2d(cout), nn.LeakyReLU(0.01)]


class CNN9(FeatureClassifier):
    """Co-teaching's 9-layer CNN: 3 x (three 3x3 conv + BN + LeakyReLU(0.01))."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        layers += _conv_bn(in_channels, 128, 1) + _conv_bn(128, 128, 1) + _conv_bn(128, 128, 1)
        layers += [nn.MaxPool2d(2), nn.Dropout2d(0.25)]
        layers += _conv_bn(128, 256, 1) + _conv_bn(256, 256, 1) + _conv_bn(256, 256, 1)
        layers += [nn.MaxPool2d(2), nn.Dropout2d(0.25)]
        layers += _conv_bn(256, 512, 0) + _conv_bn(512, 256, 0) + _conv_bn(256, 128, 0)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x):
        return self.body(x)


class BasicBlock(nn.Module):
    """ResNet basic block with a 1x1 projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(FeatureClassifier):
    """ResNet with a 3x3 stride-1 stem, no max-pool, stages 64/128/256/512."""

    def __init__(self, blocks: tuple[int, int, int, int], in_channels: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU())
        stages, cin = [], 64
        for width, n, stride in zip((64, 128, 256, 512), blocks, (1, 2, 2, 2)):
            for i in range(n):
                stages.append(BasicBlock(cin, width, stride if i == 0 else 1))
                cin = width
        self.stages = nn.Sequential(*stages)
        self.classifier = nn.Linear(512, num_classes)

    def features(self, x):
        out = self.stages(self.stem(x))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)


def classifier_shape(weight_shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(K classes, D features) of a model from the shapes of its arrays (state-dict
    order): every model here registers its classifier last, so the classifier's K x D
    weight is the second-to-last array (its bias the last)."""
    classes, features = weight_shapes[-2]
    return int(classes), int(features)


def xavier_init(model: nn.Module) -> nn.Module:
    """Xavier-uniform weights and zero bias on every conv and linear layer."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def build_model(name: str, in_channels: int, num_classes: int, image_size: int,
                seed: int) -> FeatureClassifier:
    """A freshly initialized model; the same seed gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "lenet":
            model: FeatureClassifier = LeNet5(in_channels, num_classes, image_size)
        elif name == "cnn9":
            model = CNN9(in_channels, num_classes)
        elif name == "resnet18":
            model = CifarResNet((2, 2, 2, 2), in_channels, num_classes)
        elif name == "resnet34":
            model = CifarResNet((3, 4, 6, 3), in_channels, num_classes)
        else:
            raise ValueError(f"model={name!r} is unknown; use lenet, cnn9, resnet18 or resnet34")
        return xavier_init(model)
