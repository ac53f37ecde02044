"""The FedEFC NumPyClient: phase-1 accuracy + cross-entropy, phase-2 forward correction.

Phase 1 (ALGORITHM.md section 3): report A_k, the accuracy of the RECEIVED global
model on the client's own noisy-labelled data (``accuracy-signal=global``) or the
training accuracy averaged over the local epochs (``local-train``), then train with
cross-entropy. Phase 2 (section 4): predictions of the received global model on the
local data give the count matrix and Q; the client trains with the forward-corrected
loss. Q and the labels never leave the client; only weights, the sample count, the
partition id and (phase 1) one accuracy are returned, plus, in simulation with
``diagnostics=true``, two scalars comparing Q with the client's true noise matrix.
"""

from __future__ import annotations

from functools import partial
from logging import INFO

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common.logger import log

from common.config import RunConfig
from common.losses import cross_entropy, forward_corrected_loss
from common.params import get_weights, set_weights
from common.runtime import model_for
from common.training import (BatchTransform, SGDSettings, configure_threads, pick_device,
                             predict_proba, train)
from common.transition import estimate_transition, matrix_agreement

from .local_data import LocalData, partition_data


class FedEFCClient(NumPyClient):
    """One client; built per message by the ClientApp, data loaded lazily and cached."""

    def __init__(self, cfg: RunConfig, partition_id: int):
        self.cfg = cfg
        self.partition_id = partition_id
        self._local: LocalData | None = None

    # The registry asks every node once which partition it serves (no data is loaded).
    def get_properties(self, config):
        return {"partition-id": self.partition_id}

    @property
    def local(self) -> LocalData:
        if self._local is None:
            configure_threads(self.cfg.client_threads)
            self._local = partition_data(self.cfg, self.partition_id, pick_device(self.cfg.device))
        return self._local

    def get_parameters(self, config):
        local = self.local
        return get_weights(model_for(self.cfg, local.data, local.x.device))

    def fit(self, parameters, config):
        local = self.local
        device = local.x.device
        model = model_for(self.cfg, local.data, device)
        set_weights(model, parameters)
        phase, seed = int(config["phase"]), int(config["seed"])
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        transform = BatchTransform(local.data.mean, local.data.std, device)
        metrics: dict = {"partition-id": self.partition_id}
        if len(local) == 0:
            return get_weights(model), 0, metrics
        probs = predict_proba(model, local.x, transform, self.cfg.eval_batch_size)
        if phase == 1:
            loss_fn = cross_entropy
            metrics["loss"] = "cross-entropy"
            global_acc = float(np.mean(probs.argmax(1) == local.labels))
        else:
            q = estimate_transition(probs, local.labels, self.cfg.count_rule, self.cfg.weighting)
            loss_fn = partial(forward_corrected_loss,
                              q=torch.as_tensor(q, dtype=torch.float32, device=device))
            metrics["loss"] = "forward-corrected"
            metrics["q-trace"] = float(np.trace(q))
            self._diagnose(q, metrics)
            log(INFO, "client %d round %s: Q diagonal %s", self.partition_id, config["round"],
                np.round(np.diag(q), 3).tolist())
        stats = train(model, local.x, local.y, loss_fn, self.settings(), transform,
                      local.data.augment, generator)
        if phase == 1:
            metrics["accuracy"] = (global_acc if self.cfg.accuracy_signal == "global"
                                   else stats.mean_accuracy)
        metrics["train-loss"] = stats.mean_loss
        if self.cfg.diagnostics and local.noise_rate is not None:
            metrics["noise-rate"] = local.noise_rate
        return get_weights(model), len(local), metrics

    def settings(self) -> SGDSettings:
        c = self.cfg
        return SGDSettings(c.local_epochs, c.batch_size, c.lr, c.momentum, c.weight_decay)

    def _diagnose(self, q: np.ndarray, metrics: dict) -> None:
        """Simulation-only: how close Q is to the client's realized noise matrix."""
        truth = self.local.true_transition
        if self.cfg.diagnostics and truth is not None:
            metrics["q-cos"], metrics["q-l1"] = matrix_agreement(q, truth)
