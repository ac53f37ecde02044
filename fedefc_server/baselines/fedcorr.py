"""FedCorr's server (Xu et al., CVPR 2022; docs/BASELINE-METHODS.md, "FedCorr"; schedule
and rules in :mod:`common.baselines.fedcorr`, detectors in
:mod:`common.baselines.noisy_clients`).

- Stage 1 (rounds 1..stage1_end): each round is one sub-round of an iteration that
  visits a seeded permutation of all clients; each client gets mu = its noise level
  estimated at the previous iteration (0 in the first) and replies with its LID and its
  own loss-mixture noise estimate. At the end of every iteration the server adds the
  iteration's LIDs to each client's cumulative LID, fits a two-component mixture on
  them (noisy = higher mean; random_state = the run seed) and keeps the reported
  estimates of the flagged clients (0 for the others). Before the next round it sends
  every flagged client a correction message (relabel the est x relabel-ratio
  highest-loss samples the global model is confident about).
- Stage 2: FedAvg over the clients with estimated noise <= fedcorr-clean-set-thres
  (at most fraction x N per round); afterwards the flagged clients relabel every
  sample the global model is confident about.
- Stage 3: FedAvg over all clients, as the other methods.

A stage-1 reply must carry a finite LID >= 0 (the estimator's range; 0 for a client
whose outputs coincide) and an estimated noise in [0, 1], else it is rejected
(:meth:`FedCorrServer.check_metrics`). The checkpoint keeps the plan: a resumed run
whose config gives other stage boundaries (e.g. another ``rounds``, which sets the
stage-2 length) is refused.

Records: stage, iteration, LIDs, the flagged set with its estimates, the sampling pool
and the corrections, with the simulator's true noise rates beside the flags.
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import Parameters, Scalar
from flwr.common.logger import log

from common.baselines.fedcorr import FedCorrMessages as M
from common.baselines.fedcorr import FedCorrPlan, FedCorrSettings
from common.baselines.noisy_clients import lid_noisy_clients
from common.config import RunConfig
from common.models import ClassifierShape

from ..checkpoint import CheckpointError
from ..method_server import Aggregated, TaskSender
from ..plan import sample_round
from ..validation import bad_number
from .noise_robust import NoiseRobustServer, detection_truth, int_keys, truth_note


def plan_differences(stored: dict[str, int], plan: FedCorrPlan) -> dict[str, tuple[int, int]]:
    """{field: (checkpoint's, this config's)} of the plan fields that fix which round is
    which stage, iteration and sub-round: every field but ``rounds`` (more or fewer
    rounds only lengthen or shorten stage 3)."""
    return {k: (stored[k], v) for k, v in asdict(plan).items()
            if k != "rounds" and stored[k] != v}


def check_resume_plan(state: dict[str, Any], plan: FedCorrPlan) -> None:
    """Refuse (CheckpointError naming the keys) a checkpoint's strategy ``state`` whose
    run followed other stage boundaries than ``plan``. Called by the launcher's preflight
    (before any Flower process starts) and again when the ServerApp loads the state."""
    stored = state["fedcorr"]["plan"]
    diff = plan_differences(stored, plan)
    if diff:
        changes = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(diff.items()))
        raise CheckpointError(
            f"the checkpoint's FedCorr plan differs from this config's ({changes}): stage 2 "
            "lasts fedcorr-finetune-share x the rounds after stage 1, so it follows "
            f"rounds; resume with rounds={stored['rounds']}, the interrupted run's value")


class FedCorrServer(NoiseRobustServer):
    """FedCorr's three stages as server hooks."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.settings = cfg.settings(FedCorrSettings)
        self.plan = self.settings.plan(cfg)
        self.lid_sum: dict[int, float] = {}  # cumulative LID over iterations
        self.reported_noise: dict[int, float] = {}  # this iteration's client estimates
        self.est_noise: dict[int, float] = {}  # after the last detection; 0 = clean
        self.noisy: list[int] = []
        self._correct_before_next = False
        log(INFO, "FedCorr plan: %s", self.plan.describe())

    def summary_fields(self) -> dict[str, Any]:
        return {"fedcorr_plan": self.plan.describe(), "fedcorr_noisy": self.noisy}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "fedcorr": {
            "plan": asdict(self.plan),
            "lid_sum": self.lid_sum, "reported_noise": self.reported_noise,
            "est_noise": self.est_noise, "noisy": self.noisy,
            "correct_before_next": self._correct_before_next}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the detection state; refuse (CheckpointError naming the keys) a
        checkpoint whose run followed other stage boundaries than this config gives."""
        super().load_state(state)
        self.check_checkpoint(state, self.cfg)
        s = state["fedcorr"]
        self.lid_sum, self.reported_noise, self.est_noise = (
            int_keys(s[k]) for k in ("lid_sum", "reported_noise", "est_noise"))
        self.noisy = [int(p) for p in s["noisy"]]
        self._correct_before_next = bool(s["correct_before_next"])

    @classmethod
    def check_checkpoint(cls, state: dict[str, Any], cfg: RunConfig) -> None:
        check_resume_plan(state, cfg.settings(FedCorrSettings).plan(cfg))

    # -- sampling and per-client config ---------------------------------------------
    def clean_pool(self, available: list[int]) -> list[int]:
        """Stage 2's clients: estimated noise <= fedcorr-clean-set-thres."""
        thres = self.settings.fedcorr_clean_set_thres
        return [p for p in available if self.est_noise.get(p, 0.0) <= thres]

    def sample(self, server_round: int, available: list[int]) -> list[int]:
        stage = self.plan.stage(server_round)
        if stage == 1:
            serving = set(available)
            return [p for p in self.plan.subround_clients(self.cfg.seed, server_round)
                    if p in serving]
        if stage == 2:
            return sample_round(self.cfg, self.clean_pool(available) or available, server_round)
        return super().sample(server_round, available)

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        stage = self.plan.stage(server_round)
        return {M.STAGE: stage,
                M.MU: self.est_noise.get(partition_id, 0.0) if stage == 1 else 0.0}

    # -- corrections between rounds -------------------------------------------------
    def before_round(self, server_round: int, send_tasks: TaskSender,
                     partitions: list[int]) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self._correct_before_next and self.noisy:
            ratio = self.settings.fedcorr_relabel_ratio
            tasks = {p: {M.TASK: M.RELABEL_HIGHEST_LOSS,
                         M.RELABEL_FRACTION: self.est_noise[p] * ratio} for p in self.noisy}
            info.update(self._correct(tasks, send_tasks, server_round,
                                      "fedcorr_relabel_highest_loss"))
        self._correct_before_next = False
        if server_round == self.plan.stage2_end + 1 and self.noisy:
            tasks = {p: {M.TASK: M.RELABEL_CONFIDENT} for p in self.noisy}
            info.update(self._correct(tasks, send_tasks, server_round,
                                      "fedcorr_relabel_confident"))
        if self.plan.stage(server_round) == 2:
            pool = self.clean_pool(partitions)
            if not pool:
                log(WARNING, "FedCorr stage 2: no client with estimated noise <= %s; "
                    "fine-tuning on all clients", self.settings.fedcorr_clean_set_thres)
            info["fedcorr_clean_pool"] = len(pool or partitions)
        return info

    def _correct(self, tasks: dict[int, dict[str, Scalar]], send_tasks: TaskSender,
                 server_round: int, name: str) -> dict[str, Any]:
        replies = self.send(send_tasks, tasks)
        for pid in list(replies):
            counts = (bad_number(key, replies[pid].metrics.get(key), 0, integer=True)
                      for key in (M.RELABELLED, M.CORRECTED))
            why = next(filter(None, counts), None)
            if why:  # a count the record cannot hold; the client relabelled its own data anyway
                log(WARNING, "FedCorr round %d: partition %d's %s reply left out: %s",
                    server_round, pid, name.removeprefix("fedcorr_"), why)
                del replies[pid]
        changed = {p: int(r.metrics.get(M.RELABELLED, 0)) for p, r in replies.items()}
        corrected = {p: int(r.metrics.get(M.CORRECTED, 0)) for p, r in replies.items()}
        log(INFO, "FedCorr round %d: %s on %d/%d flagged clients, %d labels changed",
            server_round, name.removeprefix("fedcorr_"), len(replies), len(tasks),
            sum(changed.values()))
        return {name: changed, f"{name}_corrected": corrected}

    # -- aggregation, detection and records -----------------------------------------
    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """A stage-1 reply's LID (finite, >= 0) and estimated noise (in [0, 1]), which
        the detection sums and keeps; other stages' replies carry neither."""
        if self.plan.stage(server_round) != 1:
            return None
        return (bad_number(M.LID, metrics.get(M.LID), 0.0)
                or bad_number(M.EST_NOISE, metrics.get(M.EST_NOISE), 0.0, 1.0))

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        server_round = result.round
        stage = self.plan.stage(server_round)
        info: dict[str, Any] = {"fedcorr_stage": stage}
        lids = {}
        for pid, res in result.replies:
            self.note_truth(pid, res.metrics)
            if stage == 1:  # check_metrics made sure both values are there and usable
                lids[pid] = float(res.metrics[M.LID])
                self.lid_sum[pid] = self.lid_sum.get(pid, 0.0) + lids[pid]
                self.reported_noise[pid] = float(res.metrics[M.EST_NOISE])
        if stage == 1:
            info["fedcorr_iteration"], info["fedcorr_subround"] = self.plan.iteration(server_round)
            info["fedcorr_lid"] = lids
        if self.plan.ends_iteration(server_round):
            info.update(self._detect(server_round))
        return result.parameters, info

    def _detect(self, server_round: int) -> dict[str, Any]:
        """End of an iteration: flag noisy clients and keep their noise estimates."""
        pids = sorted(self.lid_sum)
        flags = lid_noisy_clients(np.array([self.lid_sum[p] for p in pids]), self.cfg.seed)
        self.noisy = [p for p, f in zip(pids, flags) if f]
        self.est_noise = {p: self.reported_noise.get(p, 0.0) for p in self.noisy}
        self.reported_noise = {}
        self._correct_before_next = True
        truth = detection_truth(self.noisy, self.true_noise)
        log(INFO, "FedCorr iteration %d done (round %d): %d/%d clients flagged noisy, mean "
            "estimated noise %.3f%s", self.plan.iteration(server_round)[0], server_round,
            len(self.noisy), len(pids),
            float(np.mean(list(self.est_noise.values()))) if self.noisy else 0.0,
            truth_note(truth))
        return {"fedcorr_lid_sum": dict(self.lid_sum), "fedcorr_noisy": self.noisy,
                "fedcorr_est_noise": self.est_noise, **truth}
