"""Clients stepped together (common/stacked_training.py) against each client's lone
update (common/training.py: train), client by client.

Tolerance: the stacked step sums convolutions and matrix products in another order
(``vmap`` batches them), so a parameter differs from the lone update's by float32
rounding carried through the steps. Models without BatchNorm are compared to 1e-6
absolute over 2 epochs of ragged batches; BatchNorm models, whose updates amplify a
rounding difference more, by the distance of all parameters to the lone ones: below
1e-2 of the lone update's own change (measured: up to 3.2e-4, the 9-conv CNN's second
client on one thread; 4e-7 on two), and of all running statistics, below 1e-3
(measured: up to 3.5e-7). Dropout masks drawn from another seed move the parameters by
1.4 times the change; a BatchNorm momentum off by 10 % moves the statistics by 0.1.
"""

import copy
from functools import partial

import pytest
import torch
from torch import nn

from common.losses import cross_entropy, forward_corrected_loss
from common.models import TaskShape, build_model
from common.stacked_training import ClientRun, NotStackable, train_stacked
from common.training import BatchTransform, SGDSettings, TrainingSet, train

SHAPES = {"lenet": (1, 28, 28), "mlp": (13,), "cnn9": (1, 28, 28), "resnet18": (3, 32, 32)}


def client_data(name: str, sizes: list[int], augment: bool = False) -> list[TrainingSet]:
    shape = SHAPES[name]
    images = len(shape) == 3
    transform = BatchTransform((0.5,) * shape[0], (0.25,) * shape[0], torch.device("cpu"),
                               images=images)
    out = []
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(100 + i)
        x = (torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g) if images
             else torch.randn(n, *shape, generator=g))
        out.append(TrainingSet(x, torch.randint(0, 10, (n,), generator=g), transform, augment))
    return out


def noise_matrices(n: int) -> list[torch.Tensor]:
    return [torch.softmax(3 * torch.randn(10, 10, generator=torch.Generator().manual_seed(i)),
                          dim=0) for i in range(n)]


def lone_and_stacked(name, datas, losses, settings):
    """Each client trained alone (its dropout from the global RNG seeded as LocalJob
    seeds it) and all of them stepped together, from one initial model."""
    base = build_model(name, TaskShape(SHAPES[name], 10), seed=0)
    lone, runs = [], []
    for i, (data, loss) in enumerate(zip(datas, losses)):
        model = copy.deepcopy(base)
        torch.manual_seed(7 + i)
        stats = train(model, data, loss, settings, torch.Generator().manual_seed(7 + i))
        lone.append((model, stats))
        runs.append(ClientRun(copy.deepcopy(base), data, loss,
                              torch.Generator().manual_seed(7 + i), 7 + i))
    return base, lone, runs, train_stacked(runs, settings)


@pytest.mark.parametrize("name", ["lenet", "mlp"])
@pytest.mark.parametrize("corrected", [False, True])
def test_clients_stepped_together_train_as_each_alone(name, corrected):
    """Three clients of 37, 50 and 23 samples (ragged last batches, a different number
    of steps each), 2 epochs, momentum and weight decay; cross-entropy, or the
    forward-corrected loss with each client's own Q."""
    sizes = [37, 50, 23]
    losses = ([partial(forward_corrected_loss, q=q) for q in noise_matrices(3)] if corrected
              else [cross_entropy] * 3)
    settings = SGDSettings(epochs=2, batch_size=8, lr=0.05, momentum=0.5, weight_decay=1e-3)
    base, lone, runs, stacked = lone_and_stacked(name, client_data(name, sizes), losses,
                                                 settings)
    for (model, stats), run, got in zip(lone, runs, stacked):
        want, have = model.state_dict(), run.model.state_dict()
        moved = max(float((want[k] - base.state_dict()[k]).abs().max()) for k in want)
        assert moved > 1e-3  # the clients trained
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=0, atol=1e-6)
        assert got.mean_accuracy == stats.mean_accuracy
        assert got.mean_loss == pytest.approx(stats.mean_loss, abs=1e-6)


def relative_distance(have: dict, want: dict, before: dict, keys: list[str]) -> float:
    """||have - want|| / ||want - before|| over the tensors ``keys``, flattened together."""
    def flat(a, b):
        return torch.cat([(a[k] - b[k]).flatten() for k in keys])
    return float(flat(have, want).norm() / flat(want, before).norm())


@pytest.mark.parametrize(("name", "sizes"), [("cnn9", [8, 12]), ("resnet18", [8, 6])])
def test_batchnorm_dropout_and_augmentation_follow_each_client(name, sizes):
    """The 9-conv CNN (BatchNorm, Dropout2d: each client's masks), two clients of 8 and
    12 samples at batch 8: 1 and 2 steps, the second of another size; ResNet-18
    (BatchNorm, random crops and flips from each client's generator), one step each of
    8 and 6 samples (a ResNet on random labels amplifies a rounding difference past any
    tolerance within a few steps: its lone update on 1 thread against 2 differs by 2 %
    after 3 steps)."""
    datas = client_data(name, sizes, augment=name == "resnet18")
    settings = SGDSettings(epochs=1, batch_size=8, lr=1e-2, momentum=0.9)
    base, lone, runs, stacked = lone_and_stacked(name, datas, [cross_entropy] * 2, settings)
    before = base.state_dict()
    for (model, stats), run, got in zip(lone, runs, stacked):
        want, have = model.state_dict(), run.model.state_dict()
        counted = [k for k in want if want[k].dtype == torch.long]  # num_batches_tracked
        assert counted and all(torch.equal(have[k], want[k]) for k in counted)
        running = [k for k in want if "running_" in k]
        params = [k for k in want if k not in counted and k not in running]
        assert relative_distance(have, want, before, params) < 1e-2
        assert relative_distance(have, want, before, running) < 1e-3
        assert got.mean_accuracy == stats.mean_accuracy
        assert got.mean_loss == pytest.approx(stats.mean_loss, rel=1e-5)


def test_what_cannot_be_stepped_together_is_refused():
    datas = client_data("lenet", [8, 8])
    model = build_model("lenet", TaskShape(SHAPES["lenet"], 10), seed=0)
    fp32 = SGDSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.0)

    def runs(losses, m=model):
        return [ClientRun(copy.deepcopy(m), d, loss, torch.Generator(), 0)
                for d, loss in zip(datas, losses)]

    q = noise_matrices(1)[0]
    with pytest.raises(NotStackable, match="losses differ"):
        train_stacked(runs([cross_entropy, partial(forward_corrected_loss, q=q)]), fp32)
    with pytest.raises(NotStackable, match="precision 'bf16'"):
        train_stacked(runs([cross_entropy] * 2), SGDSettings(1, 8, 0.1, 0.0, precision="bf16"))
    with pytest.raises(NotStackable, match="more than tensor keywords"):
        train_stacked(runs([partial(forward_corrected_loss, q=q.numpy())] * 2), fp32)
    alpha = nn.Sequential(nn.Flatten(), nn.AlphaDropout(0.2), nn.Linear(784, 10))
    with pytest.raises(NotStackable, match="AlphaDropout"):
        train_stacked(runs([cross_entropy] * 2, alpha), fp32)
