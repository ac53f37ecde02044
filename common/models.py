"""The models of docs/FEDEFC.md §2.2, each returning logits and (on request) features,
and models given by import path (docs/OWN-DATA.md, "Your model").

- ``lenet``: LeNet-5 for CPU runs (the mnist-lite preset).
- ``cnn9``: Co-teaching's 9-conv CNN (the paper's MNIST model); dropout is off in
  eval mode (the reference code's dropout-in-eval bug is not reproduced).
- ``resnet18`` / ``resnet34``: CIFAR-style ResNets (3x3 stride-1 stem, no max-pool).
- ``resnet18-image``: ResNet-18 for larger images (RGB, grayscale, medical), its stem
  chosen from the image size: torchvision's ImageNet stem from 64 pixels up, else the
  CIFAR stem (:class:`ImageResNet`).
- ``cnn``: a small CNN for images of any size and channel count.
- ``mlp``: a two-hidden-layer perceptron for feature vectors (or flattened images).
- ``"package.module:callable"``: ``callable(num_classes=K, input_shape=...)`` returning
  a ``torch.nn.Module`` whose forward gives (N, K) logits.

Every conv and linear layer of the built-in models is Xavier-uniform initialized with
zero bias, as the reference code; a model given by import path keeps its own
initialization, drawn under the same derived seed. ``forward(x, return_features=True)``
also returns the penultimate feature vector (RoFL's class centroids need it): the
built-in models do, and a model given by import path may (:func:`provides_features`).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class ModelError(ValueError):
    """A model cannot be built or does not fit the data; the message names the fix."""


@dataclass(frozen=True)
class TaskShape:
    """What a model is built for: the input shape ((C, H, W) or (D,)) and K classes."""

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass(frozen=True)
class ClassifierShape:
    """K classes and the penultimate feature width D (None: the model gives no features)."""

    num_classes: int
    feature_dim: int | None


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

    def __init__(self, in_channels: int, num_classes: int, image_size: tuple[int, int] = (28, 28)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        rows, cols = (((side - 4) // 2 - 4) // 2 for side in image_size)
        self.fc1 = nn.Linear(16 * rows * cols, 120)
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


# the smallest image side that gets the ImageNet stem (it divides the side by 4 before the
# first stage: 64 pixels leave 16 x 16 there and 2 x 2 after the last stage)
IMAGENET_STEM_MIN_SIDE = 64


class ImageResNet(CifarResNet):
    """ResNet with its stem chosen from the image size (docs/OWN-DATA.md, "The built-in
    models"): from :data:`IMAGENET_STEM_MIN_SIDE` pixels on the shorter side, the
    ImageNet stem of torchvision's ``resnet18`` (7x7 stride-2 conv, BN, ReLU, 3x3
    stride-2 max-pool), so that a 224 x 224 image costs what it costs in torchvision;
    below it the CIFAR stem (3x3 stride 1, no max-pool), which keeps small images'
    resolution. The stages, pooling and classifier are the CIFAR ResNet's, which are
    torchvision's."""

    def __init__(self, blocks: tuple[int, int, int, int], in_channels: int, num_classes: int,
                 image_size: tuple[int, int]):
        super().__init__(blocks, in_channels, num_classes)
        self.imagenet_stem = min(image_size) >= IMAGENET_STEM_MIN_SIDE
        if self.imagenet_stem:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))


def xavier_init(model: nn.Module) -> nn.Module:
    """Xavier-uniform weights and zero bias on every conv and linear layer."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


class SmallCNN(FeatureClassifier):
    """For images of any size: conv3 (C->32), ReLU, conv3 (32->32), ReLU, 2x2 max-pool
    (when both sides are at least 2), conv3 (32->64), ReLU, adaptive average pool to
    4x4, FC 128, ReLU, FC K."""

    def __init__(self, in_channels: int, num_classes: int, image_size: tuple[int, int]):
        super().__init__()
        pool: nn.Module = nn.MaxPool2d(2) if min(image_size) >= 2 else nn.Identity()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), pool,
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(64 * 16, 128), nn.ReLU())
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x):
        return self.body(x)


class MLP(FeatureClassifier):
    """Flatten, FC 128, ReLU, FC 64, ReLU, FC K: for feature vectors (D,) (or images)."""

    def __init__(self, input_size: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(input_size, 128), nn.ReLU(),
                                  nn.Linear(128, 64), nn.ReLU())
        self.classifier = nn.Linear(64, num_classes)

    def features(self, x):
        return self.body(x)


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: its builder, and what inputs it takes (``images``: only
    (C, H, W) images of at least ``min_side`` pixels a side; else feature vectors too)."""

    name: str
    build: Callable[[TaskShape], FeatureClassifier]
    images: bool
    min_side: int


MODELS: dict[str, ModelEntry] = {}

Builder = Callable[[TaskShape], FeatureClassifier]


def register_model(name: str, *, images: bool = True, min_side: int = 1
                   ) -> Callable[[Builder], Builder]:
    """Register the decorated builder as built-in model ``name`` (docs/ARCHITECTURE.md,
    "A new model")."""
    def register(build: Builder) -> Builder:
        if name in MODELS:
            raise ValueError(f"model {name!r} is registered twice")
        MODELS[name] = ModelEntry(name, build, images, min_side)
        return build
    return register


@register_model("lenet", min_side=16)
def lenet(task: TaskShape) -> FeatureClassifier:
    channels, rows, cols = task.input_shape
    return LeNet5(channels, task.num_classes, (rows, cols))


@register_model("cnn9", min_side=28)
def cnn9(task: TaskShape) -> FeatureClassifier:
    return CNN9(task.input_shape[0], task.num_classes)


@register_model("resnet18")
def resnet18(task: TaskShape) -> FeatureClassifier:
    return CifarResNet((2, 2, 2, 2), task.input_shape[0], task.num_classes)


@register_model("resnet34")
def resnet34(task: TaskShape) -> FeatureClassifier:
    return CifarResNet((3, 4, 6, 3), task.input_shape[0], task.num_classes)


@register_model("mlp", images=False)
def mlp(task: TaskShape) -> FeatureClassifier:
    return MLP(math.prod(task.input_shape), task.num_classes)


@register_model("cnn")
def cnn(task: TaskShape) -> FeatureClassifier:
    channels, rows, cols = task.input_shape
    return SmallCNN(channels, task.num_classes, (rows, cols))


@register_model("resnet18-image")
def resnet18_image(task: TaskShape) -> FeatureClassifier:
    channels, rows, cols = task.input_shape
    return ImageResNet((2, 2, 2, 2), channels, task.num_classes, (rows, cols))


def _builtin(entry: ModelEntry, task: TaskShape) -> FeatureClassifier:
    """A built-in model for ``task``, after checking it takes the task's inputs."""
    shape, name = task.input_shape, entry.name
    if entry.images and len(shape) != 3:
        raise ModelError(f"model={name!r} takes images, but the data holds feature vectors "
                         f"of shape {shape}; use model=\"mlp\" (or \"auto\")")
    if entry.images and min(shape[1:]) < entry.min_side:
        raise ModelError(f"model={name!r} needs images of at least {entry.min_side}x"
                         f"{entry.min_side} pixels, but they are {shape[1]}x{shape[2]}; use "
                         "model=\"cnn\" (any size) or \"mlp\"")
    return entry.build(task)


def import_model(path: str, task: TaskShape) -> nn.Module:
    """``callable(num_classes=K, input_shape=...)`` of ``"package.module:callable"``,
    checked: a ``torch.nn.Module`` whose forward maps a batch of the input shape to
    (N, K) logits."""
    module_name, _, attr = path.partition(":")
    importable = ("it must be importable in every process that runs the app (SuperLink, "
                  "SuperNodes, their SuperExecs, the simulation): install its package in "
                  "their environment (pip install -e yourpkg) or put its folder on their "
                  "PYTHONPATH")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or an error raised by the module itself
        raise ModelError(f"model={path!r}: cannot import {module_name!r} "
                         f"({type(err).__name__}: {err}); {importable}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model={path!r}: module {module_name!r} has no callable {attr!r}; "
                         "name a function or class that takes num_classes and input_shape")
    try:
        model = factory(num_classes=task.num_classes, input_shape=task.input_shape)
    except Exception as err:
        raise ModelError(f"model={path!r}: calling {attr}(num_classes={task.num_classes}, "
                         f"input_shape={task.input_shape}) raised {type(err).__name__}: "
                         f"{err}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model={path!r}: {attr}(...) returned {type(model).__name__}, not "
                         "a torch.nn.Module")
    check_output(model, path, task)
    return model


def check_output(model: nn.Module, name: str, task: TaskShape) -> None:
    """The model maps a batch of 2 zero inputs of the task's shape to (2, K) logits."""
    batch = torch.zeros(2, *task.input_shape)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch)
    except Exception as err:
        raise ModelError(f"model={name!r} fails on a batch of shape {tuple(batch.shape)} "
                         f"({type(err).__name__}: {err}); its forward must take float "
                         "batches shaped (N, *input_shape)") from None
    finally:
        model.train(was_training)
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (2, task.num_classes):
        raise ModelError(f"model={name!r} gives {shape} for a batch of 2 inputs of shape "
                         f"{task.input_shape}; its forward must return logits shaped (N, K) = "
                         f"(2, {task.num_classes}): end it with a Linear(..., num_classes)")


def provides_features(model: nn.Module) -> bool:
    """Whether ``model(x, return_features=True)`` gives (logits, penultimate features)."""
    if isinstance(model, FeatureClassifier):
        return True
    try:
        return "return_features" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def classifier_shape(model: nn.Module, task: TaskShape) -> ClassifierShape:
    """K and the penultimate feature width D of ``model`` (one forward pass on zeros)."""
    if not provides_features(model):
        return ClassifierShape(task.num_classes, None)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        _, feats = model(torch.zeros(2, *task.input_shape), return_features=True)
    model.train(was_training)
    return ClassifierShape(task.num_classes, int(feats.flatten(1).shape[1]))


def build_model(name: str, task: TaskShape, seed: int) -> nn.Module:
    """A freshly initialized model; the same seed gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in MODELS:
            return xavier_init(_builtin(MODELS[name], task))
        return import_model(name, task)
