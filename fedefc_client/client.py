"""The NumPyClient: receives the global model, runs the method's local update, replies;
and, with federated evaluation, measures the global model on its held-out data.

A training reply holds the trained weights, the sample count, the partition id, and metrics
that are scalars: the loss the client trained with, its mean training loss and local
compute time, a method's own metrics, and, where the server asks for it (FedEFC's
phase 1, docs/FEDEFC.md §3.1), A_k: the accuracy of the RECEIVED global model on the
client's own noisy-labelled training data (``accuracy-signal=global``) or on its
validation share, which phase 1 does not train on (``held-out``), or its training
accuracy averaged over the local epochs (``local-train``). Labels and FedEFC's Q never
leave the client; in simulation with ``diagnostics=true`` the reply also carries scalars
that only the simulator can compute (its true noise rate; Q's similarity to the truth).

An evaluation reply (docs/OWN-DATA.md, "Federated evaluation") holds the global model's
mean cross-entropy on the client's held-out samples, their number, the partition id and
the accuracy against their observed labels; in simulation with synthetic noise and
``diagnostics=true`` also the accuracy against their true labels (``true-accuracy``).
Nothing else about the held-out data leaves the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from logging import INFO

import numpy as np
from flwr.client import NumPyClient
from flwr.common.logger import log

from common.config import RunConfig
from common.messages import Declaration, EvaluateReply, FitConfig, FitReply, carries_accuracy
from common.methods import load_object, method_of
from common.params import get_weights, set_weights
from common.runtime import model_for
from common.training import BatchTransform, configure_threads, evaluate
from common.twin import halves, paired

from .job import LocalJob
from .local_data import LocalData, partition_sizes
from .local_update import Update, twin


def received_model_accuracy(job: LocalJob) -> float | None:
    """A_k where the run's ``accuracy-signal`` measures the RECEIVED global model
    (``held-out``, ``global``; docs/FEDEFC.md §3.1), taken before the local update trains
    it; None for ``local-train``, whose A_k the training itself measures."""
    signal = job.cfg.accuracy_signal_mode
    if signal == "held-out":
        return job.validation_accuracy()
    if signal == "global":
        return job.global_accuracy()
    return None


class MethodClient(NumPyClient):
    """One client of the run's method; built per message by the ClientApp, its data
    loaded lazily (cached), its local update the method's (common/methods.py)."""

    def __init__(self, cfg: RunConfig, partition_id: int, load: Callable[[], LocalData],
                 state=None, private_data: bool = False):
        self.cfg = cfg
        self.local_update: Callable[[LocalJob], Update] = load_object(
            method_of(cfg).local_update)
        self.partition_id = partition_id
        self.private_data = private_data
        self._load = load
        self._local: LocalData | None = None
        self.state = state

    # The registry asks every node once which partition it serves and how many samples
    # it trains on and holds out (docs/PRIVACY.md, "Weights bound to facts"); the sizes
    # bound its replies. Own data that names its classes declares its class map's
    # fingerprint, which must be the federation's (docs/OWN-DATA.md, "Preparing a folder
    # of images").
    def get_properties(self, config):
        class_map = None
        if self.private_data:
            held = self.local.held_out
            size, held_out = len(self.local), 0 if held is None else len(held)
            class_map = self.local.class_map
        else:
            size, held_out = partition_sizes(self.cfg, self.partition_id)
        return {Declaration.PARTITION_ID: self.partition_id,
                Declaration.NUM_EXAMPLES: size,
                Declaration.HELD_OUT: held_out,
                Declaration.DATA: Declaration.PRIVATE if self.private_data
                else Declaration.PARTITION,
                **({} if class_map is None else {Declaration.CLASS_MAP: class_map})}

    @property
    def local(self) -> LocalData:
        if self._local is None:
            configure_threads(self.cfg.client_threads)
            self._local = self._load()
        return self._local

    def get_parameters(self, config):
        local = self.local
        weights = get_weights(model_for(self.cfg, local.data.task, local.x.device))
        return paired(weights) if self.cfg.twinned else weights

    def fit(self, parameters, config):
        _ = self.local  # loaded (or read from the cache) before the clock starts
        start = time.perf_counter()
        twin_weights, parameters = halves(parameters) if self.cfg.twinned else ([], parameters)
        weights, num_examples, metrics, job = self.fit_model(parameters, config)
        if self.cfg.twinned:  # the twin (docs/FEDEFC.md §3.8), after its probe
            twin_weights, reading = self.fit_twin(twin_weights, job)
            weights = [*twin_weights, *weights]
            if reading is not None:
                metrics[FitReply.GUARD_ACCURACY] = reading
        metrics[FitReply.FIT_S] = time.perf_counter() - start  # local compute, everywhere alike
        return weights, num_examples, metrics

    def fit_model(self, parameters, config) -> tuple[list, int, dict, LocalJob | None]:
        """The method's local update of the received model: (weights, count, metrics,
        the job; None for a client without samples)."""
        server_round = int(config[FitConfig.ROUND])
        local = self.local
        model = model_for(self.cfg, local.data.task, local.x.device)
        set_weights(model, parameters)
        metrics: dict = {FitReply.PARTITION_ID: self.partition_id}
        if len(local) == 0:
            return get_weights(model), 0, metrics, None
        phase = int(config[FitConfig.PHASE]) if FitConfig.PHASE in config else None
        job = LocalJob(self.cfg, local, model, phase, server_round,
                       int(config[FitConfig.SEED]), self.state, dict(config))
        carries = carries_accuracy(job.phase, self.cfg.guarded)
        received = received_model_accuracy(job) if carries else None
        num_examples, extra, stats = self.local_update(job)
        metrics.update(extra)
        if carries:
            metrics[FitReply.ACCURACY] = stats.mean_accuracy if received is None else received
        metrics[FitReply.TRAIN_LOSS] = stats.mean_loss
        if self.cfg.diagnostics and local.noise_rate is not None:
            metrics[FitReply.NOISE_RATE] = local.noise_rate
        if job.last_q is not None and self.cfg.diagnostics:  # a simulation's instrument
            log(INFO, "client %d round %d: noise matrix diagonal %s", self.partition_id,
                job.server_round, np.round(np.diag(job.last_q), 3).tolist())
        return get_weights(model), num_examples, metrics, job

    def fit_twin(self, weights, probe: LocalJob | None) -> tuple[list, float | None]:
        """The twin's local update (:func:`.local_update.twin`) on all of the client's
        data but its guard slice where the guard reads the clients
        (:meth:`common.sample_roles.SampleRoles.twin`), with the Q its probe's update
        trained with; its seed is the probe's. Returns the twin's weights and, where the
        round asks for A_k and the guard reads the clients, the RECEIVED twin's reading on
        the guard slice, read as the probe's share is read (through the Q the client
        trained with last round, :attr:`.job.LocalJob.prior_q`): the delivered model's
        guard signal (docs/FEDEFC.md §3.4, §3.8)."""
        local = self.local
        model = model_for(self.cfg, local.data.task, local.x.device, "twin")
        set_weights(model, weights)
        if probe is None:  # no samples
            return get_weights(model), None
        roles = local.roles.twin()
        job = LocalJob(self.cfg, replace(local, roles=roles), model, probe.phase,
                       probe.server_round, probe.seed, config=probe.config)
        job.prior_q = probe.prior_q
        reading = (job.validation_accuracy() if roles.twin_slice and
                   carries_accuracy(probe.phase, self.cfg.guarded) else None)
        twin(job, probe.last_q)
        return get_weights(model), reading

    def evaluate(self, parameters, config):
        """The received global model's (loss, accuracy) on the held-out samples, weighted
        by their number on the server; (0.0, 0, ...) without held-out data."""
        local = self.local
        metrics: dict = {EvaluateReply.PARTITION_ID: self.partition_id}
        held = local.held_out
        if held is None or len(held) == 0:
            return 0.0, 0, metrics
        model = model_for(self.cfg, local.data.task, local.x.device)
        set_weights(model, parameters)
        transform = BatchTransform.of(local.spec, local.x.device)
        batch = self.cfg.eval_batch_size
        loss, metrics[EvaluateReply.ACCURACY] = evaluate(model, held.x, held.y, transform, batch)
        if self.cfg.diagnostics and held.true_y is not None:
            metrics[EvaluateReply.TRUE_ACCURACY] = evaluate(model, held.x, held.true_y,
                                                            transform, batch)[1]
        return float(loss), len(held), metrics
