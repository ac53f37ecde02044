"""The models of docs/FEDEFC.md §2.2."""

import numpy as np
import pytest
import torch
from torch import nn

from common.models import TaskShape, build_model
from common.params import get_weights, set_weights


def task(channels: int, size: int, classes: int) -> TaskShape:
    return TaskShape((channels, size, size), classes)


@pytest.mark.parametrize("name,channels,size,classes,feat", [
    ("lenet", 1, 28, 10, 84), ("cnn9", 1, 28, 10, 128), ("resnet18", 3, 32, 10, 512),
    ("resnet34", 3, 32, 100, 512)])
def test_shapes_and_features(name, channels, size, classes, feat):
    model = build_model(name, task(channels, size, classes), seed=0).eval()
    logits, feats = model(torch.zeros(2, channels, size, size), return_features=True)
    assert logits.shape == (2, classes) and feats.shape == (2, feat)


def test_xavier_init_zero_bias_and_seeded():
    a = build_model("lenet", task(1, 28, 10), seed=5)
    b = build_model("lenet", task(1, 28, 10), seed=5)
    c = build_model("lenet", task(1, 28, 10), seed=6)
    for (_, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.conv1.weight, c.conv1.weight)
    for m in a.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            assert torch.count_nonzero(m.bias) == 0
            fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(m.weight)
            bound = (6 / (fan_in + fan_out)) ** 0.5
            assert m.weight.abs().max() <= bound


def test_resnet34_stage_depths():
    model = build_model("resnet34", task(3, 32, 100), seed=0)
    assert len(model.stages) == 3 + 4 + 6 + 3


def test_cnn9_dropout_is_off_in_eval_mode():
    torch.manual_seed(0)
    model = build_model("cnn9", task(1, 28, 10), seed=0).eval()
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_the_weights_a_client_replies_with_are_its_own_copies():
    """A process's model is overwritten by its next message (common/runtime.py:
    model_for): the arrays of a reply must not share its memory, and loading them back
    gives the same state, BatchNorm statistics included."""
    model = build_model("resnet18", TaskShape((3, 32, 32), 10), 0)
    weights = get_weights(model)
    before = [w.copy() for w in weights]
    for t in model.state_dict().values():
        t.add_(1)  # the next message's training, in place
    assert all(np.array_equal(w, b) for w, b in zip(weights, before))
    set_weights(model, weights)
    assert all(np.array_equal(t.numpy(), w) for t, w in zip(model.state_dict().values(), before))
