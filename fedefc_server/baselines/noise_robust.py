"""Plumbing shared by the servers of FedCorr, FedNoRo and RoFL (docs/BASELINE-METHODS.md).

Each is a :class:`.MethodServer` (the pipeline's seeded sampling, screened replies,
FedAvg in partition-id order, records and summary) whose hooks add work between rounds
(task messages to clients, :mod:`fedefc_server.extra_messages`) and a server step after FedAvg.

The simulator's truth: a simulated client reports its true noise rate (``noise-rate``,
``diagnostics=true``); :meth:`NoiseRobustServer.note_truth` keeps the latest per
partition so a detector's flags can be set beside it (:func:`detection_truth`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import FitRes, Scalar

from common.config import RunConfig
from common.messages import FitReply
from common.models import ClassifierShape

from ..method_server import MethodServer, TaskSender


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


class NoiseRobustServer(MethodServer):
    """A method's server that keeps the simulator's truth beside its detections."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.true_noise: dict[int, float] = {}

    def send(self, send_tasks: TaskSender, tasks: dict[int, dict[str, Scalar]]
             ) -> dict[int, FitRes]:
        """Task messages (:data:`.method_server.TaskSender`), noting the truth their
        replies carry."""
        replies = send_tasks(tasks)
        for pid, res in replies.items():
            self.note_truth(pid, res.metrics)
        return replies

    def note_truth(self, pid: int, metrics: dict[str, Scalar]) -> None:
        if FitReply.NOISE_RATE in metrics:
            self.true_noise[pid] = float(metrics[FitReply.NOISE_RATE])

    def state(self) -> dict[str, Any]:
        return {"true_noise": self.true_noise}

    def load_state(self, state: dict[str, Any]) -> None:
        self.true_noise = int_keys(state["true_noise"])


def int_keys(mapping: dict) -> dict[int, Any]:
    """A checkpoint's JSON object keyed by partition id again."""
    return {int(k): v for k, v in mapping.items()}
