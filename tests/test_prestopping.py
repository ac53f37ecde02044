"""The prestopping rule (paper Algorithm 1, docs/FEDEFC.md §3.3) on known sequences."""

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status

from common.config import ConfigError
from common.methods import load_run_config
from common.models import ClassifierShape
from common.sample_roles import validation_count
from fedefc_server.method_server import Aggregated
from fedefc_server.prestopping import (
    Prestopper,
    accuracy_standard_error,
    min_gain_z,
    prestopping_point,
)
from fedefc_server.prestopping_server import PrestoppingServer


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


def test_a_rise_smaller_than_the_minimum_gain_is_no_rise():
    """``prestopping-min-gain``: A(t) creeping up by 0.001 a round (full MNIST, non-IID,
    heavy noise: docs/RESULTS.md) never lets the strict rule fire; with a minimum gain of
    0.0035 a rise counts only once A(t) has climbed past A_max + 0.0035 (A_max: the last
    rise that counted), so by hand: 0.600 counts (round 2), 0.601 and 0.602 do not, and
    0.603 is the third round without a rise: T_e = 5. With 0.0025 the 0.003 that A(t)
    climbs every third round counts each time, and T_e never comes."""
    creep = [0.5 + 0.1 * (t > 1) + 0.001 * max(t - 2, 0) for t in range(1, 12)]
    assert prestopping_point(creep, 0, 3) is None
    p = Prestopper(start_round=0, gamma_thr=3)
    fired = [t for t, a in enumerate(creep, start=1) if p.observe(t, a, min_gain=0.0035)]
    assert fired == [5] and p.a_max == pytest.approx(0.6)
    p = Prestopper(start_round=0, gamma_thr=3)
    fired = [t for t, a in enumerate(creep, start=1) if p.observe(t, a, min_gain=0.0025)]
    assert fired == []  # every third round has climbed 0.003 > 0.0025: a real rise
    # a rise by more than the gain resets the count, as before
    p = Prestopper(start_round=0, gamma_thr=2)
    assert [p.observe(t, a, 0.01) for t, a in enumerate([0.5, 0.505, 0.52, 0.525, 0.526], 1)] \
        == [False, False, False, False, True]


def test_the_standard_error_of_a_t_is_the_spread_of_the_mean_of_binomial_accuracies():
    """Against the spread of A(t) itself: 20,000 draws of K = 4 clients' accuracies on
    shares of 50, 120, 400 and 4,000 samples, each right with probability 0.7."""
    shares = [50, 120, 400, 4000]
    rng = np.random.default_rng(0)
    draws = rng.binomial(shares, 0.7, size=(20_000, len(shares))) / np.array(shares)
    assert accuracy_standard_error(0.7, shares) == pytest.approx(draws.mean(1).std(), rel=0.03)
    assert accuracy_standard_error(0.7, []) == 0.0


def test_the_server_counts_the_gain_in_standard_errors_of_the_replying_clients_shares():
    """The server knows each client's share from its sample count (the client draws it
    with the same validation_count); z = 0 is the paper's rule (on shares large enough
    for ``auto`` to ask for a gain)."""
    cfg = load_run_config({"num-clients": 3, "fraction": 1.0, "prestopping-min-gain": 1.5})
    server = PrestoppingServer(cfg, ClassifierShape(10, None))
    replies = [(k, FitRes(Status(Code.OK, ""), Parameters([], ""), m, {}))
               for k, m in enumerate((500, 1200, 12000))]
    result = Aggregated(6, replies, None, {}, False)
    shares = [200, 480, 4800]  # 40 % of each
    expected = 1.5 * np.sqrt(0.6 * 0.4 * sum(1 / n for n in shares)) / 3
    assert server.min_gain(0.6, result) == pytest.approx(expected, rel=1e-12)
    paper = PrestoppingServer(load_run_config({"num-clients": 3, "fraction": 1.0,
                                               "prestopping-min-gain": 0}),
                              ClassifierShape(10, None))
    assert paper.min_gain(0.6, _replies(*(12000,) * 3)) == 0.0


def _replies(*sizes):
    return Aggregated(6, [(k, FitRes(Status(Code.OK, ""), Parameters([], ""), m, {}))
                          for k, m in enumerate(sizes)], None, {}, False)


@pytest.mark.parametrize("sizes,z", [
    # full MNIST over 5 sites: shares of 4,800; worst-case SE sqrt(0.25 * 5/4800) / 5 = 0.32 pt
    ((12000,) * 5, 1.0),
    # exactly 10,000 held-out samples in equal shares: worst-case SE 0.5 / 100 = 0.005, the bound
    ((5000,) * 5, 1.0),
    # one site fewer than that: SE 0.5 / sqrt(4 * 2000) = 0.56 pt > 0.5
    ((5000,) * 4, 0.0),
    # the embedded data over 5 sites: shares of 320; SE 1.25 pt
    ((800,) * 5, 0.0),
    # one small site among large ones weighs in through sum 1/n_k: 0.5 * sqrt(4/4800 + 1/40) / 5
    ((12000,) * 4 + (100,), 0.0),
])
def test_auto_asks_for_one_standard_error_only_where_the_shares_are_large(sizes, z):
    """``prestopping-min-gain = "auto"`` (the default): one standard error where the
    worst-case standard error of A(t) (at A = 0.5) is at most half a point, which equal
    shares reach at 10,000 samples together; 0, the paper's rule, below (measured:
    docs/RESULTS.md, "A minimum gain for the prestopping rule"). Hand-computed bounds."""
    shares = [validation_count(0.4, 0, m) for m in sizes]
    assert min_gain_z("auto", shares) == z
    assert min_gain_z(0.7, shares) == 0.7 and min_gain_z(0.0, shares) == 0.0
    cfg = load_run_config({"num-clients": len(sizes), "fraction": 1.0})
    assert cfg.prestopping_min_gain == "auto"
    server = PrestoppingServer(cfg, ClassifierShape(10, None))
    expected = z * np.sqrt(0.6 * 0.4 * sum(1 / n for n in shares)) / len(shares)
    assert server.min_gain(0.6, _replies(*sizes)) == pytest.approx(expected, rel=1e-12)
    assert server.summary_fields()["prestopping_min_gain_used"] == z


def test_auto_is_the_papers_rule_where_no_share_is_kept():
    """Where a round samples part of the clients the paper's signal keeps no share, and
    ``auto`` keeps the paper's rule however large the clients are."""
    cfg = load_run_config({"num-clients": 10, "fraction": 0.5})
    assert cfg.prestopping_min_gain == "auto" and cfg.min_gain_setting == 0.0
    server = PrestoppingServer(cfg, ClassifierShape(10, None))
    assert server.min_gain(0.6, _replies(*(12000,) * 5)) == 0.0


@pytest.mark.parametrize("value", ["x", -1, 11])
def test_a_minimum_gain_that_is_not_auto_or_0_to_10_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="prestopping-min-gain.*auto.*standard errors from 0"):
        load_run_config({"prestopping-min-gain": value})


def test_a_minimum_gain_without_a_share_is_refused():
    with pytest.raises(ConfigError, match="only the held-out signal keeps"):
        load_run_config({"prestopping-min-gain": 1.0})
