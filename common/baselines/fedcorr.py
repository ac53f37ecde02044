"""FedCorr's schedule, local regularizer and label corrections (plain functions).

FedCorr (Xu et al., CVPR 2022; docs/BASELINE-METHODS.md, "FedCorr") has three stages:

1. pre-processing: ``iterations`` iterations, each visiting every client exactly once
   in sub-rounds (the global model is aggregated after each sub-round), with the loss
   CE + beta * mu_k * ||w_g - w|| (:func:`fedefc_client.baselines.fedcorr.proximal_norm`); after each iteration the
   server detects noisy clients and their noise levels, and noisy clients relabel
   their highest-loss samples (:func:`relabel_highest_loss`);
2. fine-tuning: FedAvg over the clients whose estimated noise level is at most the
   clean-set threshold; afterwards the noisy clients relabel every sample the global
   model is confident about (:func:`relabel_confident`);
3. usual training: FedAvg over all clients.

Round budget (this project): every method runs ``rounds`` rounds and a stage-1
sub-round counts as a round. A sub-round holds ``per_subround`` clients (by default
the clients of one round of the other methods, ``max(1, int(fraction * N))``), so one
iteration takes ceil(N / per_subround) rounds and stage 1 ``iterations`` times that.
Stage 2 gets ``finetune_share`` of the remaining rounds (rounded half up; the
reference's CIFAR-10 command gives it 500 of 950) and stage 3 the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from ..config import MethodSettings, RunConfig
from ..seeds import derive_seed


class FedCorrSettings(MethodSettings):
    """FedCorr's keys, with the reference code's defaults (``fedcorr-frac1`` = 0: the
    run's fraction, so a stage-1 sub-round holds one round's clients)."""

    fedcorr_iterations: int = Field(5, ge=1, le=1000)
    fedcorr_frac1: float = Field(0.0, ge=0.0, le=1.0)
    fedcorr_beta: float = Field(5.0, ge=0.0, le=1e4)
    fedcorr_lid_k: int = Field(20, ge=1, le=10_000)
    fedcorr_relabel_ratio: float = Field(0.5, ge=0.0, le=1.0)
    fedcorr_confidence_thres: float = Field(0.5, ge=0.0, le=1.0)
    fedcorr_clean_set_thres: float = Field(0.1, ge=0.0, le=1.0)
    fedcorr_finetune_share: float = Field(0.5, ge=0.0, le=1.0)

    def check(self, cfg: RunConfig) -> None:
        """The stages must fit in ``rounds`` (:func:`plan_fedcorr` names the keys)."""
        self.plan(cfg)

    def plan(self, cfg: RunConfig) -> FedCorrPlan:
        """The stage plan of a run with these settings."""
        return plan_fedcorr(cfg.rounds, cfg.num_clients, cfg.fraction, self.fedcorr_frac1,
                            self.fedcorr_iterations, self.fedcorr_finetune_share)


class FedCorrMessages:
    """Everything FedCorr exchanges beyond the model weights (docs/BASELINE-METHODS.md lists
    it for the privacy comparison). All values are scalars of the legacy messages."""

    # server -> client, fit config of every round
    STAGE = "fedcorr-stage"  # int 1 | 2 | 3
    MU = "fedcorr-mu"  # float: the client's estimated noise level, previous iteration (stage 1)
    # client -> server, fit metrics of every stage-1 round
    LID = "fedcorr-lid"  # float: mean LID of the local model's softmax outputs on local data
    EST_NOISE = "fedcorr-est-noise"  # float: share of local samples in the high-loss component
    # server -> each detected-noisy client, an extra fit message that trains nothing
    TASK = "fedcorr-task"  # str: RELABEL_HIGHEST_LOSS (after each iteration) | RELABEL_CONFIDENT
    RELABEL_FRACTION = "fedcorr-relabel-fraction"  # float: estimated noise x relabel ratio
    # client -> server, reply to that message
    RELABELLED = "fedcorr-relabelled"  # int: labels this message changed
    CORRECTED = "fedcorr-corrected"  # int: local labels that now differ from the observed ones

    RELABEL_HIGHEST_LOSS = "relabel-highest-loss"
    RELABEL_CONFIDENT = "relabel-confident"


@dataclass(frozen=True)
class FedCorrPlan:
    """Which stage, iteration and sub-round each round belongs to (module docstring)."""

    rounds: int
    num_clients: int
    per_subround: int
    iterations: int
    finetune_rounds: int

    @property
    def subrounds_per_iteration(self) -> int:
        return math.ceil(self.num_clients / self.per_subround)

    @property
    def stage1_end(self) -> int:
        """The last round of stage 1."""
        return self.iterations * self.subrounds_per_iteration

    @property
    def stage2_end(self) -> int:
        """The last round of stage 2 (= stage1_end when stage 2 is empty)."""
        return self.stage1_end + self.finetune_rounds

    def stage(self, server_round: int) -> int:
        if server_round <= self.stage1_end:
            return 1
        return 2 if server_round <= self.stage2_end else 3

    def iteration(self, server_round: int) -> tuple[int, int]:
        """(iteration 1.., sub-round 0..) of a stage-1 round."""
        iteration, sub = divmod(server_round - 1, self.subrounds_per_iteration)
        return iteration + 1, sub

    def ends_iteration(self, server_round: int) -> bool:
        return server_round <= self.stage1_end and \
            server_round % self.subrounds_per_iteration == 0

    def subround_clients(self, seed: int, server_round: int) -> list[int]:
        """The partition ids of a stage-1 sub-round: iteration i visits a seeded
        permutation of all clients in consecutive chunks of ``per_subround``."""
        iteration, sub = self.iteration(server_round)
        order = np.random.default_rng(derive_seed(seed, "fedcorr-iteration", iteration)) \
            .permutation(self.num_clients)
        return sorted(int(p) for p in order[sub * self.per_subround:(sub + 1) * self.per_subround])

    def describe(self) -> dict[str, int]:
        return {"stage1_rounds": self.stage1_end, "stage2_rounds": self.finetune_rounds,
                "stage3_rounds": self.rounds - self.stage2_end,
                "clients_per_subround": self.per_subround,
                "subrounds_per_iteration": self.subrounds_per_iteration,
                "iterations": self.iterations}


def plan_fedcorr(rounds: int, num_clients: int, fraction: float, frac1: float,
                 iterations: int, finetune_share: float) -> FedCorrPlan:
    """The stage split; ``frac1`` = 0 means ``fraction``. Raises ValueError naming the
    keys when stage 1 does not fit in ``rounds``."""
    per_subround = max(1, int(num_clients * (frac1 or fraction)))
    probe = FedCorrPlan(rounds, num_clients, per_subround, iterations, 0)
    if probe.stage1_end > rounds:
        raise ValueError(
            f"fedcorr-iterations={iterations} x {probe.subrounds_per_iteration} sub-rounds "
            f"of {per_subround} clients (num-clients={num_clients}, fedcorr-frac1={frac1}, "
            f"fraction={fraction}) = {probe.stage1_end} stage-1 rounds > rounds={rounds}; "
            "lower fedcorr-iterations, raise fedcorr-frac1, or raise rounds"
        )
    finetune = math.floor(finetune_share * (rounds - probe.stage1_end) + 0.5)
    return FedCorrPlan(rounds, num_clients, per_subround, iterations, finetune)


def relabel_highest_loss(labels: np.ndarray, losses: np.ndarray, probs: np.ndarray,
                         fraction: float, confidence: float) -> np.ndarray:
    """Stage-1 correction on a noisy client: of the ``int(n * fraction)`` samples with
    the highest loss, those whose global-model max probability exceeds ``confidence``
    take the global model's argmax (fraction = estimated noise x relabel ratio)."""
    out = np.array(labels, copy=True)
    count = int(len(labels) * fraction)
    candidates = np.argsort(-np.asarray(losses), kind="stable")[:count]
    chosen = candidates[probs[candidates].max(1) > confidence]
    out[chosen] = probs[chosen].argmax(1)
    return out


def relabel_confident(labels: np.ndarray, probs: np.ndarray, confidence: float) -> np.ndarray:
    """End-of-stage-2 correction on a noisy client: every sample whose global-model max
    probability exceeds ``confidence`` takes the global model's argmax."""
    out = np.array(labels, copy=True)
    chosen = probs.max(1) > confidence
    out[chosen] = probs[chosen].argmax(1)
    return out
