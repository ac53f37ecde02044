"""The prestopping rule of FedEFC's phase 1 (paper Algorithm 1; docs/FEDEFC.md §3.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def accuracy_standard_error(a_t: float, shares: list[int]) -> float:
    """The standard error of A(t), the unweighted mean of K clients' accuracies on
    validation shares of n_k samples: sqrt(A(t) (1 - A(t)) * sum_k 1 / n_k) / K, each
    A_k a binomial proportion with A(t) standing in for it (the server never sees one
    A_k under secure aggregation; docs/FEDEFC.md §3.3, ``prestopping-min-gain``)."""
    if not shares:
        return 0.0
    return math.sqrt(max(a_t * (1.0 - a_t), 0.0) * sum(1.0 / n for n in shares)) / len(shares)


# ``prestopping-min-gain = "auto"`` asks for one standard error where the standard error of
# A(t) is at most half a point even at A = 0.5 (equal shares: K * n >= 10,000 samples
# together): measured, the gain pays on shares of thousands of samples and hurts on shares
# of hundreds (docs/FEDEFC.md §3.3)
AUTO_GAIN = 1.0
AUTO_GAIN_MAX_SE = 0.005


def min_gain_z(setting: float | str, shares: list[int]) -> float:
    """How many standard errors a rise of A(t) must clear in a round whose clients hold
    validation shares of ``shares`` samples: the number ``prestopping-min-gain`` gives,
    or for ``auto`` :data:`AUTO_GAIN` where the worst-case standard error (A(t) = 0.5)
    is at most :data:`AUTO_GAIN_MAX_SE`, else 0, the paper's rule (docs/FEDEFC.md §3.3)."""
    if setting != "auto":
        return float(setting)
    if shares and accuracy_standard_error(0.5, shares) <= AUTO_GAIN_MAX_SE:
        return AUTO_GAIN
    return 0.0


@dataclass
class Prestopper:
    """Tracks A_max and the patience counter; fixes T_e once, after which the switch is final.

    Only rounds t > ``start_round`` are considered: if A(t) > A_max then A_max <- A(t)
    and tau_p <- 0, else tau_p <- tau_p + 1 (ties do not improve); when tau_p reaches
    ``gamma_thr`` the round t is the prestopping point T_e and phase 2 starts at T_e + 1.
    ``enabled=False`` never triggers (FedEFC without prestopping is FedAvg).
    """

    start_round: int
    gamma_thr: int
    enabled: bool = True
    a_max: float = 0.0
    patience: int = 0
    t_e: int | None = None
    history: list[tuple[int, float]] = field(default_factory=list)

    def phase(self, server_round: int) -> int:
        """1 up to and including T_e, 2 afterwards."""
        return 2 if self.t_e is not None and server_round > self.t_e else 1

    def observe(self, server_round: int, accuracy: float, min_gain: float = 0.0) -> bool:
        """Feed A(t) of ``server_round``; True exactly when this round becomes T_e. A rise
        counts only when A(t) > A_max + ``min_gain`` (0: any rise, the paper's rule);
        A_max is the last A(t) that counted."""
        self.history.append((server_round, float(accuracy)))
        if not self.enabled or self.t_e is not None or server_round <= self.start_round:
            return False
        if accuracy > self.a_max + min_gain:
            self.a_max = float(accuracy)
            self.patience = 0
            return False
        self.patience += 1
        if self.patience >= self.gamma_thr:
            self.t_e = server_round
            return True
        return False


def prestopping_point(accuracies: list[float], start_round: int, gamma_thr: int,
                      first_round: int = 1) -> int | None:
    """T_e of a whole accuracy sequence (rounds numbered from ``first_round``), or None."""
    stopper = Prestopper(start_round, gamma_thr)
    for offset, acc in enumerate(accuracies):
        if stopper.observe(first_round + offset, acc):
            return stopper.t_e
    return None
