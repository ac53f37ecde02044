"""Benchmark: one client's local update with its step replayed from a CUDA graph against
today's eager loop (``step-capture = "cuda-graph"`` against ``"off"``; common/step_capture.py).

Per model of the paper's presets, on synthetic data of its shape and a client's size
(the 9-conv CNN on 600 MNIST-shaped images at batch 64; ResNet-18 and ResNet-34 on 500
CIFAR-shaped images at batch 10, augmented), E = ``--epochs``: each loop runs once to warm
up, then ``--repeats`` times from the same weights and seeds. Printed per model: ms per
step of each loop, the speed-up, samples/s, and how far apart the weights lie, the
integer buffers (BatchNorm's step counts) left out:

- **one step**: from one state (weights, momentum buffers, BatchNorm statistics, the
  static batch, the dropout generator), the captured step replayed once against the same
  step run eagerly, and two eager runs of it against each other (cuDNN's
  non-deterministic kernels: the floor no path can beat). The tolerance, printed as
  ``ok`` or ``OVER``: the captured step within the larger of the two eager runs'
  difference and 1e-6 of the state's largest magnitude. On the CPU there is no graph
  and the step is the eager one: 0;
- **after all the steps** (the column ``steps``: 10 for the CNN, 50 for the ResNets at
  E = 1): the captured loop against the eager loop, and the eager loop against itself
  started from weights one float32 step away in one layer (``nextafter``): how far a
  one-ulp difference carries through the run (see docs/BENCHMARKS.md, "The captured
  step"), beside the state's largest magnitude, which a BatchNorm running variance sets.

``gpu_session.sh`` runs it on the device (step ``capture``).

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
from common.step_capture import WARMUP_STEPS, StaticStep, train_captured
from common.training import (
    BatchTransform,
    SGDSettings,
    TrainingSet,
    configure_threads,
    make_optimizer,
    train,
)

SHAPES = {"lenet": ((1, 28, 28), 200, 32, False), "cnn9": ((1, 28, 28), 600, 64, False),
          "resnet18": ((3, 32, 32), 500, 10, True), "resnet34": ((3, 32, 32), 500, 10, True)}
ONE_STEP_RELATIVE = 1e-6  # the one-step tolerance beside the eager floor (module docstring)


def float_state(model: torch.nn.Module, buffers: list[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Copies of the model's floating-point state (parameters, BatchNorm statistics; the
    integer step counts left out) and of ``buffers`` (an optimizer's momentum)."""
    state = [v for v in model.state_dict().values() if v.is_floating_point()]
    return [v.detach().clone() for v in [*state, *buffers]]


def largest_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def largest(state: list[torch.Tensor]) -> float:
    return max(v.double().abs().max().item() for v in state)


def one_step(name: str, device: torch.device, data: TrainingSet, settings: SGDSettings,
             start: dict) -> dict:
    """One step from one state: replayed from the graph, run eagerly, run eagerly again."""
    model = build_model(name, TaskShape(tuple(data.x.shape[1:]), 10), 0).to(device)
    model.load_state_dict(start)
    model.train()
    optimizer = make_optimizer(model, "sgd", settings.lr, settings.momentum,
                               settings.weight_decay)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randperm(len(data.y), generator=gen)[:settings.batch_size].to(device)
    xb = data.transform(data.x.index_select(0, idx), data.augment, gen)
    yb = data.y.index_select(0, idx)
    step = StaticStep(model, cross_entropy, None, optimizer, xb, False,
                      device.type == "cuda")
    torch.manual_seed(3)
    for _ in range(WARMUP_STEPS + 1):  # warm-up, then the capture (and its first replay)
        step(xb, yb, idx)
    live = [t for t in model.state_dict().values()] + [b for b in optimizer.buffers
                                                       if b is not None]
    saved = [t.detach().clone() for t in live]
    rng = torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()

    def restore() -> None:
        with torch.no_grad():
            for t, s in zip(live, saved):
                t.copy_(s)
        (torch.cuda.set_rng_state if device.type == "cuda" else torch.set_rng_state)(rng)

    momentum = [b for b in optimizer.buffers if b is not None]
    runs = {}
    for label in ("captured", "eager", "eager again"):
        restore()
        if label == "captured" and step.graph is not None:
            step.graph.replay()
        else:
            step.body(step.x, step.y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs[label] = float_state(model, momentum)
    floor = largest_gap(runs["eager"], runs["eager again"])
    gap = largest_gap(runs["captured"], runs["eager"])
    bound = max(floor, ONE_STEP_RELATIVE * largest(runs["eager"]))
    return {"one_step": gap, "one_step_eager_floor": floor, "one_step_ok": gap <= bound,
            "graph": step.graph is not None}


def one_model(name: str, device: torch.device, epochs: int, repeats: int) -> dict:
    shape, n, batch, augment = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen).to(device)
    y = torch.randint(0, 10, (n,), generator=gen).to(device)
    c = shape[0]
    data = TrainingSet(x, y, BatchTransform((0.5,) * c, (0.25,) * c, device), augment)
    settings = SGDSettings(epochs=epochs, batch_size=batch, lr=0.03, momentum=0.5)
    start = build_model(name, TaskShape(shape, 10), 0).to(device).state_dict()
    nudged = {k: v.clone() for k, v in start.items()}
    first = next(k for k, v in nudged.items() if v.is_floating_point())
    flat = nudged[first].view(-1)  # one float32 step in the first layer's first weight
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), device=device))
    model = build_model(name, TaskShape(shape, 10), 0).to(device)
    steps = epochs * (n // batch + (n % batch > 1))
    out: dict = {"model": name, "steps": steps, "samples": epochs * n}
    finals = {}
    loops = (("eager", train, start, repeats), ("captured", train_captured, start, repeats),
             ("eager, one ulp away", train, nudged, 0))
    for label, loop, weights, reps in loops:
        times = []
        for rep in range(reps + 1):  # the first call warms up (allocator, cuDNN, kernels)
            model.load_state_dict(weights)
            torch.manual_seed(3)
            if device.type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            loop(model, data, cross_entropy, settings, torch.Generator().manual_seed(1))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                times.append(time.perf_counter() - begin)
        if times:
            out[label] = 1000 * statistics.median(times) / steps
        finals[label] = float_state(model)
    out["all_steps"] = largest_gap(finals["eager"], finals["captured"])
    out["all_steps_one_ulp"] = largest_gap(finals["eager"], finals["eager, one ulp away"])
    out["largest"] = largest(finals["eager"])
    out["speedup"] = out["eager"] / out["captured"]
    out["samples_per_s_captured"] = 1000 * out["samples"] / (out["captured"] * steps)
    out.update(one_step(name, device, data, settings, start))
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
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU'}); "
          "weight differences: max |a - b| over the float state (parameters, BatchNorm "
          "statistics; the momentum too for one step)")
    print(f"{'model':<9} {'steps':>5} {'eager ms':>9} {'captured':>9} {'speed-up':>8} "
          f"{'samples/s':>9} | {'1 step':>8} {'eager/eager':>11} {'within':>6} | "
          f"{'all steps':>9} {'1-ulp start':>11} {'max |w|':>8}")
    for name in models:
        r = one_model(name, device, args.epochs, args.repeats)
        print(f"{name:<9} {r['steps']:>5} {r['eager']:>9.2f} {r['captured']:>9.2f} "
              f"{r['speedup']:>7.2f}x {r['samples_per_s_captured']:>9.0f} | "
              f"{r['one_step']:>8.2g} {r['one_step_eager_floor']:>11.2g} "
              f"{'ok' if r['one_step_ok'] else 'OVER':>6} | {r['all_steps']:>9.3g} "
              f"{r['all_steps_one_ulp']:>11.3g} {r['largest']:>8.3g}", flush=True)
        if device.type == "cpu" and (r["all_steps"] != 0.0 or r["one_step"] != 0.0):
            raise SystemExit(f"{name}: the captured loop differs from the eager one on the "
                             "CPU, where both must compute the same update bitwise")
        if device.type == "cuda" and not r["graph"]:
            raise SystemExit(f"{name}: no graph was captured for the one-step check")


if __name__ == "__main__":
    main()
