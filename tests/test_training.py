"""Local loops: batch transforms, training, and that phase 2 trains a different model."""

import copy
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF

from common.losses import cross_entropy, forward_corrected_loss
from common.models import TaskShape, build_model
from common.training import (
    SGD,
    BatchTransform,
    SGDSettings,
    TrainingSet,
    batches,
    evaluate,
    predict_proba,
    random_crop_flip,
    train,
    train_batches,
)

ROOT = Path(__file__).resolve().parents[1]


def test_random_crop_flip_matches_torchvision_crops():
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    out = random_crop_flip(x, gen)
    gen = torch.Generator().manual_seed(0)
    dy = torch.randint(0, 9, (16,), generator=gen)
    dx = torch.randint(0, 9, (16,), generator=gen)
    flip = torch.rand(16, generator=gen) < 0.5
    for i in range(16):
        ref = TF.crop(TF.pad(x[i], [4, 4, 4, 4]), int(dy[i]), int(dx[i]), 32, 32)
        if flip[i]:
            ref = TF.horizontal_flip(ref)
        assert torch.equal(out[i], ref)


def test_normalization():
    t = BatchTransform((0.5,), (0.25,), torch.device("cpu"))
    x = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    assert torch.allclose(t(x), torch.tensor([[[[-2.0, 2.0]]]]))


def test_batches_cover_the_data_and_drop_a_lone_last_sample():
    gen = torch.Generator().manual_seed(0)
    b = batches(65, 32, gen)
    assert [len(x) for x in b] == [32, 32]
    b = batches(66, 32, gen)
    assert sorted(torch.cat(b).tolist()) == list(range(66))


def _toy(embedded, n=256):
    idx = torch.arange(0, len(embedded.train_y), len(embedded.train_y) // n)[:n]  # all classes
    x, y = embedded.train_x[idx], embedded.train_y[idx]
    return x, y, BatchTransform.of(embedded.spec, torch.device("cpu"))


def test_training_learns_and_is_deterministic(embedded):
    x, y, t = _toy(embedded)
    settings = SGDSettings(epochs=5, batch_size=32, lr=0.05, momentum=0.5)
    weights = []
    for _ in range(2):
        model = build_model("lenet", embedded.task, seed=0)
        loss0, _ = evaluate(model, x, y, t)
        torch.manual_seed(1)
        train(model, TrainingSet(x, y, t), cross_entropy, settings,
              torch.Generator().manual_seed(1))
        loss1, acc1 = evaluate(model, x, y, t)
        assert loss1 < loss0 and acc1 > 0.5
        weights.append([v.clone() for v in model.state_dict().values()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_forward_loss_with_non_identity_q_trains_a_different_model(embedded):
    x, y, t = _toy(embedded)
    settings = SGDSettings(epochs=1, batch_size=32, lr=0.05, momentum=0.5)
    q = torch.full((10, 10), 0.02) + torch.eye(10) * 0.8
    out = []
    for loss_fn in (cross_entropy, partial(forward_corrected_loss, q=torch.eye(10)),
                    partial(forward_corrected_loss, q=q)):
        model = build_model("lenet", embedded.task, seed=0)
        train(model, TrainingSet(x, y, t), loss_fn, settings, torch.Generator().manual_seed(1))
        out.append(predict_proba(model, x, t))
    np.testing.assert_allclose(out[0], out[1], atol=1e-4)  # Q = I is cross-entropy
    assert np.abs(out[0] - out[2]).max() > 1e-3


def test_bf16_runs_the_forward_pass_under_autocast_and_still_learns(embedded):
    """precision=bf16: the model's logits are bfloat16 inside the step (so the loss sees
    them), the weights stay float32 and finite, and training still learns; fp32 steps
    see float32 logits."""
    x, y, t = _toy(embedded)
    seen = {}
    for precision in ("fp32", "bf16"):
        settings = SGDSettings(epochs=3, batch_size=32, lr=0.05, momentum=0.5,
                               precision=precision)
        model = build_model("lenet", embedded.task, seed=0)
        loss0, _ = evaluate(model, x, y, t)

        def batch_loss(m, xb, yb, _idx, precision=precision):
            logits = m(xb)
            seen[precision] = logits.dtype
            return cross_entropy(logits, yb), logits

        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        train_batches(model, TrainingSet(x, y, t), batch_loss, optimizer, settings,
                      torch.Generator().manual_seed(1))
        loss1, acc1 = evaluate(model, x, y, t)
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all()
                   for p in model.parameters())
        assert loss1 < loss0 and acc1 > 0.5
    assert seen == {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.5, 0.0), (0.9, 5e-4)])
def test_sgd_is_torch_optim_sgd_bitwise(momentum, weight_decay):
    """The project's SGD against PyTorch's own (its CPU implementation), step for step on
    a LeNet: identical weights after every step, momentum and weight decay included."""
    torch.manual_seed(0)
    ours = build_model("lenet", TaskShape((1, 28, 28), 10), 0)
    theirs = copy.deepcopy(ours)
    opt_ours = SGD(ours.parameters(), lr=0.03, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.03, momentum=momentum,
                                 weight_decay=weight_decay, foreach=False)
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))
    for _ in range(5):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
            assert torch.equal(a, b)


def test_training_in_a_fresh_process_does_not_import_torch_dynamo(tmp_path):
    """A deployment trains in a fresh process per message: torch.optim's step would import
    torch._dynamo (and sympy) there, seconds of CPU each time."""
    code = ("import sys, torch\nfrom common.models import TaskShape, build_model\n"
            "from common.training import make_optimizer\n"
            "m = build_model('lenet', TaskShape((1, 28, 28), 10), 0)\n"
            "opt = make_optimizer(m, 'sgd', 0.1, 0.5, 0.0)\n"
            "opt.zero_grad(); m(torch.rand(2, 1, 28, 28)).sum().backward(); opt.step()\n"
            "print(sorted(k for k in ('torch._dynamo', 'sympy') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"
