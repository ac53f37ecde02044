"""FedEFC's server: accuracy aggregation, prestopping and the phase switch.

Per round (paper Algorithm 1, docs/FEDEFC.md §3), on top of :class:`.FedAvgStrategy`:

- every client is told its phase (1 up to and including T_e, 2 afterwards); in phase 1
  its reply must carry A_k, its accuracy (docs/FEDEFC.md §3.1);
- after a phase-1 round's weights are averaged, the accuracies of the valid replies are
  averaged WITHOUT weights (paper eq. (2); ``median`` / ``trimmed-mean`` bound lying
  clients, :mod:`.accuracy`) into A(t), which the :class:`.Prestopper` turns into T_e.
  Under secure aggregation the accuracies travel inside the secure sum and the server
  learns only their mean A(t) (docs/PRIVACY.md; ``client_acc`` is then not recorded).

Forward correction and confident learning use this strategy too: like FedEFC, they
change their local update once prestopping has switched to phase 2.
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO
from typing import Any

from flwr.common import FitRes, Parameters, Scalar
from flwr.common.logger import log
from flwr.server.client_proxy import ClientProxy

from .accuracy import aggregate_accuracy
from .prestopping import Prestopper
from .strategy import FedAvgStrategy, evaluation_text


class FedEFCStrategy(FedAvgStrategy):
    """FedAvg with FedEFC's prestopping detection and phase switch."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.prestopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)

    def phase(self, server_round: int) -> int:
        return self.prestopper.phase(server_round)

    def client_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        return {**super().client_config(partition_id, server_round),
                "phase": self.phase(server_round)}

    def asks_accuracy(self, server_round: int) -> bool:
        return self.phase(server_round) == 1

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is None or self.phase(server_round) != 1:
            return params, metrics
        if self.secure:  # only the sum reached the server (docs/PRIVACY.md)
            accs, a_t = None, self.secure_means.get("accuracy")
        else:
            accs = [float(res.metrics["accuracy"]) for _, res in self.accepted]
            a_t = aggregate_accuracy(accs, self.cfg.accuracy_aggregation, self.cfg.trim_fraction)
        self.record(client_acc=accs, A=a_t)
        if a_t is not None and self.prestopper.observe(server_round, a_t):
            log(INFO, "PRESTOPPING POINT T_e = %d (A_max = %.4f, patience %d = gamma_thr): "
                "phase 2 from round %d", server_round, self.prestopper.a_max,
                self.prestopper.patience, server_round + 1)
        return params, metrics

    # -- records, checkpoint, summary ---------------------------------------------------
    def state_fields(self, server_round: int) -> dict[str, Any]:
        """The phase of the round, A_max, the patience counter and T_e."""
        p = self.prestopper
        return {"phase": p.phase(server_round), "A_max": p.a_max, "patience": p.patience,
                "t_e": p.t_e}

    def server_state(self) -> dict[str, Any]:
        return {**super().server_state(), "prestopper": asdict(self.prestopper)}

    def load_server_state(self, state: dict[str, Any]) -> None:
        super().load_server_state(state)
        stopper = dict(state["prestopper"])
        stopper["history"] = [tuple(h) for h in stopper["history"]]
        self.prestopper = Prestopper(**stopper)

    def summary_fields(self) -> dict[str, Any]:
        return {**super().summary_fields(), "t_e": self.prestopper.t_e,
                "A_max": self.prestopper.a_max}

    def describe(self, record: dict[str, Any]) -> str:
        head = f"phase {record['phase']}"
        if record["round"] == 0:
            return f"{head} | {super().describe(record)}"
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
