"""Benchmark: a round's G clients stepped together against the same clients trained one
after another in one process (common/stacked_training.py against common/training.py:
train).

Per model of the paper's presets, on synthetic data of its shape and a client's size
(LeNet-5 and the 9-conv CNN on 600 MNIST-shaped images at batch 64; ResNet-18 on 500
CIFAR-shaped images at batch 10, augmented), ``--clients`` clients from one global
model, E = ``--epochs``: each path runs once to warm up, then ``--repeats`` times.
Printed per model: seconds for the G local updates on each path, the speed-up,
samples/s stepped together, and how far the stacked weights lie from the lone ones
(the largest distance over the clients of all parameters, relative to the lone update's
change; tests/test_stacked_training.py states why it is not 0). ``gpu_session.sh`` runs
it on the device (step ``stacked``).

    python tests/benchmarks/bench_stacked.py [--device cuda] [--models lenet,cnn9,resnet18]
        [--clients 10] [--epochs 1] [--repeats 2] [--tiny]

``--tiny``: LeNet, 4 clients of 200 images, on the CPU (the rehearsal of the step).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common.losses import cross_entropy
from common.models import TaskShape, build_model
from common.stacked_training import ClientRun, train_stacked
from common.training import BatchTransform, SGDSettings, TrainingSet, configure_threads, train

SHAPES = {"lenet": ((1, 28, 28), 600, 64, False), "cnn9": ((1, 28, 28), 600, 64, False),
          "resnet18": ((3, 32, 32), 500, 10, True)}


def client_sets(shape, n: int, clients: int, augment: bool, device) -> list[TrainingSet]:
    c = shape[0]
    transform = BatchTransform((0.5,) * c, (0.25,) * c, device)
    out = []
    for k in range(clients):
        gen = torch.Generator().manual_seed(k)
        x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen).to(device)
        y = torch.randint(0, 10, (n,), generator=gen).to(device)
        out.append(TrainingSet(x, y, transform, augment))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_model(name: str, device: torch.device, clients: int, n: int | None, epochs: int,
              repeats: int) -> dict:
    shape, size, batch, augment = SHAPES[name]
    n = n or size
    datas = client_sets(shape, n, clients, augment, device)
    settings = SGDSettings(epochs=epochs, batch_size=batch, lr=0.03, momentum=0.5)
    base = build_model(name, TaskShape(shape, 10), 0).to(device)

    def lone() -> list[torch.nn.Module]:
        models = []
        for k, data in enumerate(datas):
            model = copy.deepcopy(base)
            torch.manual_seed(k)
            train(model, data, cross_entropy, settings, torch.Generator().manual_seed(k))
            models.append(model)
        return models

    def stacked() -> list[torch.nn.Module]:
        runs = [ClientRun(copy.deepcopy(base), data, cross_entropy,
                          torch.Generator().manual_seed(k), k) for k, data in enumerate(datas)]
        train_stacked(runs, settings)
        return [r.model for r in runs]

    out: dict = {"model": name, "clients": clients, "samples": clients * epochs * n}
    trained = {}
    for label, path in (("lone", lone), ("stacked", stacked)):
        times = []
        for rep in range(repeats + 1):  # the first call warms up (allocator, kernels)
            sync(device)
            begin = time.perf_counter()
            trained[label] = path()
            sync(device)
            if rep:
                times.append(time.perf_counter() - begin)
        out[label] = statistics.median(times)
    start = base.state_dict()
    far = 0.0
    for a, b in zip(trained["lone"], trained["stacked"]):
        want, have = a.state_dict(), b.state_dict()
        keys = [k for k in want if want[k].is_floating_point() and "running_" not in k]
        gap = torch.cat([(have[k] - want[k]).flatten() for k in keys]).norm()
        change = torch.cat([(want[k] - start[k]).flatten() for k in keys]).norm()
        far = max(far, float(gap / change))
    out["relative_distance"] = far
    out["speedup"] = out["lone"] / out["stacked"]
    out["samples_per_s_stacked"] = out["samples"] / out["stacked"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="lenet,cnn9,resnet18")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="LeNet, 4 clients of 200, on the CPU")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else args.device)
    models = ["lenet"] if args.tiny else args.models.split(",")
    clients, n = (4, 200) if args.tiny else (args.clients, None)
    if device.type == "cpu":
        configure_threads(1)  # as a simulated client's actor: one CPU
    print(f"{clients} clients' local updates, E = {args.epochs}, {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU'})")
    print(f"{'model':<10} {'lone s':>8} {'stacked s':>10} {'speed-up':>9} {'samples/s':>10} "
          f"{'distance':>9}")
    for name in models:
        r = one_model(name, device, clients, n, args.epochs, args.repeats)
        print(f"{name:<10} {r['lone']:>8.2f} {r['stacked']:>10.2f} {r['speedup']:>8.2f}x "
              f"{r['samples_per_s_stacked']:>10.0f} {r['relative_distance']:>9.2g}", flush=True)


if __name__ == "__main__":
    main()
