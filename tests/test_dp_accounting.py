"""The (epsilon, delta) of the clients' Gaussian noise (common/dp_accounting.py), checked
against closed forms: the Gaussian mechanism's Renyi DP a / (2 z^2) per round with the
conversion of Balle et al. 2020 (Thm. 21), the exact privacy curve of the Gaussian
mechanism (Balle & Wang 2018, Thm. 8), and the subsampled Gaussian's RDP at integer
orders (Mironov, Talwar & Zhang 2019, §3.3)."""

import math

import numpy as np
import pytest
from opacus.accountants.analysis import rdp
from scipy.special import comb, logsumexp
from scipy.stats import norm

from common.dp_accounting import ORDERS, epsilon, run_guarantee
from common.methods import load_run_config


def rdp_epsilon_closed_form(z: float, rounds: int, delta: float) -> float:
    """min over the orders a of  T a / (2 z^2) + log((a-1)/a) - (log delta + log a)/(a-1)."""
    return min(rounds * a / (2 * z**2) + math.log((a - 1) / a)
               - (math.log(delta) + math.log(a)) / (a - 1) for a in ORDERS)


def exact_gaussian_delta(eps: float, z: float, rounds: int) -> float:
    """The Gaussian mechanism's exact delta(eps); T rounds of multiplier z are one of
    multiplier z / sqrt(T)."""
    s = z / math.sqrt(rounds)
    return norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s)


@pytest.mark.parametrize("z, rounds, delta", [(1.0, 1, 1e-5), (1.1, 40, 1e-5),
                                              (5.0, 100, 1e-6), (0.5, 10, 1e-3)])
def test_full_participation_is_the_gaussian_mechanisms_rdp(z, rounds, delta):
    eps = epsilon(z, rounds, delta)
    assert eps == pytest.approx(rdp_epsilon_closed_form(z, rounds, delta), rel=1e-9)
    # a valid guarantee: the exact curve at that epsilon is below delta ...
    assert exact_gaussian_delta(eps, z, rounds) <= delta
    # ... and not a loose one: the exact epsilon at delta is less than 40 % below it
    lo, hi = 0.0, eps
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_gaussian_delta(mid, z, rounds) > delta else (lo, mid)
    assert 0.6 * eps < hi <= eps


def subsampled_rdp(q: float, z: float, a: int) -> float:
    """RDP at integer order a of the Poisson-subsampled Gaussian mechanism:
    log(sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 z^2))) / (a - 1)."""
    logs = [math.log(comb(a, k, exact=True)) + (a - k) * math.log(1 - q) + k * math.log(q)
            + (k * k - k) / (2 * z**2) for k in range(a + 1)]
    return float(logsumexp(logs)) / (a - 1)


def test_subsampling_matches_the_closed_form_at_integer_orders():
    q, z, rounds = 0.1, 1.2, 50
    orders = [a for a in ORDERS if float(a).is_integer()]
    got = rdp.compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=orders)
    want = [rounds * subsampled_rdp(q, z, int(a)) for a in orders]
    np.testing.assert_allclose(got, want, rtol=1e-7)
    # and epsilon() minimises the conversion over these orders (and fractional ones)
    eps = epsilon(z, rounds, 1e-5, q)
    by_integers = min(r + math.log((a - 1) / a) - (math.log(1e-5) + math.log(a)) / (a - 1)
                      for r, a in zip(want, orders))
    assert eps <= by_integers + 1e-9 and eps > 0.8 * by_integers


def test_epsilon_moves_the_right_way_and_has_its_limits():
    base = epsilon(1.0, 20, 1e-5)
    assert epsilon(2.0, 20, 1e-5) < base < epsilon(1.0, 40, 1e-5)
    assert epsilon(1.0, 20, 1e-5, 0.5) < base
    assert epsilon(1.0, 20, 1e-3) < base
    assert epsilon(0.0, 20, 1e-5) == math.inf and epsilon(1.0, 0, 1e-5) == 0.0
    for bad in ({"delta": 0.0}, {"delta": 1.0}, {"sampling_rate": 0.0},
                {"sampling_rate": 1.5}):
        with pytest.raises(ValueError):
            epsilon(1.0, 20, **{"delta": 1e-5, **bad})


def test_a_runs_guarantee_composes_every_round_and_reports_the_amplified_one_aside():
    cfg = load_run_config({"dp-clip": 1.0, "dp-noise-multiplier": 1.5, "rounds": 30,
                           "num-clients": 20, "fraction": 0.25, "dp-delta": 1e-6})
    g = run_guarantee(cfg)
    assert g.epsilon == pytest.approx(rdp_epsilon_closed_form(1.5, 30, 1e-6), rel=1e-9)
    assert (g.delta, g.rounds, g.noise_multiplier, g.sampling_rate) == (1e-6, 30, 1.5, 0.25)
    assert g.epsilon_secret_sampling == epsilon(1.5, 30, 1e-6, 0.25) < g.epsilon
    assert "epsilon=" in g.describe() and g.as_record()["epsilon"] == g.epsilon
    assert run_guarantee(load_run_config({"dp-clip": 1.0})) is None  # clipping, no noise
