"""The guard replays of tests/benchmarks/study_phase2_guard.py (docs/RESULTS.md, "A signal
observed labels cannot bend"), on a trajectory written by hand: the numbers each rule
delivers are worked out in the comments, not taken from the code."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

STUDY = Path(__file__).parent / "benchmarks" / "study_phase2_guard.py"


def study():
    spec = importlib.util.spec_from_file_location("study_phase2_guard", STUDY)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def trajectory(mod, veto):
    # the test accuracy of rounds 0..7 names the round's model: 0.1 * (round + 1)
    acc = [0.1 * (t + 1) for t in range(8)]
    guard = [None, 0.1, 0.2, 0.3, 0.5, 0.4, 0.4, 0.4]  # A(t) reads round t - 1's model
    return mod.Trajectory(acc, {"guard": guard, "plain": veto}, t_e=2, shares=[100])


def test_the_guard_keeps_the_best_a_t_and_restores_it_after_patience_rounds():
    mod = study()
    tr = trajectory(mod, [None] * 8)
    # best 0.5 at round 4 (the model of round 3); rounds 5 and 6 do not beat it: with a
    # patience of 2 round 6 restores round 3's model, held to the last round
    assert mod.replay_guard(tr, "guard", 1, 2, 0.0) == [*tr.acc[:6], tr.acc[3], tr.acc[3]]


def test_a_veto_bars_a_model_that_lowers_its_signal_below_phase_1s_last():
    mod = study()
    # the veto's reading of phase 1's last model (round T_e + 1 = 3) is 0.3; round 4's
    # 0.2 bars the model A(t) liked best; round 5's model (0.35) becomes the best; rounds 6
    # (no gain) and 7 (barred) count against phase 2: round 7 restores round 4's model
    tr = trajectory(mod, [None, 0.1, 0.2, 0.3, 0.2, 0.35, 0.36, 0.2])
    assert mod.replay_veto(tr, "plain", 1, 2, 0.0) == [*tr.acc[:7], tr.acc[4]]
    # a margin wider than every fall lets every model through: today's guard
    assert mod.replay_veto(tr, "plain", 1, 2, 0.2) == mod.replay_guard(tr, "guard", 1, 2, 0.0)
    # so does a veto with no reading of phase 1's last model (no client could read it)
    unread = trajectory(mod, [None, 0.1, 0.2, None, 0.2, 0.35, 0.36, 0.2])
    assert mod.replay_veto(unread, "plain", 1, 2, 0.0) == [*tr.acc[:6], tr.acc[3], tr.acc[3]]


def test_the_label_free_signals_count_agreements_on_the_share():
    mod = study()
    labels = np.array([0, 1, 2, 3])
    # round -> client -> (probe's predictions, labels, twin's predictions)
    seen = {1: {0: (np.array([0, 1, 2, 3]), labels, np.array([0, 1, 0, 0]))},
            2: {0: (np.array([0, 1, 2, 2]), labels, np.array([0, 1, 2, 2])),
                1: (np.array([1, 1, 1, 1]), labels, np.array([1, 1, 1, 0]))},
            3: {0: (np.array([0, 0, 2, 2]), labels, np.array([0, 0, 0, 0])),
                1: (np.array([1, 1, 0, 0]), labels, np.array([1, 1, 0, 0]))}}
    got = mod.label_free(seen, 1, 3)  # T_e = 1: round 2 received phase 1's last model
    assert got["twin-probe agreement"] == [None, 0.5, (1.0 + 0.75) / 2, (0.5 + 1.0) / 2]
    # from round T_e + 1 = 2 on, against round 2's predictions of the same client
    assert got["phase-1 agreement"] == [None, None, 1.0, (0.75 + 0.5) / 2]


def test_a_dominant_q_keeps_each_true_class_label_most_column_by_column():
    mod = study()
    # rows observed, columns true: each column's largest entry on the diagonal
    assert mod.dominant(np.array([[0.7, 0.1], [0.3, 0.9]]))
    # true class 0 is labelled 1 more often than 0: the plain accuracy prefers the noise
    assert not mod.dominant(np.array([[0.4, 0.0], [0.6, 1.0]]))
    # row 0 looks dominant (0.45 > 0.2) but column 0 is not (0.45 < 0.5): columns decide
    assert not mod.dominant(np.array([[0.45, 0.2, 0.0], [0.5, 0.8, 0.0], [0.05, 0.0, 1.0]]))
