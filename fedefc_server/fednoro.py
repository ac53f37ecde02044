"""FedNoRo's server (Wu et al., IJCAI 2023; docs/BASELINES.md; detector in
:mod:`common.noisy_clients`, aggregation in :mod:`common.daagg`).

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

Records: the detected set with the simulator's true noise rates beside it (once), then
per round the noisy clients sampled, the distillation weight and the DaAgg weights.
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from common.daagg import daagg_distances, daagg_weights, weighted_average
from common.exchange import unpack_array
from common.fednoro import FedNoRoMessages as M, distillation_weight
from common.noisy_clients import fednoro_noisy_clients

from .noise_robust import NoiseRobustStrategy, detection_truth, truth_note


class FedNoRoStrategy(NoiseRobustStrategy):
    """Warm-up, one-off noisy-client detection, then distillation and DaAgg."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.noisy: set[int] = set()

    def server_state(self) -> dict[str, Any]:
        return {**super().server_state(), "fednoro": {"noisy": sorted(self.noisy)}}

    def load_server_state(self, state: dict[str, Any]) -> None:
        super().load_server_state(state)
        self.noisy = {int(p) for p in state["fednoro"]["noisy"]}

    def after_warmup(self, server_round: int) -> bool:
        return server_round > self.cfg.fednoro_warmup

    def kd_weight(self, server_round: int) -> float:
        c = self.cfg
        return distillation_weight(server_round, c.fednoro_kd_begin, c.fednoro_kd_end,
                                   c.fednoro_kd_weight)

    def client_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        config = super().client_config(partition_id, server_round)
        if self.after_warmup(server_round):
            config[M.NOISY] = int(partition_id in self.noisy)
            config[M.KD_WEIGHT] = self.kd_weight(server_round)
        return config

    def before_round(self, server_round: int, parameters: Parameters,
                     client_manager: ClientManager) -> dict[str, Any]:
        if server_round != self.cfg.fednoro_warmup + 1:
            return {}
        serving = self.registry.refresh(client_manager, server_round)
        replies = self.send_tasks(client_manager, parameters,
                                  {p: {M.TASK: M.CLASS_LOSSES_TASK} for p in serving},
                                  server_round)
        pids = sorted(replies)
        if pids:
            matrix = np.stack([unpack_array(replies[p].metrics[M.CLASS_LOSSES]) for p in pids])
            flags = fednoro_noisy_clients(matrix, self.cfg.fednoro_gmm_votes)
            self.noisy = {p for p, f in zip(pids, flags) if f}
        noisy = sorted(self.noisy)
        truth = detection_truth(noisy, self.true_noise)
        log(INFO, "FedNoRo detection before round %d: %d/%d clients answered, %d flagged "
            "noisy%s", server_round, len(pids), len(serving), len(noisy), truth_note(truth))
        self.run_info["fednoro_noisy"] = noisy
        return {"fednoro_detection_clients": pids, "fednoro_noisy": noisy,
                "fednoro_true_noise": dict(self.true_noise), **truth}

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is None or not self.after_warmup(server_round):
            return params, metrics
        replies = self.accepted_replies()
        pids = [p for p, _ in replies]
        models = [parameters_to_ndarrays(res.parameters) for _, res in replies]
        sizes = np.array([res.num_examples for _, res in replies], dtype=np.float64)
        flags = np.array([p in self.noisy for p in pids])
        coefs = daagg_weights(sizes, daagg_distances(models, flags))
        self.record(
            fednoro_kd_weight=self.kd_weight(server_round),
            fednoro_noisy_sampled=[p for p, f in zip(pids, flags) if f],
            daagg_weights=dict(zip(pids, coefs.tolist())),
            fedavg_weights=dict(zip(pids, (sizes / sizes.sum()).tolist())))
        return ndarrays_to_parameters(weighted_average(models, coefs)), metrics
