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
from flwr.app import RecordDict

from common.losses import cross_entropy, forward_corrected_loss
from common.methods import load_run_config
from common.models import TaskShape, build_model
from common.params import get_weights
from common.runtime import initial_model
from common.step_capture import train_captured
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
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data

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


def _random_images(n, seed=0):
    """CIFAR-shaped uint8 images and labels (augmented batches, BatchNorm models)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen),
            torch.randint(0, 10, (n,), generator=gen))


@pytest.mark.parametrize("case", ["cross-entropy", "forward-corrected", "prox+decay", "bf16",
                                  "cnn9 (BatchNorm, dropout)", "resnet18, augmented"])
def test_the_captured_step_is_todays_update_bitwise_on_the_cpu(embedded, case):
    """``step-capture = "cuda-graph"`` (common/step_capture.py): its static-buffer step,
    which a CUDA graph replays, run eagerly on the CPU, against today's loop
    (common/training.py: train): identical weights (BatchNorm statistics included),
    loss and accuracy. Every case has ragged last batches (eager in both) and enough
    full ones for the warm-up, the captured step and a replay (LeNet: 2 epochs of 8
    batches)."""
    x, y, t = _toy(embedded, n=250)
    model_name, augment, loss_fn, regularizer = "lenet", False, cross_entropy, None
    settings = SGDSettings(epochs=2, batch_size=32, lr=0.05, momentum=0.5)
    if case == "forward-corrected":
        loss_fn = partial(forward_corrected_loss,
                          q=torch.full((10, 10), 0.02) + torch.eye(10) * 0.8)
    elif case == "prox+decay":
        settings = SGDSettings(epochs=2, batch_size=32, lr=0.05, momentum=0.9,
                               weight_decay=5e-4)
        anchor = [p.detach().clone() for p in build_model("lenet", embedded.task, 1)
                  .parameters()]

        def regularizer(m):
            return 0.01 * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor))
    elif case == "bf16":
        settings = SGDSettings(epochs=2, batch_size=32, lr=0.05, momentum=0.5,
                               precision="bf16")
    elif case.startswith("cnn9"):  # the large models: one epoch of 5 full batches + 1
        model_name, x, y = "cnn9", x[:44], y[:44]
        settings = SGDSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.5)
    elif case.startswith("resnet18"):
        model_name, augment = "resnet18", True
        x, y = _random_images(44)
        t = BatchTransform((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.device("cpu"))
        settings = SGDSettings(epochs=1, batch_size=8, lr=0.03, momentum=0.5)
    task = TaskShape(tuple(x.shape[1:]), 10)
    results = []
    for loop in (train, train_captured):
        model = build_model(model_name, task, seed=0)
        torch.manual_seed(3)  # dropout draws
        stats = loop(model, TrainingSet(x, y, t, augment), loss_fn, settings,
                     torch.Generator().manual_seed(1), regularizer)
        results.append((stats, [v.clone() for v in model.state_dict().values()]))
    (ours, w_ours), (today, w_today) = results[1], results[0]
    assert ours == today
    assert all(torch.equal(a, b) for a, b in zip(w_ours, w_today))
    start = build_model(model_name, task, seed=0).state_dict().values()
    assert not all(torch.equal(a, b) for a, b in zip(w_today, start))  # it trained


def test_a_run_with_the_captured_step_replies_todays_weights_on_the_cpu():
    """The run-config switch reaches the clients: FedEFC's phase-2 reply with
    ``step-capture = "cuda-graph"`` is, on the CPU, bitwise the one without."""
    replies = []
    for capture in ("off", "cuda-graph"):
        cfg = load_run_config({"num-clients": 4, "fraction": 0.5, "local-epochs": 1,
                               "step-capture": capture})
        local = partition_data(cfg, 1, torch.device("cpu"))
        weights = get_weights(initial_model(cfg, local.data.task))
        client = MethodClient(cfg, 1, lambda local=local: local, RecordDict())
        replies.append(client.fit(weights, {"round": 4, "seed": 4, "phase": 2}))
    (w_off, n_off, m_off), (w_on, n_on, m_on) = replies
    assert n_off == n_on and m_off["train-loss"] == m_on["train-loss"]
    assert all(np.array_equal(a, b) for a, b in zip(w_off, w_on))


def test_evaluation_sums_on_the_device_as_python_floats_would():
    """``evaluate`` keeps its sums on the device (one copy back at the end) and gives,
    bit for bit, the float64 sum of each batch's float32 loss sum in batch order, and the
    accuracy of its argmax (ragged last batch included)."""
    torch.manual_seed(0)
    model = build_model("lenet", TaskShape((1, 28, 28), 10), 0)
    x = torch.randint(0, 256, (30, 1, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (30,))
    transform = BatchTransform((0.5,), (0.25,), torch.device("cpu"))
    with torch.no_grad():
        model.eval()
        logits = [model(transform(x[i:i + 7])) for i in range(0, 30, 7)]
    want_loss = sum(float(torch.nn.functional.cross_entropy(lg, y[i * 7:i * 7 + 7],
                                                            reduction="sum"))
                    for i, lg in enumerate(logits)) / 30
    want_acc = float((torch.cat(logits).argmax(1) == y).sum()) / 30
    assert evaluate(model, x, y, transform, batch_size=7) == (want_loss, want_acc)
