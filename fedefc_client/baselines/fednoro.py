"""FedNoRo's local update (Wu et al., IJCAI 2023; docs/BASELINE-METHODS.md, "FedNoRo";
its schedule in :mod:`common.baselines.fednoro`, its losses below).

A training message trains with logit-adjusted cross-entropy (warm-up, and clean
clients afterwards) or, on a client the server flagged noisy, with the distillation
loss whose teacher is the received global model. The optimizer is the project's SGD
unless ``fednoro-optimizer=adam`` (the reference's Adam, lr ``fednoro-adam-lr``,
weight decay ``fednoro-adam-weight-decay``).

The detection message (``fednoro-task``; no training) returns the received global
model's mean cross-entropy per class on the local data. FedNoRo keeps no client
state. Everything exchanged: :class:`FedNoRoMessages`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.baselines.fednoro import FedNoRoMessages as M
from common.baselines.fednoro import (
    FedNoRoSettings,
    log_prior,
    per_class_mean_loss,
)
from common.exchange import pack_array
from common.messages import FitReply
from common.runtime import model_for
from common.training import TrainStats, make_optimizer, predict_logits

from ..job import LocalJob
from ..local_update import Update


def fednoro(job: LocalJob) -> Update:
    if job.config.get(M.TASK) is not None:
        return _class_losses(job)
    cfg, settings = job.cfg, job.cfg.settings(FedNoRoSettings)
    log_pi = torch.as_tensor(log_prior(job.labels, job.local.data.num_classes),
                             dtype=torch.float32, device=job.device)
    if int(job.config.get(M.NOISY, 0)):
        teacher = model_for(cfg, job.local.data.task, job.device, slot="fednoro-teacher")
        teacher.load_state_dict(job.model.state_dict())
        teacher.eval()
        weight, temperature = float(job.config[M.KD_WEIGHT]), settings.fednoro_temperature

        def batch_loss(model, xb, yb, idx):
            logits = model(xb)
            with torch.no_grad():
                teacher_logits = teacher(xb)
            return distillation_loss(logits, yb, teacher_logits, log_pi, weight,
                                     temperature), logits
        name = "logit-adjusted+distillation"
    else:
        def batch_loss(model, xb, yb, idx):
            logits = model(xb)
            return logit_adjusted_ce(logits, yb, log_pi), logits
        name = "logit-adjusted"
    if settings.fednoro_optimizer == "adam":
        optimizer = make_optimizer(job.model, "adam", settings.fednoro_adam_lr, 0.0,
                                   settings.fednoro_adam_weight_decay)
    else:
        optimizer = make_optimizer(job.model, "sgd", cfg.lr, cfg.momentum, cfg.weight_decay)
    return len(job.labels), {FitReply.LOSS: name}, job.train_batches(batch_loss, optimizer)


def _class_losses(job: LocalJob) -> Update:
    """The received global model's mean cross-entropy per class (NaN: class absent)."""
    if job.config[M.TASK] != M.CLASS_LOSSES_TASK:
        raise ValueError(f"{M.TASK}={job.config[M.TASK]!r} is unknown; expected "
                         f"{M.CLASS_LOSSES_TASK!r}")
    logits = predict_logits(job.model, job.local.x, job.transform, job.cfg.eval_batch_size)
    losses = F.cross_entropy(logits.double(), job.local.y, reduction="none").cpu().numpy()
    per_class = per_class_mean_loss(losses, job.labels, job.local.data.num_classes)
    return 0, {FitReply.LOSS: "none (detection)", M.CLASS_LOSSES: pack_array(per_class)}, \
        TrainStats(0.0, 0.0)


# -- its torch math (here, not in common/: the run-config schema imports no torch) --
def logit_adjusted_ce(logits: torch.Tensor, labels: torch.Tensor,
                      log_pi: torch.Tensor) -> torch.Tensor:
    """CE(z + log pi, y), mean over the batch."""
    return F.cross_entropy(logits + log_pi, labels)


def _adjusted_log_probs(logits: torch.Tensor, log_pi: torch.Tensor) -> torch.Tensor:
    log_pred = torch.log_softmax(logits + log_pi, dim=1)
    return torch.where(torch.isinf(log_pred), torch.zeros_like(log_pred), log_pred)


def distillation_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor,
                      log_pi: torch.Tensor, weight: float, temperature: float) -> torch.Tensor:
    """The noisy clients' loss (module docstring); KL averaged over the batch."""
    log_pred = _adjusted_log_probs(logits, log_pi)
    soft = torch.softmax(teacher_logits / temperature, dim=1)
    kl = F.kl_div(log_pred, soft, reduction="batchmean")
    return weight * kl + (1.0 - weight) * F.nll_loss(log_pred, labels)
