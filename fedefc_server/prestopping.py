"""The prestopping rule of FedEFC's phase 1 (paper Algorithm 1; docs/FEDEFC.md §3.3)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def observe(self, server_round: int, accuracy: float) -> bool:
        """Feed A(t) of ``server_round``; True exactly when this round becomes T_e."""
        self.history.append((server_round, float(accuracy)))
        if not self.enabled or self.t_e is not None or server_round <= self.start_round:
            return False
        if accuracy > self.a_max:
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
