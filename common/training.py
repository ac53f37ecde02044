"""Local training and evaluation loops over uint8 image or float32 feature tensors.

Batches are built by indexing a tensor that already sits on the training device;
normalization (and, where the dataset asks, random crop + flip) is done on the batch
tensor, with no per-sample PIL work (docs/FEDEFC.md §2.3-2.4). A fresh SGD optimizer
every round: :class:`SGD`, PyTorch's update without ``torch.optim`` (see there why).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from .datasets import DataSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Regularizer = Callable[[nn.Module], torch.Tensor]


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible; use device=auto or cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def configure_threads(requested: int = 0) -> int:
    """Match torch's intra-op threads to this process's CPUs.

    ``requested`` > 0 wins; otherwise OMP_NUM_THREADS (Ray sets it to the CPUs it
    gave the actor), otherwise the CPUs this process may run on.
    """
    n = requested or int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


class BatchTransform:
    """A batch of uint8 N x C x H x W images or float32 N x D features -> the normalized
    float batch, (x - mean) / std per channel (mean and std in pixel/255 units) or per
    feature; images optionally augmented."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device,
                 images: bool = True):
        if images:
            self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255.0
            self.std = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255.0
        else:
            self.mean = torch.tensor(mean, device=device).view(1, -1)
            self.std = torch.tensor(std, device=device).view(1, -1)

    @classmethod
    def of(cls, spec: DataSpec, device: torch.device) -> BatchTransform:
        """The transform of a dataset's :class:`DataSpec`."""
        return cls(spec.mean, spec.std, device, images=spec.images)

    def __call__(self, xb: torch.Tensor, augment: bool = False,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        if augment:
            xb = random_crop_flip(xb, generator)
        return (xb.float() - self.mean) / self.std


def random_crop_flip(xb: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """RandomCrop(size, padding=pad) + RandomHorizontalFlip, vectorized over the batch;
    pad = max(1, min(H, W) // 8): 4 for CIFAR's 32 x 32."""
    n, _, h, w = xb.shape
    pad = max(1, min(h, w) // 8)
    padded = nn.functional.pad(xb, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(xb.device)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(xb.device)
    flip = (torch.rand(n, generator=generator) < 0.5).to(xb.device)
    rows = (dy[:, None] + torch.arange(h, device=xb.device)[None, :])  # n x h
    cols = dx[:, None] + torch.arange(w, device=xb.device)[None, :]  # n x w
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=xb.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


@dataclass(frozen=True)
class SGDSettings:
    """The local optimizer (docs/FEDEFC.md §2.3)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float = 0.0
    precision: str = "fp32"  # "bf16": forward and loss under bfloat16 autocast


@dataclass(frozen=True)
class TrainStats:
    """What one local update measured."""

    mean_loss: float
    mean_accuracy: float  # training accuracy averaged over the local epochs


def batches(n: int, batch_size: int, generator: torch.Generator,
            device: torch.device | None = None) -> list[torch.Tensor]:
    """A shuffled epoch as index batches (on ``device``: one copy per epoch, not one per
    batch); a trailing batch of one sample is dropped (BatchNorm cannot train on it)
    unless it is the only sample."""
    perm = torch.randperm(n, generator=generator).to(device)
    out = list(perm.split(batch_size))
    if len(out) > 1 and len(out[-1]) == 1:
        out.pop()
    return out


@dataclass(frozen=True)
class TrainingSet:
    """What local training draws its batches from: uint8 images and their labels, both on
    the training device, the batch transform, and whether batches are augmented."""

    x: torch.Tensor
    y: torch.Tensor
    transform: BatchTransform
    augment: bool = False


# (model, normalized inputs, labels, sample indices) -> (loss, logits for accuracy)
BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]
OPTIMIZERS = ("sgd", "adam")


class Optimizer(Protocol):
    """What local training needs of an optimizer (:class:`SGD`, ``torch.optim.Adam``)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> None: ...


class SGD:
    """SGD with momentum and weight decay: ``torch.optim.SGD``'s update (dampening 0, no
    Nesterov) as its one-tensor-at-a-time implementation (``_single_tensor_sgd``, the one
    it runs on CPU) computes it, bitwise (tests/test_training.py). Without ``torch.optim``:
    its ``step()`` imports ``torch._dynamo`` (with sympy and triton), about 2 s of CPU, in
    every process that trains, and a deployment's SuperNode trains in a fresh process per
    message (docs/BENCHMARKS.md, "Deployment against Flower's floor"). On CUDA
    ``torch.optim.SGD`` runs its multi-tensor kernels by default, the same operations per
    element, which may round differently in the last bit."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            if self.weight_decay != 0:
                grad = grad.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = torch.clone(grad).detach()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)


def make_optimizer(model: nn.Module, name: str, lr: float, momentum: float,
                   weight_decay: float) -> Optimizer:
    """A fresh optimizer: SGD (the project's, docs/FEDEFC.md §2.3) or Adam
    (FedNoRo's reference, betas (0.9, 0.999); ``momentum`` unused)."""
    if name == "sgd":
        return SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r} is unknown; use one of {OPTIMIZERS}")


class Step(Protocol):
    """One optimizer step on a batch (inputs, labels, sample indices) that adds its loss
    and its count of correct predictions into ``loss_sum`` and ``correct``, tensors on
    the training device (no host sync per step: the GPU runs ahead of the loop)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor, idx: torch.Tensor) -> None: ...


def batch_stream(data: TrainingSet, settings: SGDSettings, generator: torch.Generator
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(epoch, normalized batch, labels, sample indices): ``settings.epochs`` passes over
    ``data`` in shuffled batches of ``settings.batch_size``, ``generator`` fixing the
    order and the augmentation (the draws of :func:`run_steps`, in its order)."""
    x, y = data.x, data.y
    for epoch in range(settings.epochs):
        for idx in batches(len(y), settings.batch_size, generator, x.device):
            # index_select: advanced indexing x[idx] of a uint8 batch takes 7x as long on
            # CPU (docs/BENCHMARKS.md, "Planning a round"), the same rows
            xb = data.transform(x.index_select(0, idx), data.augment, generator)
            yield epoch, xb, y.index_select(0, idx), idx


def run_steps(model: nn.Module, data: TrainingSet, settings: SGDSettings,
              generator: torch.Generator, make_step: Callable[[torch.Tensor], Step]
              ) -> TrainStats:
    """One step per batch of :func:`batch_stream`; the step is made from the first batch
    (:class:`EagerStep`, or the captured step of ``common/step_capture.py``)."""
    model.train()
    step: Step | None = None
    steps, epoch_accs, seen, current = 0, [], 0, 0

    def close_epoch() -> None:  # the training accuracy of the epoch that ended
        if seen:
            epoch_accs.append(int(step.correct) / seen)
            step.correct.zero_()

    for epoch, xb, yb, idx in batch_stream(data, settings, generator):
        if epoch != current:
            close_epoch()
            current, seen = epoch, 0
        if step is None:
            step = make_step(xb)
        step(xb, yb, idx)
        steps += 1
        seen += len(yb)
    close_epoch()
    total = 0.0 if step is None else float(step.loss_sum)
    return TrainStats(mean_loss=total / max(steps, 1),
                      mean_accuracy=float(np.mean(epoch_accs)) if epoch_accs else 0.0)


class EagerStep:
    """The step as PyTorch runs it, kernel by kernel: ``batch_loss`` sees the whole batch
    (model, inputs, labels, sample indices): FedNoRo's distillation needs the teacher on
    the same augmented batch, RoFL the features and the samples' pseudo-labels."""

    def __init__(self, model: nn.Module, batch_loss: BatchLoss, optimizer: Optimizer,
                 bf16: bool, device: torch.device):
        self.model, self.batch_loss, self.optimizer, self.bf16 = model, batch_loss, optimizer, bf16
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor, idx: torch.Tensor) -> None:
        with torch.autocast(xb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss, logits = self.batch_loss(self.model, xb, yb, idx)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss_sum += loss.detach()
        self.correct += (logits.detach().argmax(1) == yb).sum()


def train_batches(model: nn.Module, data: TrainingSet, batch_loss: BatchLoss,
                  optimizer: Optimizer, settings: SGDSettings,
                  generator: torch.Generator) -> TrainStats:
    """:func:`run_steps` with an :class:`EagerStep` of ``batch_loss``."""
    bf16 = settings.precision == "bf16"
    return run_steps(model, data, settings, generator,
                     lambda xb: EagerStep(model, batch_loss, optimizer, bf16, xb.device))


def train(model: nn.Module, data: TrainingSet, loss_fn: LossFn, settings: SGDSettings,
          generator: torch.Generator, regularizer: Regularizer | None = None) -> TrainStats:
    """Local SGD on ``data`` with ``loss_fn(logits, labels)`` (+ ``regularizer(model)``)."""
    def batch_loss(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor, _idx: torch.Tensor):
        logits = m(xb)
        loss = loss_fn(logits, yb)
        if regularizer is not None:
            loss = loss + regularizer(m)
        return loss, logits

    optimizer = make_optimizer(model, "sgd", settings.lr, settings.momentum,
                               settings.weight_decay)
    return train_batches(model, data, batch_loss, optimizer, settings, generator)


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, transform: BatchTransform,
                  batch_size: int = 1024) -> np.ndarray:
    """Softmax predictions in eval mode, no augmentation (docs/FEDEFC.md §2.4, §4)."""
    model.eval()
    out = [torch.softmax(model(transform(x[i:i + batch_size])), dim=1)
           for i in range(0, len(x), batch_size)]
    if not out:
        return np.zeros((0, 0))
    return torch.cat(out).double().cpu().numpy()


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, transform: BatchTransform,
                   batch_size: int = 1024) -> torch.Tensor:
    """Logits of ``model`` on x, eval mode, no augmentation (any classifier)."""
    model.eval()
    return torch.cat([model(transform(x[i:i + batch_size])) for i in range(0, len(x),
                                                                            batch_size)])


@torch.no_grad()
def predict_logits_features(model: nn.Module, x: torch.Tensor, transform: BatchTransform,
                            batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, penultimate features) of ``model`` on x, eval mode, no augmentation."""
    model.eval()
    logits, feats = [], []
    for i in range(0, len(x), batch_size):
        out, feat = model(transform(x[i:i + batch_size]), return_features=True)
        logits.append(out)
        feats.append(feat)
    return torch.cat(logits), torch.cat(feats)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, transform: BatchTransform,
             batch_size: int = 1024) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on (x, y) in eval mode; the sums stay
    on the device until the end (one copy back, not two per batch: on a GPU the batches
    queue without waiting), the loss summed in float64 batch by batch as a Python float
    would sum it."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    for i in range(0, len(x), batch_size):
        logits = model(transform(x[i:i + batch_size]))
        yb = y[i:i + batch_size]
        loss_sum += nn.functional.cross_entropy(logits, yb, reduction="sum").double()
        correct += (logits.argmax(1) == yb).sum()
    n = max(len(x), 1)
    return float(loss_sum) / n, int(correct) / n


@torch.no_grad()
def evaluate_per_class(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                       transform: BatchTransform, num_classes: int,
                       batch_size: int = 1024) -> np.ndarray:
    """Accuracy of ``model`` on each of the K classes of (x, y); 0 for a class with no
    sample."""
    preds = predict_logits(model, x, transform, batch_size).argmax(1).cpu().numpy()
    labels = y.cpu().numpy()
    k = num_classes
    total = np.bincount(labels, minlength=k)
    correct = np.bincount(labels[preds == labels], minlength=k)
    return np.where(total > 0, correct / np.maximum(total, 1), 0.0)
