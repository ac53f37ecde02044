"""The phase-2 guard: FedEFC's correction undone where it does not help (docs/FEDEFC.md §3.4).

Where the run keeps a validation share (the ``held-out`` signal), every client reports
A_k in phase 2 as in phase 1: the received global model's accuracy on its share, which
it never trains on. A(t) then measures, round after round, the model that phase 2 made.
The guard keeps the best of them: the round whose RECEIVED model scored the highest A(t)
(in phase 1 only after ``start-round``, as the prestopping rule). A round whose received
model phase 2 trained (round T_e + 2 on) and whose A(t) does not beat that best counts
against phase 2, one that beats it clears the count; when ``patience`` such rounds in a
row have not beaten it, phase 2 has not given a better model than the best one the run
already had: the guard restores that model and the run ends with it. With
``guard-fallback = "train"`` (verified labels only, docs/FEDEFC.md §3.7) the first such
verdict restores the best model and training goes on with cross-entropy; the guard then
judges those models the same way, and its next verdict ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Phase2Guard:
    """The best held-out A(t) so far, the round whose received model scored it, the
    phase-2 rounds in a row that did not beat it, and the round the guard fired in.

    :meth:`observe` takes A(t) of round t, a measure of the global model the round SENT
    (the model after round t - 1), and whether phase 2 trained that model. Plain code,
    checkpointable with ``asdict``.
    """

    start_round: int
    patience: int
    best_a: float = -1.0
    best_round: int | None = None
    worse: int = 0
    fired: int | None = None
    fallback: bool = False  # guard-fallback = "train": the first verdict trains on
    fell_back: int | None = None  # the round whose verdict went back to cross-entropy

    def observe(self, server_round: int, accuracy: float, phase_2_model: bool,
                rebase: bool = False) -> str:
        """Feed A(t); returns ``"best"`` (the round's received model is the new best:
        keep it), ``"fell back"`` (restore the best model and train on with
        cross-entropy), ``"fired"`` (restore the best model and end the run), or ``""``.
        ``phase_2_model``: a model trained after T_e (by phase 2, or after falling back);
        the restored model itself, measured again by the round after the fallback, is
        not counted. ``rebase``: A(t) is read on a new scale from this round on
        (``guard-score = "cross-fit"`` or ``validation-phase-2 = "guard-slice"`` at round
        T_e + 1), so the round's received model is the new best whatever the best of the
        old scale was."""
        if self.fired is not None or server_round <= self.start_round:
            return ""
        if rebase or accuracy > self.best_a:
            self.best_a, self.best_round, self.worse = float(accuracy), server_round, 0
            return "best"
        if not phase_2_model or server_round == (self.fell_back or -1) + 1:
            return ""
        self.worse += 1
        if self.worse < self.patience:
            return ""
        if self.fallback and self.fell_back is None:
            self.fell_back, self.worse = server_round, 0
            return "fell back"
        self.fired = server_round
        return "fired"
