"""FedNoRo's server (Wu et al., IJCAI 2023; docs/BASELINE-METHODS.md, "FedNoRo"; detector
in :mod:`common.baselines.noisy_clients`, aggregation in :mod:`common.baselines.daagg`).

- Warm-up, rounds 1..fednoro-warmup: FedAvg; clients train with logit adjustment.
- Detection, once, before round warmup + 1: the server sends EVERY client (not only
  the sampled ones) an extra message with the warm-up global model and collects its
  per-class mean losses; a majority vote of nine two-component mixtures on the
  normalized matrix flags the noisy clients. Why a message rather than reports during
  warm-up: the reference measures all clients under the SAME final warm-up model, and
  the column-wise min-max normalization compares clients with each other; with 10%
  sampling a third of the clients are never sampled in ten warm-up rounds and the
  others would be measured under ten different models.
- After warm-up: each sampled client is told whether it is noisy (distillation) and
  the round's distillation weight; the round's models are combined by DaAgg.

A detection reply without a usable per-class-loss vector (:func:`read_class_losses`:
missing, undecodable, not K floats, Inf or negative, or no class held) is logged with
its reason, recorded in ``fednoro_detection_skipped`` and left out, like a client that
did not answer: it is treated as clean and detection uses the others. NaN entries are
legitimate: the classes a client holds no sample of (the reference's per-class loss).

Records: the detected set with the simulator's true noise rates beside it (once), then
per round the noisy clients sampled, the distillation weight and the DaAgg weights.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log

from common.baselines.daagg import daagg_distances, daagg_weights, weighted_average
from common.baselines.fednoro import FedNoRoMessages as M
from common.baselines.fednoro import FedNoRoSettings
from common.baselines.noisy_clients import fednoro_noisy_clients
from common.config import RunConfig
from common.exchange import unpack_array
from common.models import ClassifierShape

from ..method_server import Aggregated, TaskSender
from .noise_robust import NoiseRobustServer, detection_truth, truth_note


def read_class_losses(metrics: dict[str, Scalar], num_classes: int) -> np.ndarray:
    """A detection reply's per-class mean losses: K floats, each >= 0 or NaN (a class
    the client holds no sample of), at least one not NaN. ValueError with the reason
    for anything else."""
    if M.CLASS_LOSSES not in metrics:
        raise ValueError(f"no {M.CLASS_LOSSES} in the reply")
    try:
        losses = unpack_array(metrics[M.CLASS_LOSSES])
    except (TypeError, ValueError) as err:  # not bytes, or not .npy
        raise ValueError(f"undecodable {M.CLASS_LOSSES} ({type(err).__name__})") from None
    if losses.shape != (num_classes,) or losses.dtype.kind != "f":
        raise ValueError(f"{M.CLASS_LOSSES} holds {losses.dtype} of shape {losses.shape}, "
                         f"expected {num_classes} floats")
    held = losses[~np.isnan(losses)]
    if not held.size:
        raise ValueError(f"{M.CLASS_LOSSES} holds no class (all NaN)")
    if not (np.isfinite(held).all() and (held >= 0).all()):
        raise ValueError(f"{M.CLASS_LOSSES} holds Inf or a negative loss")
    return losses.astype(np.float64)


class FedNoRoServer(NoiseRobustServer):
    """Warm-up, one-off noisy-client detection, then distillation and DaAgg."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.settings = cfg.settings(FedNoRoSettings)
        self.noisy: set[int] = set()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "fednoro": {"noisy": sorted(self.noisy)}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.noisy = {int(p) for p in state["fednoro"]["noisy"]}

    def summary_fields(self) -> dict[str, Any]:
        return {"fednoro_noisy": sorted(self.noisy)}

    def after_warmup(self, server_round: int) -> bool:
        return server_round > self.settings.fednoro_warmup

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        if not self.after_warmup(server_round):
            return {}
        return {M.NOISY: int(partition_id in self.noisy),
                M.KD_WEIGHT: self.settings.kd_weight(server_round)}

    def before_round(self, server_round: int, send_tasks: TaskSender,
                     partitions: list[int]) -> dict[str, Any]:
        if server_round != self.settings.fednoro_warmup + 1:
            return {}
        replies = self.send(send_tasks, {p: {M.TASK: M.CLASS_LOSSES_TASK} for p in partitions})
        num_classes = self.model_shape.num_classes  # from the run's data, not the arrays
        losses, skipped = {}, {}
        for pid, res in replies.items():
            try:
                losses[pid] = read_class_losses(res.metrics, num_classes)
            except ValueError as err:
                skipped[pid] = str(err)
                log(WARNING, "FedNoRo detection: partition %d left out: %s", pid, err)
        pids = sorted(losses)
        if pids:
            flags = fednoro_noisy_clients(np.stack([losses[p] for p in pids]),
                                          self.settings.fednoro_gmm_votes)
            self.noisy = {p for p, f in zip(pids, flags) if f}
        noisy = sorted(self.noisy)
        truth = detection_truth(noisy, self.true_noise)
        log(INFO, "FedNoRo detection before round %d: %d/%d clients answered, %d left out, "
            "%d flagged noisy%s", server_round, len(replies), len(partitions), len(skipped),
            len(noisy), truth_note(truth))
        return {"fednoro_detection_clients": pids, "fednoro_detection_skipped": skipped,
                "fednoro_noisy": noisy, "fednoro_true_noise": dict(self.true_noise), **truth}

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        """DaAgg instead of FedAvg after warm-up (the accepted replies' own models)."""
        if result.parameters is None or not self.after_warmup(result.round):
            return result.parameters, {}
        pids = [p for p, _ in result.replies]
        models = [parameters_to_ndarrays(res.parameters) for _, res in result.replies]
        sizes = np.array([res.num_examples for _, res in result.replies], dtype=np.float64)
        flags = np.array([p in self.noisy for p in pids])
        coefs = daagg_weights(sizes, daagg_distances(models, flags))
        return ndarrays_to_parameters(weighted_average(models, coefs)), {
            "fednoro_kd_weight": self.settings.kd_weight(result.round),
            "fednoro_noisy_sampled": [p for p, f in zip(pids, flags) if f],
            "daagg_weights": dict(zip(pids, coefs.tolist())),
            "fedavg_weights": dict(zip(pids, (sizes / sizes.sum()).tolist()))}
