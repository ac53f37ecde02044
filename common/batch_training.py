"""A local training loop whose loss sees the whole batch, for the noise-robust baselines.

:func:`common.training.train` takes a loss of (logits, labels). FedNoRo's distillation
needs the teacher's output on the same (augmented) batch and RoFL's loss needs the
features, the samples' indices (pseudo-labels) and a centroid update after every
step; here the loss is a function of (model, inputs, labels, indices). Batching,
augmentation and the reported statistics are those of :func:`common.training.train`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from .training import BatchTransform, TrainStats, batches

# (model, normalized inputs, labels, sample indices) -> (loss, logits for accuracy)
BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]
OPTIMIZERS = ("sgd", "adam")


def make_optimizer(model: nn.Module, name: str, lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """A fresh optimizer: SGD (the project's, ALGORITHM.md section 2) or Adam
    (FedNoRo's reference, betas (0.9, 0.999); ``momentum`` unused)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                               weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r} is unknown; use one of {OPTIMIZERS}")


def train_batches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_loss: BatchLoss,
                  optimizer: torch.optim.Optimizer, epochs: int, batch_size: int,
                  transform: BatchTransform, augment: bool, generator: torch.Generator,
                  ) -> TrainStats:
    """``epochs`` passes over (x, y) in shuffled batches, one optimizer step per batch."""
    model.train()
    total_loss, steps, epoch_accs = 0.0, 0, []
    for _ in range(epochs):
        correct, seen = 0, 0
        for idx in batches(len(y), batch_size, generator):
            idx = idx.to(x.device)
            xb, yb = transform(x[idx], augment, generator), y[idx]
            loss, logits = batch_loss(model, xb, yb, idx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach())
            steps += 1
            correct += int((logits.detach().argmax(1) == yb).sum())
            seen += len(yb)
        if seen:
            epoch_accs.append(correct / seen)
    return TrainStats(mean_loss=total_loss / max(steps, 1),
                      mean_accuracy=float(np.mean(epoch_accs)) if epoch_accs else 0.0,
                      steps=steps)


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
