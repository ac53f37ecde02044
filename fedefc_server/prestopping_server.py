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
from logging import INFO, WARNING
from typing import Any

from flwr.common import Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log

from common.config import RunConfig, twin_mode
from common.data_plan import validation_count
from common.messages import FitConfig, FitReply, carries_accuracy
from common.methods import counts_pooling, q_estimator_used, validation_share
from common.models import ClassifierShape
from common.twin import delivered

from .accuracy import aggregate_accuracy
from .checkpoint import CheckpointError
from .clean_set import CleanSet
from .guard import Phase2Guard
from .method_server import Aggregated, MethodServer
from .pipeline import evaluation_text
from .prestopping import Prestopper, accuracy_standard_error, min_gain_z
from .round_evaluation import Evaluator

KEPT = "guard-best"  # the checkpoint's name for the guard's best model


class PrestoppingServer(MethodServer):
    """FedAvg with FedEFC's prestopping detection and phase switch."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        super().__init__(cfg, model_shape)
        self.prestopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
        self.guard = Phase2Guard(cfg.start_round, cfg.gamma_thr,
                                 fallback=cfg.guard_fallback == "train") if cfg.guarded else None
        self.kept: Parameters | None = None  # the guard's best model
        self.gain_used: float | None = None  # z of the last round the rule saw

    def read_clean_set(self, evaluator: Evaluator, clean: CleanSet) -> str:
        """Let the phase-2 guard read ``evaluator``'s accuracy on the coordinator's
        clean validation set instead of A(t) (docs/FEDEFC.md §3.9)."""
        super().read_clean_set(evaluator, clean)
        return (f"the phase-2 guard reads {clean.summary} instead of the clients' "
                "held-out accuracy")

    @property
    def guard_signal(self) -> str:
        """What the phase-2 guard reads, in words (the summary's ``guard_signal``)."""
        if self.clean is not None:
            return self.clean[1].summary
        if self.cfg.validation_labels == "verified":
            return "the clients' verified shares"
        if self.cfg.guard_score == "cross-fit":
            return "the clients' held-out accuracy, cross-fitted"
        return "the clients' held-out accuracy through Q"

    @property
    def fell_back(self) -> int | None:
        """The round whose guard verdict sent training back to cross-entropy, if any
        (guard-fallback = "train", docs/FEDEFC.md §3.7)."""
        return self.guard.fell_back if self.guard is not None else None

    def phase(self, server_round: int) -> int:
        """The prestopping phase; 1 again after the guard fell back (§3.7)."""
        if self.fell_back is not None and server_round > self.fell_back:
            return 1
        return self.prestopper.phase(server_round)

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        return {FitConfig.PHASE: self.phase(server_round)}

    def asks_accuracy(self, server_round: int) -> bool:
        return carries_accuracy(self.phase(server_round), self.cfg.guarded)

    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        """A(t) of a round that was aggregated: in phase 1 fed to the prestopping rule,
        in every round to the phase-2 guard, whose verdict may replace the new global
        model with the best one it kept (docs/FEDEFC.md §3.4)."""
        t = result.round
        if result.parameters is None or not self.asks_accuracy(t):
            return result.parameters, {}
        if result.secure:  # only the sum reached the server (docs/PRIVACY.md)
            accs, a_t = None, result.secure_means.get(FitReply.ACCURACY)
        else:
            accs = [float(res.metrics[FitReply.ACCURACY]) for _, res in result.replies]
            a_t = aggregate_accuracy(accs, self.cfg.accuracy_aggregation, self.cfg.trim_fraction)
        fields: dict[str, Any] = {"client_acc": accs, "A": a_t}
        if a_t is None:
            return result.parameters, fields
        if self.prestopper.phase(t) == 1 and \
                self.prestopper.observe(t, a_t, self.min_gain(a_t, result)):
            log(INFO, "PRESTOPPING POINT T_e = %d (A_max = %.4f, patience %d = gamma_thr): "
                "phase 2 from round %d", t, self.prestopper.a_max, self.prestopper.patience,
                t + 1)
        if self.guard is not None and self.clean is not None and result.received is not None:
            # the model the round received, measured on the coordinator's checked samples:
            # with a twin, the model the run delivers (§3.8, §3.9)
            weights = delivered(parameters_to_ndarrays(result.received), self.cfg.twinned)
            fields["guard_acc"] = self.clean[0](weights)[1]
            return self.guarded(result, fields["guard_acc"]), fields
        return self.guarded(result, a_t), fields

    def min_gain(self, a_t: float, result: Aggregated) -> float:
        """How far A(t) must rise above A_max to count: ``prestopping-min-gain`` standard
        errors of A(t) (``auto``: one where the shares are large enough, docs/FEDEFC.md
        §3.3), from the replying clients' share sizes, which their sample counts fix
        (``common/data_plan.py: validation_count``)."""
        setting = self.cfg.min_gain_setting
        cap = self.cfg.validation_max_per_class * self.model_shape.num_classes
        shares = [validation_count(self.cfg.validation_fraction, cap, res.num_examples)
                  for _, res in result.replies if res.num_examples > 1]
        z = min_gain_z(setting, shares)
        if z != (self.gain_used or 0.0):
            log(INFO, "prestopping-min-gain = %s: from round %d a rise of A(t) counts only "
                "above %g standard error(s) of A(t) (validation shares of %d samples in all)",
                setting, result.round, z, sum(shares))
        self.gain_used = z
        return z * accuracy_standard_error(a_t, shares)

    def guarded(self, result: Aggregated, a_t: float) -> Parameters | None:
        """The round's new global model after the guard saw A(t): FedAvg's, or, when the
        guard fires, the best model it kept (the model a round received is the one its
        A(t) measures)."""
        if self.guard is None:
            return result.parameters
        t = result.round
        # guard-score = "cross-fit" and validation-phase-2 = "guard-slice" read phase 2's
        # received models on a scale of their own from round T_e + 1, whose model phase 1
        # made (docs/FEDEFC.md §3.4, §3.6)
        rebase = ((self.cfg.guard_score == "cross-fit"
                   or self.cfg.validation_phase_2 == "guard-slice")
                  and self.prestopper.t_e is not None and t == self.prestopper.t_e + 1)
        verdict = self.guard.observe(t, a_t, phase_2_model=self.prestopper.phase(t - 1) == 2,
                                     rebase=rebase)
        if verdict == "best":
            self.kept = result.received
        elif verdict == "fell back":
            log(WARNING, "PHASE-2 GUARD: %d rounds of phase 2 did not beat %.4f, %s of "
                "the model round %d received: that model is restored "
                "and training goes on with cross-entropy from round %d (guard-fallback = "
                "\"train\")", self.guard.patience, self.guard.best_a, self.guard_read,
                self.guard.best_round, t + 1)
            return self.kept
        elif verdict == "fired":
            log(WARNING, "PHASE-2 GUARD: %d rounds of %s did not beat %.4f, %s of the "
                "model round %d received: that model is restored "
                "and the run ends after round %d", self.guard.patience, self.trained_on(),
                self.guard.best_a, self.guard_read, self.guard.best_round, t)
            return self.kept
        return result.parameters

    @property
    def guard_read(self) -> str:
        """The accuracy the guard compares, in a few words (log lines and notes)."""
        return ("the accuracy on the coordinator's clean set" if self.clean is not None
                else "the held-out accuracy")

    def trained_on(self) -> str:
        """What made the models the guard last judged, in words."""
        return "phase 2" if self.fell_back is None else "cross-entropy after the fallback"

    def finished(self) -> bool:
        """The guard fired: the run ends with the model it restored."""
        return self.guard is not None and self.guard.fired is not None

    # -- records, checkpoint, summary ---------------------------------------------------
    def state_fields(self, server_round: int) -> dict[str, Any]:
        """The phase of the round, A_max, the patience counter and T_e; with the guard,
        its best round and count of phase-2 rounds that did not beat it."""
        p = self.prestopper
        fields = {"phase": self.phase(server_round), "A_max": p.a_max,
                  "patience": p.patience, "t_e": p.t_e}
        if self.guard is not None:
            fields.update(guard_best_round=self.guard.best_round, guard_worse=self.guard.worse)
        return fields

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"prestopper": asdict(self.prestopper)}
        if self.guard is not None:
            state["guard"] = asdict(self.guard)
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.check_checkpoint(state, self.cfg)
        stopper = dict(state["prestopper"])
        stopper["history"] = [tuple(h) for h in stopper["history"]]
        self.prestopper = Prestopper(**stopper)
        if self.guard is not None and "guard" in state:
            self.guard = Phase2Guard(**state["guard"])

    @classmethod
    def check_checkpoint(cls, state: dict[str, Any], cfg: RunConfig) -> None:
        """A run whose phase-2 guard fired has ended with the model it restored."""
        fired = (state.get("guard") or {}).get("fired")
        if fired is not None:
            raise CheckpointError(
                f"this run ended after round {fired}: its phase-2 guard restored the model of "
                f"round {state['guard']['best_round']} (docs/FEDEFC.md §3.4), and nothing "
                "remains to resume; start a new run")

    def models(self) -> dict[str, list]:
        return {} if self.kept is None else {KEPT: parameters_to_ndarrays(self.kept)}

    def load_models(self, models: dict[str, list]) -> None:
        if self.guard is not None and self.guard.best_round is not None:
            if KEPT not in models:
                raise CheckpointError(
                    f"the checkpoint's phase-2 guard kept the model of round "
                    f"{self.guard.best_round} but the checkpoint holds no {KEPT!r} model; "
                    "start a new run")
            self.kept = ndarrays_to_parameters(models[KEPT])

    def summary_fields(self) -> dict[str, Any]:
        """T_e, A_max, the minimum gain of the rule (the setting, and the standard errors
        it asked for in the last round the rule saw), the accuracy signal the run used
        with the share it kept, how its clients pooled their counts and estimated Q, and
        the phase-2 guard, what it read, and the twin (``auto`` resolved: docs/FEDEFC.md
        §3.1, §3.3, §3.4, §3.8, §3.9, §4.7, §4.8)."""
        g = self.guard
        return {"t_e": self.prestopper.t_e, "A_max": self.prestopper.a_max,
                "prestopping_min_gain": self.cfg.prestopping_min_gain,
                "prestopping_min_gain_used": self.gain_used,
                "accuracy_signal": self.cfg.accuracy_signal_mode,
                "validation_share": validation_share(self.cfg),
                "q_pooling": counts_pooling(self.cfg),
                "q_estimator": q_estimator_used(self.cfg),
                "phase_2_guard": "on" if g is not None else "off",
                "guard_signal": None if g is None else self.guard_signal,
                "twin_model": twin_mode(self.cfg),
                "guard_restored_round": None if g is None or g.fired is None else g.best_round,
                "guard_ended_at": None if g is None else g.fired,
                "guard_fell_back_at": self.fell_back}

    def notes(self) -> list[str]:
        """A run that never left phase 1 trained as FedAvg, and a run whose guard undid
        phase 2: say so in plain words, and what to change."""
        g = self.guard
        fell_back = [] if self.fell_back is None else [
            f"phase 2 did not beat the best {self.guard_read[4:]} in {g.patience} rounds of its "
            f"own: the phase-2 guard restored the best model after round {self.fell_back} and "
            "training went on with cross-entropy (guard-fallback = \"train\", "
            "docs/FEDEFC.md §3.7)"]
        if self.finished():
            return [*fell_back,
                    f"{self.trained_on()} did not beat {self.guard_read} of the model "
                    f"round {g.best_round} received ({g.best_a:.4f}) in {g.patience} "
                    f"rounds of its own: the phase-2 guard restored that model, and the run "
                    f"ended with it after round {g.fired} of {self.cfg.rounds} "
                    "(docs/FEDEFC.md §3.4)"]
        if fell_back:
            return fell_back
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
        guard = ""
        if self.guard is not None and record.get("A") is not None:
            read = ("" if record.get("guard_acc") is None
                    else f"  clean set {record['guard_acc']:.4f}")
            guard = (f" | A(t) {record['A']:.4f}{read}  best {self.guard.best_a:.4f} (round "
                     f"{record['guard_best_round']})  not beaten {record['guard_worse']}/"
                     f"{self.guard.patience}")
        if record["phase"] == 1 and self.fell_back is not None and record["round"] > self.fell_back:
            return f"{head} (the guard's fallback){guard} | {evaluation_text(record)}"
        if record["phase"] == 1:
            a = record.get("A")
            watched = record["round"] > self.cfg.start_round
            a_max = f"{record['A_max']:.4f}" if watched else "n/a (from round " \
                f"{self.cfg.start_round + 1})"
            return (f"{head} | A(t) {'n/a' if a is None else f'{a:.4f}'}  A_max {a_max}  "
                    f"patience {record['patience']}/{self.cfg.gamma_thr} | "
                    f"{evaluation_text(record)}")
        kinds = ", ".join(sorted(set(record.get("client_loss", [])))) or "no clients"
        cos = record.get("q_cos")
        q = "" if cos is None else f" (Q vs true: cos {cos:.3f}, L1 {record['q_l1']:.3f})"
        return (f"{head} | {record.get('n_clients', 0)} clients, loss: {kinds}{q}{guard} | "
                f"{evaluation_text(record)}")
