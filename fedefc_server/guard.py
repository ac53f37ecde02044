"""The delivered-model rule: which model a guarded run hands over (docs/FEDEFC.md §3.4).

Where a run has a guard signal (the clients' held-out or verified shares, or the
coordinator's clean set), the model it delivers is the one that reads best on that
signal over every model the run produced after ``start-round``, phase 1 included, read
the same way on every candidate, and read on THE MODEL THAT IS DELIVERED (with a twin,
the twin, on samples it never trained on: docs/FEDEFC.md §3.8); a tie keeps the later
model. A signal that cannot tell the models apart does not choose: where its best
reading does not lead its lowest by :data:`MARGIN` standard errors of their difference
(every reading a tie, or a set too small for its spread), the run trains on and
delivers its last model. So:

- every round the guard sees the reading of the model the round RECEIVED; the highest
  so far is the best, kept by the server;
- a round whose received model phase 2 trained (round T_e + 2 on) and that does not
  beat the best counts against phase 2, one that beats it clears the count; after
  ``patience`` such rounds in a row the guard restores the best and the run ends
  (``"fired"``; with ``guard-fallback = "train"`` the first such verdict restores it and
  training goes on with cross-entropy, ``"fell back"``), unless the signal cannot tell
  (``"unclear"``: the count starts again and the run trains on);
- the end of the run is a verdict too (:meth:`Phase2Guard.last_verdict`): the best
  replaces the last model where it reads higher.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log

from common.config import RunConfig
from common.twin import delivered

from .checkpoint import CheckpointError
from .clean_set import CleanSet
from .evaluation import TestSetEvaluator

KEPT = "guard-best"  # the checkpoint's name for the guard's best model

# How many standard errors of the difference of two readings one must lead the other by
# before the signal chooses between them (docs/FEDEFC.md §3.4, "A signal that cannot tell")
MARGIN = 1.0


def binomial_se(accuracy: float, n: int) -> float:
    """The standard error of an accuracy read on ``n`` samples (binomial); infinite on
    none, so that a reading of nothing never tells two models apart."""
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / n) if n > 0 else math.inf


def tells_apart(high: float, high_se: float, low: float, low_se: float,
                high_correct: Sequence[bool] | None = None,
                low_correct: Sequence[bool] | None = None) -> bool:
    """Whether ``high`` reads above ``low`` by more than :data:`MARGIN` standard errors
    of their difference. Where both were read on the same samples and the server saw
    which each got right (``*_correct``: the coordinator's clean set), the error is the
    paired one, from the samples the two models disagree on; else the two readings'
    errors are taken as independent, which errs on the side of not choosing."""
    if high_correct is not None and low_correct is not None \
            and len(high_correct) == len(low_correct) > 1:
        d = np.asarray(high_correct, dtype=float) - np.asarray(low_correct, dtype=float)
        return high - low > MARGIN * math.sqrt(d.var() / len(d))
    return high - low > MARGIN * math.hypot(high_se, low_se)


def clean_reading(clean: tuple[TestSetEvaluator, CleanSet], parameters: Parameters,
                  twinned: bool) -> Reading:
    """The accuracy on the coordinator's clean set of the model of ``parameters`` that
    the run delivers (with a twin, the twin), its standard error, and which samples it
    got right."""
    evaluator, samples = clean
    correct = evaluator.correct(delivered(parameters_to_ndarrays(parameters), twinned))
    acc = float(correct.mean()) if len(correct) else 0.0
    return Reading(acc, binomial_se(acc, len(samples.y)), correct)


def clients_signal(cfg: RunConfig) -> str:
    """What a guard reads on the clients, in words (the coordinator's clean set, where
    the run has one, replaces it: docs/FEDEFC.md §3.9)."""
    whose = "the twin's guard slices" if cfg.twinned else "the clients' shares"
    if cfg.validation_labels == "verified":
        return f"the verified labels of {whose}"
    how = "cross-fitted" if cfg.guard_score == "cross-fit" else "through Q"
    return f"the held-out accuracy on {whose}, {how}"


def delivery_rule(cfg: RunConfig) -> str:
    """Which model the run delivers, and on what signal, in words (the run's header)."""
    reads = (f"the coordinator's clean set ({cfg.clean_validation_key})"
             if cfg.clean_validation_key else clients_signal(cfg))
    if cfg.guarded or cfg.deliver == "best-read":
        return f"the model that reads best on {reads} (docs/FEDEFC.md §3.4)"
    return "the last round's model (no guard signal)"


@dataclass
class Phase2Guard:
    """The best reading so far with its standard error and the round whose received
    model scored it, the lowest reading (to tell whether the signal separates the
    models at all), the phase-2 rounds in a row that did not beat the best, the round
    the guard gave its verdict in, and the verdicts the signal could not make.

    :meth:`observe` takes the reading of round t: a measure of the global model the
    round SENT (the model after round t - 1). Plain code, checkpointable with ``asdict``.
    """

    start_round: int
    patience: int
    best_a: float = -1.0
    best_se: float = 0.0
    best_correct: list[bool] | None = None  # which samples the best got right, if known
    best_round: int | None = None
    low_a: float = 2.0  # the lowest reading, its error and samples: the signal's spread
    low_se: float = 0.0
    low_correct: list[bool] | None = None
    worse: int = 0
    fired: int | None = None
    fallback: bool = False  # guard-fallback = "train": the first verdict trains on
    fell_back: int | None = None  # the round whose verdict went back to cross-entropy
    unclear: list[int] | None = None  # rounds whose verdict the signal could not make

    def observe(self, server_round: int, accuracy: float, phase_2_model: bool,
                rebase: bool = False, se: float = 0.0,
                correct: Sequence[bool] | None = None) -> str:
        """Feed the reading of round ``server_round`` with its standard error ``se`` (and,
        where the server read it itself, which samples it got right: ``correct``);
        returns ``"best"`` (the round's received model is the new best: keep it),
        ``"fell back"`` (restore the best model and train on with cross-entropy),
        ``"fired"`` (restore the best model and end the run), ``"unclear"`` (a verdict
        was due but the signal does not tell any two of the models it read apart:
        :meth:`flat`; train on), or ``""``. ``phase_2_model``: a model trained after T_e
        (by phase 2, or after falling back); the restored model itself, measured again
        by the round after the fallback, is not counted. ``rebase``: the reading is on a
        new scale from this round on (``guard-score = "cross-fit"`` or
        ``validation-phase-2 = "guard-slice"`` at round T_e + 1), so the round's received
        model is the new best (and the lowest) whatever the old scale read."""
        if self.fired is not None or server_round <= self.start_round:
            return ""
        kept = None if correct is None else [bool(c) for c in correct]
        if rebase or accuracy < self.low_a:
            self.low_a, self.low_se, self.low_correct = float(accuracy), float(se), kept
        if rebase or accuracy > self.best_a:
            self.best_a, self.best_se, self.best_correct = float(accuracy), float(se), kept
            self.best_round, self.worse = server_round, 0
            return "best"
        if not phase_2_model or server_round == (self.fell_back or -1) + 1:
            return ""
        self.worse += 1
        if self.worse < self.patience:
            return ""
        if self.flat():
            self.worse = 0
            self.unclear = [*(self.unclear or []), server_round]
            return "unclear"
        if self.fallback and self.fell_back is None:
            self.fell_back, self.worse = server_round, 0
            return "fell back"
        self.fired = server_round
        return "fired"

    def flat(self) -> bool:
        """Whether the signal cannot tell any two of the models it read apart: its best
        reading does not lead its lowest by :data:`MARGIN` standard errors of their
        difference (every reading a tie, or a set too small for its spread)."""
        return not tells_apart(self.best_a, self.best_se, self.low_a, self.low_se,
                               self.best_correct, self.low_correct)

    def last_verdict(self, server_round: int, accuracy: float | None) -> bool:
        """The end of the run (round ``server_round``, the last): whether the best model
        replaces the one the run would deliver, read ``accuracy`` (None where the signal
        never read it: then the last reading, of the model the last round received,
        stands for it): where it reads higher (a tie keeps the later model) and the
        signal is not :meth:`flat`. Records the verdict as :attr:`fired`."""
        if (self.fired is not None or self.best_round is None or accuracy is None
                or not accuracy < self.best_a or self.flat()):
            return False
        self.fired = server_round
        return True


@dataclass(frozen=True)
class Reading:
    """One model's reading on the guard's signal: its accuracy, the standard error of
    that accuracy and, where the server read it itself (the coordinator's clean set),
    which of the set's samples it got right (for the paired error of a difference)."""

    value: float
    se: float
    correct: Sequence[bool] | None = None


@dataclass(frozen=True)
class Delivered:
    """The model a guarded run delivers: the global model after ``after_round`` rounds,
    its reading on the guard's signal (None where the signal never read it) and why, in
    words (the summary's ``delivered_*`` fields, the closing lines, ``curves.png``)."""

    after_round: int
    reading: float | None
    why: str


class ModelGuard:
    """The server's side of the rule: :class:`Phase2Guard` fed each round's reading, the
    model it keeps (the best so far, the pair with a twin), its verdicts logged, and the
    model the run delivers (:class:`Delivered`). ``signal``: what it reads, in words."""

    def __init__(self, rule: Phase2Guard, signal: str):
        self.rule = rule
        self.signal = signal
        self.kept: Parameters | None = None
        self.delivered: Delivered | None = None
        self.output_reading: float | None = None  # the last model's, where the server read it

    def judge(self, t: int, read: Reading, received: Parameters | None,
              proposed: Parameters | None, *, phase_2_model: bool, rebase: bool,
              last: bool, read_output: Callable[[Parameters], Reading] | None
              ) -> Parameters | None:
        """The round's new global model after the guard's reading ``read`` of the model
        round ``t`` received: ``proposed`` (FedAvg's), or the kept best when a verdict
        restores it. ``last``: the run's last round, whose end is a verdict too;
        ``read_output`` reads ``proposed`` on the signal where the server can (the
        coordinator's clean set), else the last reading stands for it."""
        verdict = self.rule.observe(t, read.value, phase_2_model, rebase, read.se,
                                    read.correct)
        r, trained_on = self.rule, self.trained_on
        if verdict == "best":
            self.kept = received
        elif verdict == "unclear":
            log(INFO, "PHASE-2 GUARD: %d rounds of %s did not beat %.4f (round %d), but the "
                "signal (%s) does not tell the models it read apart (its best leads its "
                "lowest, %.4f, by less than %g standard error(s)): no verdict, training goes on",
                r.patience, trained_on, r.best_a, r.best_round, self.signal, r.low_a,
                MARGIN)
        elif verdict == "fell back":
            log(WARNING, "PHASE-2 GUARD: %d rounds of phase 2 did not beat %.4f, %s of "
                "the model round %d received: that model is restored and training goes on "
                "with cross-entropy from round %d (guard-fallback = \"train\")", r.patience,
                r.best_a, self.signal, r.best_round, t + 1)
            return self.kept
        elif verdict == "fired":
            log(WARNING, "PHASE-2 GUARD: %d rounds of %s did not beat %.4f, %s of the "
                "model round %d received: that model is restored and the run ends after "
                "round %d", r.patience, trained_on, r.best_a, self.signal, r.best_round, t)
            return self.restore(f"{r.patience} rounds of {trained_on} did not beat it")
        if not last:
            return proposed
        out = read if read_output is None or proposed is None else read_output(proposed)
        final = out.value
        if out is not read:
            self.output_reading = final
        if r.last_verdict(t, final):
            log(WARNING, "PHASE-2 GUARD at the end of the run: the model round %d received "
                "reads %.4f on %s, above the last model's %.4f: that model is restored "
                "and delivered", r.best_round, r.best_a, self.signal, final)
            return self.restore("at the end of the run it read above the last model")
        own = read_output is not None and proposed is not None
        self.delivered = Delivered(t, final if own else None, (
            "the last model: " + ("it reads best" if final >= r.best_a else
                                  f"the signal ({self.signal}) does not tell the "
                                  "models it read apart")
            + ("" if own else f" (read through the model round {t} received)")))
        return proposed

    @property
    def trained_on(self) -> str:
        """What made the models the guard last judged, in words."""
        return "phase 2" if self.rule.fell_back is None else "cross-entropy after the fallback"

    def restore(self, why: str) -> Parameters | None:
        r = self.rule
        self.delivered = Delivered(r.best_round - 1, r.best_a,
                                   f"the best model read (round {r.best_round} received "
                                   f"it): {why}")
        return self.kept

    def summary_fields(self) -> dict[str, Any]:
        d = self.delivered
        return {"guard_signal": self.signal,
                "delivered_after_round": None if d is None else d.after_round,
                "delivered_reading": None if d is None else d.reading,
                "delivered_why": None if d is None else d.why,
                "guard_unclear_verdicts": self.rule.unclear or []}

    # -- checkpoint, records -----------------------------------------------------------
    def models(self) -> dict[str, list]:
        """The kept best for the checkpoint (``guard-best``), so a resumed run keeps it."""
        return {} if self.kept is None else {KEPT: parameters_to_ndarrays(self.kept)}

    def load_models(self, models: dict[str, list]) -> None:
        if self.rule.best_round is None:
            return
        if KEPT not in models:
            raise CheckpointError(
                f"the checkpoint's phase-2 guard kept the model of round "
                f"{self.rule.best_round} but the checkpoint holds no {KEPT!r} model; "
                "start a new run")
        self.kept = ndarrays_to_parameters(models[KEPT])

    def describe(self, record: dict[str, Any]) -> str:
        """The guard's part of a round's log line."""
        reading = record.get("guard_acc")
        if reading is None:
            return ""
        if record.get("guard_best_round") is None:  # before start-round: none kept yet
            return f" | guard reads {reading:.4f}"
        return (f" | guard reads {reading:.4f}  best {self.rule.best_a:.4f} (round "
                f"{record['guard_best_round']})  not beaten {record['guard_worse']}/"
                f"{self.rule.patience}")

    def notes(self, rounds: int) -> list[str]:
        """What the guard did, in plain words (the summary's notes and the last lines)."""
        r, out, trained_on = self.rule, [], self.trained_on
        if r.fell_back is not None:
            out.append(f"phase 2 did not beat the best model's reading ({self.signal}) in "
                       f"{r.patience} rounds of its own: the phase-2 guard restored the best "
                       f"model after round {r.fell_back} and training went on with "
                       "cross-entropy (guard-fallback = \"train\", docs/FEDEFC.md §3.7)")
        if r.unclear:
            out.append(f"{len(r.unclear)} verdict(s) of the phase-2 guard (rounds "
                       f"{', '.join(map(str, r.unclear))}) found that the signal "
                       f"({self.signal}) does not tell the models it read apart (its best "
                       f"leads its lowest by less than {MARGIN:g} standard error(s)): it did "
                       "not choose, and training went on (docs/FEDEFC.md §3.4)")
        if r.fired is not None and r.fired < rounds:
            out.append(f"{trained_on} did not beat the reading of the model round "
                       f"{r.best_round} received ({r.best_a:.4f}, {self.signal}) in "
                       f"{r.patience} rounds of its own: the phase-2 guard restored that "
                       f"model, and the run ended with it after round {r.fired} of {rounds} "
                       "(docs/FEDEFC.md §3.4)")
        elif r.fired is not None:
            out.append(f"at the end of the run the model round {r.best_round} received read "
                       f"{r.best_a:.4f} on {self.signal}, above the last model: the run "
                       "delivers that model (docs/FEDEFC.md §3.4)")
        return out


class BestRead(ModelGuard):
    """``deliver = "best-read"`` for a method without a guard (FedAvg, FedProx, FedDitto)
    with the coordinator's clean set (docs/FEDEFC.md §3.9): every round's new global
    model read on the set, the best kept, and at the end of the run the best replaces
    the last model where the set tells them apart, as FedEFC's guard decides its end.
    The model after round t is the one round t + 1 receives: the rule's rounds count so."""

    def __init__(self, signal: str):
        super().__init__(Phase2Guard(start_round=0, patience=1), signal)

    def choose(self, t: int, read: Reading, model: Parameters,
               last: bool) -> Parameters | None:
        """The round's new global model after the set read it (``read``)."""
        reading = read.value
        if self.rule.observe(t + 1, reading, phase_2_model=False, se=read.se,
                             correct=read.correct) == "best":
            self.kept = model
        if not last:
            return model
        if self.rule.last_verdict(t + 1, reading):
            return self.restore("at the end of the run it read above the last model")
        self.delivered = Delivered(t, reading, "the last model: " + (
            "it reads best" if reading >= self.rule.best_a else
            f"the signal ({self.signal}) does not tell the models it read apart"))
        return model
