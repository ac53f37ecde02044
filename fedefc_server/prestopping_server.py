"""The server hooks of FedEFC and of the methods that switch at its prestopping point
(forward correction, confident learning): A(t), prestopping and the phase switch.

Per round (paper Algorithm 1, docs/FEDEFC.md §3):

- every client is told its phase (1 up to and including T_e, 2 afterwards); in phase 1
  its reply must carry A_k, its accuracy (:func:`common.messages.carries_accuracy`);
- after a phase-1 round's weights are averaged, the accuracies of the valid replies are
  averaged WITHOUT weights (paper eq. (2); ``median`` / ``trimmed-mean`` bound lying
  clients, :mod:`.accuracy`) into A(t), which the :class:`.Prestopper` turns into T_e.
  Under secure aggregation the accuracies travel inside the secure sum and the server
  learns only their mean A(t) (docs/PRIVACY.md; ``client_acc`` is then not recorded).
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO
from typing import Any

from flwr.common import Parameters, Scalar
from flwr.common.logger import log

from common.config import RunConfig
from common.messages import FitConfig, FitReply, carries_accuracy
from common.methods import counts_pooling, validation_share
from common.models import ClassifierShape

from .accuracy import aggregate_accuracy
from .method_server import Aggregated, MethodServer
from .pipeline import evaluation_text
from .prestopping import Prestopper


class PrestoppingServer(MethodServer):
    """FedAvg with FedEFC's prestopping detection and phase switch."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.prestopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)

    def phase(self, server_round: int) -> int:
        return self.prestopper.phase(server_round)

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        return {FitConfig.PHASE: self.phase(server_round)}

    def asks_accuracy(self, server_round: int) -> bool:
        return carries_accuracy(self.phase(server_round))

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        """A(t) of a phase-1 round that was aggregated, fed to the prestopping rule."""
        t = result.round
        if result.parameters is None or not self.asks_accuracy(t):
            return result.parameters, {}
        if result.secure:  # only the sum reached the server (docs/PRIVACY.md)
            accs, a_t = None, result.secure_means.get(FitReply.ACCURACY)
        else:
            accs = [float(res.metrics[FitReply.ACCURACY]) for _, res in result.replies]
            a_t = aggregate_accuracy(accs, self.cfg.accuracy_aggregation, self.cfg.trim_fraction)
        if a_t is not None and self.prestopper.observe(t, a_t):
            log(INFO, "PRESTOPPING POINT T_e = %d (A_max = %.4f, patience %d = gamma_thr): "
                "phase 2 from round %d", t, self.prestopper.a_max, self.prestopper.patience,
                t + 1)
        return result.parameters, {"client_acc": accs, "A": a_t}

    # -- records, checkpoint, summary ---------------------------------------------------
    def state_fields(self, server_round: int) -> dict[str, Any]:
        """The phase of the round, A_max, the patience counter and T_e."""
        p = self.prestopper
        return {"phase": p.phase(server_round), "A_max": p.a_max, "patience": p.patience,
                "t_e": p.t_e}

    def state(self) -> dict[str, Any]:
        return {"prestopper": asdict(self.prestopper)}

    def load_state(self, state: dict[str, Any]) -> None:
        stopper = dict(state["prestopper"])
        stopper["history"] = [tuple(h) for h in stopper["history"]]
        self.prestopper = Prestopper(**stopper)

    def summary_fields(self) -> dict[str, Any]:
        """T_e, A_max, the accuracy signal the run used with the share it kept, and how
        its clients pooled their counts (``auto`` resolved: docs/FEDEFC.md §3.1, §4.7)."""
        return {"t_e": self.prestopper.t_e, "A_max": self.prestopper.a_max,
                "accuracy_signal": self.cfg.accuracy_signal_mode,
                "validation_share": validation_share(self.cfg),
                "q_pooling": counts_pooling(self.cfg)}

    def notes(self) -> list[str]:
        """A run that never left phase 1 trained as FedAvg: say so, and what to change."""
        if not self.cfg.prestopping or self.prestopper.t_e is not None:
            return []
        last = self.prestopper.history[-1][1] if self.prestopper.history else None
        rising = last is not None and last >= self.prestopper.a_max
        return [f"{self.cfg.method} never left phase 1: prestopping found no T_e, so every "
                f"round trained as FedAvg and the method's correction never ran. "
                + ("A(t) was still rising at the last round"
                   if rising else f"A(t) did not stall for gamma-thr={self.cfg.gamma_thr} "
                   f"rounds after start-round={self.cfg.start_round}")
                + ("; when every node trains in every round, the global model memorizes the "
                   "labels A(t) is measured on: set accuracy-signal=\"held-out\" (docs/FEDEFC.md "
                   "§3.1 says what it costs), or lower gamma-thr or start-round, or raise "
                   "rounds" if self.cfg.accuracy_signal_mode != "held-out" else
                   "; lower gamma-thr or start-round, or raise rounds")]

    def describe(self, record: dict[str, Any]) -> str:
        head = f"phase {record['phase']}"
        if record["round"] == 0:
            return f"{head} | initial model: {evaluation_text(record)}"
        if record["phase"] == 1:
            a = record.get("A")
            return (f"{head} | A(t) {'n/a' if a is None else f'{a:.4f}'}  A_max "
                    f"{record['A_max']:.4f}  patience {record['patience']}/"
                    f"{self.cfg.gamma_thr} | {evaluation_text(record)}")
        kinds = ", ".join(sorted(set(record.get("client_loss", [])))) or "no clients"
        cos = record.get("q_cos")
        q = "" if cos is None else f" (Q vs true: cos {cos:.3f}, L1 {record['q_l1']:.3f})"
        return (f"{head} | {record.get('n_clients', 0)} clients, loss: {kinds}{q} | "
                f"{evaluation_text(record)}")
