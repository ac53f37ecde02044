"""``model = "resnet18-image"`` (docs/OWN-DATA.md, "The built-in models"): ResNet-18 with
its stem chosen from the image size, checked against torchvision's own ``resnet18``
(the same weights give the same logits), on the shapes it must serve, with the features
RoFL needs."""

import pytest
import torch
import torchvision
from torch import nn

from common.methods import load_run_config
from common.models import (
    IMAGENET_STEM_MIN_SIDE,
    ClassifierShape,
    TaskShape,
    build_model,
    classifier_shape,
    provides_features,
)
from common.params import get_weights

# the ImageNet stem at its smallest side, at ImageNet's size and on 1 channel; the CIFAR stem
SHAPES = [(3, 64, 64), (3, 224, 224), (1, 128, 128), (1, 16, 24)]


def torchvision_twin(model: nn.Module, shape: tuple[int, int, int], k: int) -> nn.Module:
    """torchvision's resnet18 for ``shape`` (its stem as it ships for RGB at ImageNet
    sizes; a 1-channel first conv, or the CIFAR stem below 64 pixels, put in its place),
    holding ``model``'s weights, copied in order."""
    twin = torchvision.models.resnet18(weights=None, num_classes=k)
    channels, rows, cols = shape
    if min(rows, cols) < 64:
        twin.conv1, twin.maxpool = nn.Conv2d(channels, 64, 3, 1, 1, bias=False), nn.Identity()
    elif channels != 3:
        twin.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
    ours, theirs = model.state_dict(), twin.state_dict()
    assert [v.shape for v in ours.values()] == [v.shape for v in theirs.values()]
    twin.load_state_dict(dict(zip(theirs, ours.values())))
    return twin.eval()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_same_logits_as_torchvision_resnet18_features_and_classifier_shape(shape):
    k = 5
    task = TaskShape(shape, k)
    model = build_model("resnet18-image", task, seed=3).eval()
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, feats = model(x, return_features=True)
        expected = torchvision_twin(model, shape, k)(x)
    assert logits.shape == (2, k) and feats.shape == (2, 512)
    torch.testing.assert_close(logits, expected)
    assert provides_features(model)
    assert classifier_shape(model, task) == ClassifierShape(k, 512)  # RoFL's K x D centroids
    assert get_weights(model)[-2].shape == (k, 512)  # the classifier is registered last


@pytest.mark.parametrize("side,imagenet", [(IMAGENET_STEM_MIN_SIDE - 1, False),
                                           (IMAGENET_STEM_MIN_SIDE, True)])
def test_the_stem_is_chosen_from_the_shorter_side(side, imagenet):
    model = build_model("resnet18-image", TaskShape((3, side, 300), 2), seed=0)
    first = model.stem[0]
    assert (first.kernel_size, first.stride) == (((7, 7), (2, 2)) if imagenet
                                                 else ((3, 3), (1, 1)))
    assert isinstance(model.stem[-1], nn.MaxPool2d) is imagenet


def test_the_imagenet_variant_is_resnet18_in_size_and_resolution():
    """11,689,512 parameters at K = 1000 (torchvision's published ResNet-18 count) and a
    7 x 7 map after the last stage for 224 x 224 inputs."""
    model = build_model("resnet18-image", TaskShape((3, 224, 224), 1000), seed=0).eval()
    assert sum(p.numel() for p in model.parameters()) == 11_689_512
    with torch.no_grad():
        assert model.stages(model.stem(torch.zeros(1, 3, 224, 224))).shape == (1, 512, 7, 7)


def test_seeded_random_init_and_the_run_config_accepts_the_name():
    task = TaskShape((1, 128, 128), 3)
    a, b, c = (build_model("resnet18-image", task, seed=s).state_dict() for s in (4, 4, 5))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["stem.0.weight"], c["stem.0.weight"])
    assert torch.count_nonzero(a["classifier.bias"]) == 0  # Xavier, zero bias, as the others
    cfg = load_run_config({"dataset": "npz", "data-path": "/data/train.npz",
                           "model": "resnet18-image"})
    assert cfg.resolved_model((1, 128, 128)) == "resnet18-image"
