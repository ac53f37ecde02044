"""Plumbing shared by the FedCorr, FedNoRo and RoFL strategies (docs/BASELINE-METHODS.md).

Each is a :class:`.FedAvgStrategy` (same seeded sampling, screened replies, FedAvg in
partition-id order, records and summary) that adds, per round:

- :meth:`before_round`: work between two rounds with the current global model, such as
  extra task messages to clients (:mod:`.extra_messages`), recorded in the round;
- in ``aggregate_fit`` (overridden by each), its own server step and record fields,
  on the replies the base strategy accepted (:meth:`accepted_replies`);
- in ``server_state`` / ``load_server_state``, what a checkpoint must keep of it.

The simulator's truth: a simulated client reports its true noise rate (``noise-rate``,
``diagnostics=true``); :meth:`note_truth` keeps the latest per partition so a detector's
flags can be set beside it (:func:`detection_truth`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from ..strategy import FedAvgStrategy
from .extra_messages import send_tasks


def detection_truth(flagged: list[int], true_noise: dict[int, float]) -> dict[str, Any]:
    """Mean true noise rate of the flagged and of the other clients (simulation only)."""
    if not true_noise:
        return {}
    flagged_set = set(flagged)
    inside = [v for p, v in true_noise.items() if p in flagged_set]
    outside = [v for p, v in true_noise.items() if p not in flagged_set]
    return {"true_noise_flagged": float(np.mean(inside)) if inside else None,
            "true_noise_unflagged": float(np.mean(outside)) if outside else None}


def truth_note(truth: dict[str, Any]) -> str:
    """A log suffix for :func:`detection_truth` ('' without the simulator's truth)."""
    if not truth:
        return ""
    flagged, others = (("n/a" if v is None else f"{v:.3f}") for v in
                       (truth["true_noise_flagged"], truth["true_noise_unflagged"]))
    return f" | true noise rate: flagged {flagged}, others {others}"


class NoiseRobustStrategy(FedAvgStrategy):
    """A FedAvgStrategy with a between-rounds hook and task messages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_noise: dict[int, float] = {}

    def before_round(self, server_round: int, parameters: Parameters,
                     client_manager: ClientManager) -> dict[str, Any]:
        """Work before ``server_round`` is configured; returns fields for its record."""
        return {}

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        start = time.monotonic()
        extra = self.before_round(server_round, parameters, client_manager)
        if extra:
            extra["extra_messages_s"] = time.monotonic() - start
        instructions = super().configure_fit(server_round, parameters, client_manager)
        self.record(**extra)
        return instructions

    def send_tasks(self, client_manager: ClientManager, parameters: Parameters,
                   tasks: dict[int, dict[str, Scalar]], server_round: int) -> dict[int, FitRes]:
        """Send each partition in ``tasks`` the round config (round, seed) plus its task
        keys; return the replies by partition id. Each call is bounded by
        ``client-timeout`` (0: none), as a round's training calls are."""
        serving = self.registry.refresh(client_manager, server_round)
        configs = {pid: {**self.round_config(pid, server_round), **task}
                   for pid, task in tasks.items()}
        replies = send_tasks(serving, parameters, configs, server_round,
                             timeout=self.cfg.client_timeout or None)
        for pid, res in replies.items():
            self.note_truth(pid, res.metrics)
        return replies

    def note_truth(self, pid: int, metrics: dict[str, Scalar]) -> None:
        if "noise-rate" in metrics:
            self.true_noise[pid] = float(metrics["noise-rate"])

    def accepted_replies(self) -> list[tuple[int, FitRes]]:
        """(partition id, reply) of this round's valid replies (screened by the base
        ``aggregate_fit``: trained, well-formed, finite), in id order."""
        return [(int(res.metrics["partition-id"]), res) for _, res in self.accepted]

    def server_state(self) -> dict[str, Any]:
        return {**super().server_state(), "true_noise": self.true_noise}

    def load_server_state(self, state: dict[str, Any]) -> None:
        super().load_server_state(state)
        self.true_noise = int_keys(state["true_noise"])


def int_keys(mapping: dict) -> dict[int, Any]:
    """A checkpoint's JSON object keyed by partition id again."""
    return {int(k): v for k, v in mapping.items()}
