"""The prestopping rule (paper Algorithm 1, docs/FEDEFC.md §3.3) on known sequences."""

import pytest

from fedefc_server.prestopping import Prestopper, prestopping_point


@pytest.mark.parametrize("accs,start,gamma,expected", [
    # rises, then three rounds without improvement -> T_e is the third of them (round 6)
    ([0.1, 0.2, 0.3, 0.25, 0.28, 0.29, 0.5], 0, 3, 6),
    # ties do not improve: 0.3 repeated counts as patience
    ([0.1, 0.3, 0.3, 0.3], 0, 2, 4),
    # rounds up to start_round are ignored even if they are the best
    ([0.9, 0.1, 0.2, 0.15, 0.18], 1, 2, 5),
    ([0.9, 0.1, 0.2, 0.15, 0.18], 0, 2, 3),
    # an improvement resets patience
    ([0.5, 0.4, 0.6, 0.5, 0.55, 0.56], 0, 3, 6),
    # never triggers: strictly increasing
    ([0.1, 0.2, 0.3, 0.4, 0.5], 0, 1, None),
    # never triggers: patience never reaches gamma
    ([0.5, 0.4, 0.6, 0.5, 0.7], 0, 2, None),
    # gamma 1 with start 0: first non-improvement
    ([0.2, 0.4, 0.39], 0, 1, 3),
])
def test_known_sequences(accs, start, gamma, expected):
    assert prestopping_point(accs, start, gamma) == expected


def test_switch_is_final_and_phase_follows_t_e():
    p = Prestopper(start_round=0, gamma_thr=1)
    assert p.observe(1, 0.5) is False
    assert p.observe(2, 0.4) is True
    assert p.t_e == 2
    assert [p.phase(r) for r in (1, 2, 3, 10)] == [1, 1, 2, 2]
    assert p.observe(3, 0.9) is False  # later improvements change nothing
    assert p.t_e == 2 and p.a_max == 0.5


def test_disabled_never_triggers():
    p = Prestopper(start_round=0, gamma_thr=1, enabled=False)
    for r, a in enumerate([0.5, 0.1, 0.1, 0.1], start=1):
        assert p.observe(r, a) is False
    assert p.t_e is None and p.phase(100) == 1
