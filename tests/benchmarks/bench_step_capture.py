"""Benchmark: one client's local update with its step replayed from a CUDA graph against
today's eager loop (``step-capture = "cuda-graph"`` against ``"off"``; common/step_capture.py).

Per model of the paper's presets, on synthetic data of its shape and a client's size
(the 9-conv CNN on 600 MNIST-shaped images at batch 64; ResNet-18 and ResNet-34 on 500
CIFAR-shaped images at batch 10, augmented), E = ``--epochs``: each loop runs once to warm
up, then ``--repeats`` times from the same weights and seeds. Printed per model: ms per
step of each loop, the speed-up, samples/s, and how far the captured loop's weights lie
from the eager loop's (max absolute difference; 0 on the CPU, where both compute the
same update bitwise, and a stated tolerance on a GPU, where kernels may round
differently). ``gpu_session.sh`` runs it on the device (step ``capture``).

    python tests/benchmarks/bench_step_capture.py [--device cuda] [--models cnn9,resnet18]
        [--epochs 1] [--repeats 3] [--tiny]

``--tiny``: LeNet on 200 images on the CPU, the CPU's check of the path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.losses import cross_entropy
from common.models import TaskShape, build_model
from common.step_capture import train_captured
from common.training import BatchTransform, SGDSettings, TrainingSet, configure_threads, train

SHAPES = {"lenet": ((1, 28, 28), 200, 32, False), "cnn9": ((1, 28, 28), 600, 64, False),
          "resnet18": ((3, 32, 32), 500, 10, True), "resnet34": ((3, 32, 32), 500, 10, True)}


def one_model(name: str, device: torch.device, epochs: int, repeats: int) -> dict:
    shape, n, batch, augment = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen).to(device)
    y = torch.randint(0, 10, (n,), generator=gen).to(device)
    c = shape[0]
    data = TrainingSet(x, y, BatchTransform((0.5,) * c, (0.25,) * c, device), augment)
    settings = SGDSettings(epochs=epochs, batch_size=batch, lr=0.03, momentum=0.5)
    start = build_model(name, TaskShape(shape, 10), 0).to(device).state_dict()
    model = build_model(name, TaskShape(shape, 10), 0).to(device)
    steps = epochs * (n // batch + (n % batch > 1))
    out: dict = {"model": name, "steps": steps, "samples": epochs * n}
    for label, loop in (("eager", train), ("captured", train_captured)):
        times = []
        for rep in range(repeats + 1):  # the first call warms up (allocator, cuDNN, kernels)
            model.load_state_dict(start)
            torch.manual_seed(3)
            if device.type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            loop(model, data, cross_entropy, settings, torch.Generator().manual_seed(1))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                times.append(time.perf_counter() - begin)
        out[label] = 1000 * statistics.median(times) / steps
        out[f"{label}_weights"] = [v.detach().clone() for v in model.state_dict().values()]
    out["max_abs_diff"] = max((a.double() - b.double()).abs().max().item() for a, b in
                              zip(out.pop("eager_weights"), out.pop("captured_weights")))
    out["speedup"] = out["eager"] / out["captured"]
    out["samples_per_s_captured"] = 1000 * out["samples"] / (out["captured"] * steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="cnn9,resnet18,resnet34")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="LeNet, 200 images, on the CPU")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else args.device)
    models = ["lenet"] if args.tiny else args.models.split(",")
    if device.type == "cpu":
        configure_threads(1)  # as a simulated client's actor: one CPU
    print(f"one client's local update, E = {args.epochs}, {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU'})")
    print(f"{'model':<10} {'steps':>6} {'eager ms/step':>14} {'captured':>9} {'speed-up':>9} "
          f"{'samples/s':>10} {'max |w diff|':>13}")
    for name in models:
        r = one_model(name, device, args.epochs, args.repeats)
        print(f"{name:<10} {r['steps']:>6} {r['eager']:>14.2f} {r['captured']:>9.2f} "
              f"{r['speedup']:>8.2f}x {r['samples_per_s_captured']:>10.0f} "
              f"{r['max_abs_diff']:>13.3g}", flush=True)
        if device.type == "cpu" and r["max_abs_diff"] != 0.0:
            raise SystemExit(f"{name}: the captured loop differs from the eager one on the "
                             "CPU, where both must compute the same update bitwise")


if __name__ == "__main__":
    main()
