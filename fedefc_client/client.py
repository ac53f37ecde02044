"""The NumPyClient: receives the global model, runs the method's local update, replies.

Phase 1 (ALGORITHM.md section 3): every method reports A_k, the accuracy of the
RECEIVED global model on the client's own noisy-labelled data
(``accuracy-signal=global``) or the training accuracy averaged over the local epochs
(``local-train``). Phase 2: no accuracy; FedEFC builds Q from the global model's
predictions and trains with the forward-corrected loss (see :mod:`.methods`).
Q and the labels never leave the client: a reply holds weights, the sample count,
the partition id, phase 1's accuracy, and (simulation, ``diagnostics=true``) scalar
diagnostics such as Q's cosine similarity to the client's true noise matrix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import INFO

import numpy as np
from flwr.client import NumPyClient
from flwr.common.logger import log

from common.config import RunConfig
from common.faults import before_training, corrupt_reply, parse_faults
from common.params import get_weights, set_weights
from common.runtime import model_for
from common.training import configure_threads

from .job import LocalJob
from .local_data import LocalData
from .methods import METHODS


class FedEFCClient(NumPyClient):
    """One client; built per message by the ClientApp, its data loaded lazily (cached)."""

    def __init__(self, cfg: RunConfig, partition_id: int, load: Callable[[], LocalData],
                 state=None):
        self.cfg = cfg
        self.partition_id = partition_id
        self._load = load
        self._local: LocalData | None = None
        self.state = state
        self.faults = parse_faults(cfg.faults)

    # The registry asks every node once which partition it serves (no data is loaded).
    def get_properties(self, config):
        return {"partition-id": self.partition_id}

    @property
    def local(self) -> LocalData:
        if self._local is None:
            configure_threads(self.cfg.client_threads)
            self._local = self._load()
        return self._local

    def get_parameters(self, config):
        local = self.local
        return get_weights(model_for(self.cfg, local.data, local.x.device))

    def fit(self, parameters, config):
        before_training(self.faults, self.partition_id, int(config["round"]))
        local = self.local  # loaded (or read from the cache) before the clock starts
        start = time.perf_counter()
        model = model_for(self.cfg, local.data, local.x.device)
        set_weights(model, parameters)
        metrics: dict = {"partition-id": self.partition_id}
        if len(local) == 0:
            return get_weights(model), 0, metrics
        job = LocalJob(self.cfg, local, model, int(config["phase"]), int(config["round"]),
                       int(config["seed"]), self.state, dict(config))
        num_examples, extra, stats = METHODS[self.cfg.method](job)
        metrics.update(extra)
        if job.phase == 1:
            metrics["accuracy"] = (job.global_accuracy() if self.cfg.accuracy_signal == "global"
                                   else stats.mean_accuracy)
        metrics["train-loss"] = stats.mean_loss
        if self.cfg.diagnostics and local.noise_rate is not None:
            metrics["noise-rate"] = local.noise_rate
        metrics["fit-s"] = time.perf_counter() - start  # local compute, the same everywhere
        if job.last_q is not None:
            log(INFO, "client %d round %d: noise matrix diagonal %s", self.partition_id,
                job.server_round, np.round(np.diag(job.last_q), 3).tolist())
        return corrupt_reply(self.faults, self.partition_id, job.server_round, get_weights(model),
                             num_examples, metrics)
