"""The local step captured once and replayed (``step-capture = "cuda-graph"``).

On a GPU a client's step is bound by launching kernels, not by arithmetic: the paper's
models on their batches (the 9-conv CNN at 64 MNIST images, ResNet-18 at 10 CIFAR
images) launch hundreds of small kernels per step (docs/BENCHMARKS.md, "GPU"). A CUDA
graph records the step's kernels once and replays them all with one launch. A graph
needs static shapes and static memory, so the step here:

- reads its batch from static buffers (the normalized batch and its labels, copied in
  before each step; the augmentation and normalization stay outside, on the batch);
- adds its loss and its correct count into static accumulators, read once per epoch;
- finds the optimizer's momentum buffers already made: the first full-size steps run
  eagerly on a side stream (the warm-up PyTorch's recipe asks for), the next one is
  captured and replayed, and every later one only replayed;
- runs a batch of another size (an epoch's ragged last batch) eagerly, on the same
  parameters, momentum buffers and accumulators.

Each call of :func:`train_captured` (one client's local update) captures its own graph,
so nothing a graph holds (a round's Q, a client's anchor) outlives the round. It serves
the methods whose local update is :func:`common.training.train` (a loss of (logits,
labels) plus an optional regularizer of the model, with the project's SGD): FedAvg,
FedEFC in both phases, FedProx, FedDitto (both its models), FedCorr, confident learning
and forward correction. The methods whose loss sees the whole batch (FedNoRo, RoFL:
``common.training.train_batches``) keep the eager loop.

On the CPU there are no graphs: the same static-buffer step runs eagerly and computes
today's update bitwise (tests/test_training.py), which is what a machine without a GPU
can check of this path.
"""

from __future__ import annotations

import torch
from torch import nn

from .training import (
    LossFn,
    Optimizer,
    Regularizer,
    SGDSettings,
    TrainingSet,
    TrainStats,
    make_optimizer,
    run_steps,
)

WARMUP_STEPS = 3  # eager full-size steps before the capture (PyTorch's recipe: a few)


class StaticStep:
    """One training step on static buffers; replayed from a CUDA graph when ``graphs``."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, regularizer: Regularizer | None,
                 optimizer: Optimizer, batch: torch.Tensor, bf16: bool, graphs: bool):
        self.model, self.loss_fn, self.regularizer = model, loss_fn, regularizer
        self.optimizer, self.bf16, self.graphs = optimizer, bf16, graphs
        device = batch.device
        self.x = torch.zeros_like(batch)
        self.y = torch.zeros(len(batch), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warmed = 0

    def body(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The step: forward, loss, backward, optimizer step, the sums (in place)."""
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                            cache_enabled=False):
            logits = self.model(x)
            loss = self.loss_fn(logits, y)
            if self.regularizer is not None:
                loss = loss + self.regularizer(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss_sum += loss.detach()
        self.correct += (logits.detach().argmax(1) == y).sum()

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor, idx: torch.Tensor) -> None:
        if xb.shape != self.x.shape:  # a ragged batch: eagerly
            self.body(xb, yb)
            return
        self.x.copy_(xb)
        self.y.copy_(yb)
        if not self.graphs:
            self.body(self.x, self.y)
        elif self.graph is not None:
            self.graph.replay()
        elif self.warmed < WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.body(self.x, self.y)
            torch.cuda.current_stream().wait_stream(side)
            self.warmed += 1
        else:
            self.graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph):
                self.body(self.x, self.y)
            self.graph.replay()  # capturing records the step; replaying takes it


def train_captured(model: nn.Module, data: TrainingSet, loss_fn: LossFn,
                   settings: SGDSettings, generator: torch.Generator,
                   regularizer: Regularizer | None = None) -> TrainStats:
    """:func:`common.training.train` with the step of :class:`StaticStep`: the same
    batches, the same update (bitwise on the CPU), graphs on CUDA."""
    optimizer = make_optimizer(model, "sgd", settings.lr, settings.momentum,
                               settings.weight_decay)
    return run_steps(model, data, settings, generator, lambda xb: StaticStep(
        model, loss_fn, regularizer, optimizer, xb, settings.precision == "bf16",
        xb.device.type == "cuda"))
