"""The server hooks of FedEFC and of the methods that switch at its prestopping point
(forward correction, confident learning): A(t), prestopping and the phase switch.

Per round (paper Algorithm 1, docs/FEDEFC.md §3):

- every client is told its phase (1 up to and including T_e, 2 afterwards); in phase 1
  its reply must carry A_k, its accuracy (:func:`common.messages.carries_accuracy`);
- after a phase-1 round's weights are averaged, the accuracies of the valid replies are
  averaged WITHOUT weights (paper eq. (2); ``median`` / ``trimmed-mean`` bound lying
  clients, :mod:`.accuracy`) into A(t), which the :class:`.Prestopper` turns into T_e.
  Under secure aggregation the accuracies travel inside the secure sum and the server
  learns only their mean A(t) (docs/PRIVACY.md; ``client_acc`` is then not recorded);
- where the phase-2 guard is on (docs/FEDEFC.md §3.4), phase-2 replies carry A_k too and
  the :class:`.guard.Phase2Guard` keeps the global model with the best A(t); when phase
  2 stops beating it, that model is restored and the run ends. With the coordinator's
  clean validation set (:mod:`.clean_set`, docs/FEDEFC.md §3.9) the guard reads the
  received model's accuracy on that set instead of A(t).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from logging import INFO
from typing import Any

from flwr.common import Parameters, Scalar
from flwr.common.logger import log

from common.config import RunConfig
from common.fedefc_plan import twin_mode, twin_reads_slice
from common.messages import FitConfig, FitReply, carries_accuracy
from common.methods import counts_pooling, q_estimator_used, validation_share
from common.models import ClassifierShape

from .checkpoint import CheckpointError
from .clean_set import CleanSet
from .guard import ModelGuard, Phase2Guard, clients_signal
from .method_server import Aggregated, MethodServer
from .pipeline import evaluation_text
from .prestopping import Prestopper, accuracy_standard_error, min_gain_z
from .readings import clean_reading, client_mean, guard_reading, share_sizes
from .round_evaluation import Evaluator
from .validation import bad_number


class PrestoppingServer(MethodServer):
    """FedAvg with FedEFC's prestopping detection and phase switch."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.prestopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
        self.guard = ModelGuard(Phase2Guard(cfg.start_round, cfg.gamma_thr,
                                            fallback=cfg.guard_fallback == "train"),
                                clients_signal(cfg)) if cfg.guarded else None
        self.chooser = self.guard  # the model it keeps goes into every checkpoint
        self.gain_used: float | None = None  # z of the last round the rule saw

    def read_clean_set(self, evaluator: Evaluator, clean: CleanSet) -> str:
        """Let the phase-2 guard read ``evaluator``'s accuracy on the coordinator's clean
        validation set instead of A(t) (docs/FEDEFC.md §3.9)."""
        super().read_clean_set(evaluator, clean)
        if self.guard is not None:
            self.guard.signal = clean.summary
        return (f"the phase-2 guard reads {clean.summary} instead of the clients' "
                "held-out accuracy")

    def phase(self, server_round: int) -> int:
        """The prestopping phase; 1 again after the guard fell back (§3.7)."""
        fell_back = None if self.guard is None else self.guard.rule.fell_back
        if fell_back is not None and server_round > fell_back:
            return 1
        return self.prestopper.phase(server_round)

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        return {FitConfig.PHASE: self.phase(server_round)}

    def asks_accuracy(self, server_round: int) -> bool:
        return carries_accuracy(self.phase(server_round), self.cfg.guarded)

    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """A twin's reading on its guard slice wherever the reply carries A_k (under
        secure aggregation it travels inside the masked sum, checked there)."""
        if twin_reads_slice(self.cfg) and not self.cfg.secure_aggregation and \
                self.asks_accuracy(server_round):
            return bad_number(FitReply.GUARD_ACCURACY, metrics.get(FitReply.GUARD_ACCURACY),
                              0.0, 1.0)
        return None

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        """A(t) of a round that was aggregated: in phase 1 fed to the prestopping rule;
        with the phase-2 guard, the guard's reading of the round's received model (the
        model the run would deliver) in every round, whose verdict may replace the new
        global model with the best one it kept (docs/FEDEFC.md §3.4)."""
        t = result.round
        if result.parameters is None or not self.asks_accuracy(t):
            return result.parameters, {}
        accs, a_t = client_mean(result, FitReply.ACCURACY, self.cfg)
        fields: dict[str, Any] = {"client_acc": accs, "A": a_t}
        if a_t is None:
            return result.parameters, fields
        if self.prestopper.phase(t) == 1 and \
                self.prestopper.observe(t, a_t, self.min_gain(a_t, result)):
            log(INFO, "PRESTOPPING POINT T_e = %d (A_max = %.4f, patience %d = gamma_thr): "
                "phase 2 from round %d", t, self.prestopper.a_max, self.prestopper.patience,
                t + 1)
        if self.guard is None:
            return result.parameters, fields
        read = guard_reading(result, a_t, self.cfg, self.model_shape.num_classes, self.clean)
        fields.update(guard_acc=read.value, guard_se=read.se)
        # guard-score = "cross-fit" and validation-phase-2 = "guard-slice" read phase 2's
        # received models on a scale of their own from round T_e + 1, whose model phase 1
        # made (docs/FEDEFC.md §3.4, §3.6)
        rebase = ((self.cfg.guard_score == "cross-fit"
                   or self.cfg.validation_phase_2 == "guard-slice")
                  and self.prestopper.t_e is not None and t == self.prestopper.t_e + 1)
        new = self.guard.judge(
            t, read, result.received, result.parameters,
            phase_2_model=self.prestopper.phase(t - 1) == 2, rebase=rebase,
            last=t == self.cfg.rounds,
            read_output=None if self.clean is None else partial(
                clean_reading, self.clean, twinned=self.cfg.twinned))
        if self.guard.output_reading is not None:  # the last model's, on the clean set
            fields["guard_output_acc"] = self.guard.output_reading
        return new, fields

    def min_gain(self, a_t: float, result: Aggregated) -> float:
        """How far A(t) must rise above A_max to count: ``prestopping-min-gain`` standard
        errors of A(t) (``auto``: one where the shares are large enough, docs/FEDEFC.md
        §3.3), from the replying clients' share sizes, which their sample counts fix
        (``common/sample_roles.py: validation_count``)."""
        setting = self.cfg.min_gain_setting
        shares = share_sizes(result, self.cfg, self.model_shape.num_classes)
        z = min_gain_z(setting, shares)
        if z != (self.gain_used or 0.0):
            log(INFO, "prestopping-min-gain = %s: from round %d a rise of A(t) counts only "
                "above %g standard error(s) of A(t) (validation shares of %d samples in all)",
                setting, result.round, z, sum(shares))
        self.gain_used = z
        return z * accuracy_standard_error(a_t, shares)

    def finished(self) -> bool:
        """The guard gave its verdict: the run ends with the model it delivers."""
        return self.guard is not None and self.guard.rule.fired is not None

    # -- records, checkpoint, summary ---------------------------------------------------
    def state_fields(self, server_round: int) -> dict[str, Any]:
        """The phase of the round, A_max, the patience counter and T_e; with the guard,
        its best round and count of phase-2 rounds that did not beat it."""
        p = self.prestopper
        fields = {"phase": self.phase(server_round), "A_max": p.a_max,
                  "patience": p.patience, "t_e": p.t_e}
        if self.guard is not None:
            fields.update(guard_best_round=self.guard.rule.best_round,
                          guard_worse=self.guard.rule.worse)
        return fields

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"prestopper": asdict(self.prestopper)}
        if self.guard is not None:
            state["guard"] = asdict(self.guard.rule)
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.check_checkpoint(state, self.cfg)
        stopper = dict(state["prestopper"])
        stopper["history"] = [tuple(h) for h in stopper["history"]]
        self.prestopper = Prestopper(**stopper)
        if self.guard is not None and "guard" in state:
            self.guard.rule = Phase2Guard(**state["guard"])

    @classmethod
    def check_checkpoint(cls, state: dict[str, Any], cfg: RunConfig) -> None:
        """A run whose phase-2 guard gave its verdict has ended with the model it chose."""
        fired = (state.get("guard") or {}).get("fired")
        if fired is not None:
            raise CheckpointError(
                f"this run ended after round {fired}: its phase-2 guard restored the model of "
                f"round {state['guard']['best_round']} (docs/FEDEFC.md §3.4), and nothing "
                "remains to resume; start a new run")

    def summary_fields(self) -> dict[str, Any]:
        """T_e, A_max, the minimum gain of the rule (the setting, and the standard errors
        it asked for in the last round the rule saw), the accuracy signal the run used
        with the share it kept and whose labels the share holds, how its clients pooled
        their counts and estimated Q, and the phase-2 guard, what it read, the model the
        run delivers and why, and the twin (``auto`` resolved: docs/FEDEFC.md §3.1, §3.3,
        §3.4, §3.8, §3.9, §4.7, §4.8)."""
        g = self.guard
        r = None if g is None else g.rule
        return {"t_e": self.prestopper.t_e, "A_max": self.prestopper.a_max,
                "prestopping_min_gain": self.cfg.prestopping_min_gain,
                "prestopping_min_gain_used": self.gain_used,
                "accuracy_signal": self.cfg.accuracy_signal_mode,
                "validation_labels": self.cfg.validation_labels,
                "validation_share": validation_share(self.cfg),
                "q_pooling": counts_pooling(self.cfg),
                "q_estimator": q_estimator_used(self.cfg),
                "phase_2_guard": "on" if g is not None else "off",
                **({"guard_signal": None} if g is None else g.summary_fields()),
                "twin_model": twin_mode(self.cfg),
                "guard_restored_round": None if r is None or r.fired is None else r.best_round,
                "guard_ended_at": None if r is None else r.fired,
                "guard_fell_back_at": None if r is None else r.fell_back}

    def notes(self) -> list[str]:
        """A run that never left phase 1 trained as FedAvg, and a run whose guard undid
        phase 2 or could not choose: say so in plain words, and what to change."""
        if self.guard is not None:
            said = self.guard.notes(self.cfg.rounds)
            if said:
                return said
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
        guard = "" if self.guard is None else self.guard.describe(record)
        fell_back = None if self.guard is None else self.guard.rule.fell_back
        if record["phase"] == 1 and fell_back is not None and record["round"] > fell_back:
            return f"{head} (the guard's fallback){guard} | {evaluation_text(record)}"
        if record["phase"] == 1:
            a = record.get("A")
            watched = record["round"] > self.cfg.start_round
            a_max = f"{record['A_max']:.4f}" if watched else "n/a (from round " \
                f"{self.cfg.start_round + 1})"
            return (f"{head} | A(t) {'n/a' if a is None else f'{a:.4f}'}  A_max {a_max}  "
                    f"patience {record['patience']}/{self.cfg.gamma_thr}{guard} | "
                    f"{evaluation_text(record)}")
        kinds = ", ".join(sorted(set(record.get("client_loss", [])))) or "no clients"
        cos = record.get("q_cos")
        q = "" if cos is None else f" (Q vs true: cos {cos:.3f}, L1 {record['q_l1']:.3f})"
        a = "" if record.get("A") is None else f" | A(t) {record['A']:.4f}"
        return (f"{head} | {record.get('n_clients', 0)} clients, loss: {kinds}{q}{a}{guard} | "
                f"{evaluation_text(record)}")
