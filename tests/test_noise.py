"""Noise synthesis (docs/FEDEFC.md §1.1) against cleanlab and exact expectations."""

import numpy as np
import pytest

from common.config import ConfigError
from common.methods import load_run_config
from common.noise import (
    NoiseError,
    apply_noise,
    empirical_transition,
    noise_matrix,
    zero_off_diagonals,
)

K = 10


def balanced_labels(per_class=6000):
    return np.repeat(np.arange(K), per_class)


def mnist_like_labels():
    """MNIST's train histogram (60,000 labels)."""
    counts = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    return np.repeat(np.arange(K), counts)


@pytest.mark.parametrize("rho,zeta", [(0.2, 0.8), (0.4, 0.8), (0.2, 0.4), (0.1, 0.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_realized_flip_fraction_within_half_percent_on_mnist_sized_labels(rho, zeta, seed):
    labels = balanced_labels()
    nm = noise_matrix(K, rho, zeta, np.full(K, 0.1), seed)
    noisy = apply_noise(labels, nm, seed)
    assert abs(np.mean(noisy != labels) - rho) <= 0.005


@pytest.mark.parametrize("seed", range(5))
def test_realized_flip_fraction_is_prior_weighted_off_diagonal_mass(seed):
    """With MNIST's real (unbalanced) prior the flip rate is sum_j p_j (1 - NM_jj), which
    is not rho exactly: cleanlab fixes the trace, not the prior-weighted diagonal."""
    labels = mnist_like_labels()
    prior = np.bincount(labels) / len(labels)
    nm = noise_matrix(K, 0.2, 0.8, prior, seed)
    noisy = apply_noise(labels, nm, seed)
    expected = float(prior @ (1 - np.diag(nm)))
    # cleanlab truncates each flip count to an integer: at most K*(K-1) labels lost.
    assert expected - K * (K - 1) / len(labels) <= np.mean(noisy != labels) <= expected + 1e-12


@pytest.mark.parametrize("zeta", [0.0, 0.4, 0.8, 0.88])
def test_zero_off_diagonals_match_zeta(zeta):
    nm = noise_matrix(K, 0.3, zeta, np.full(K, 0.1), 3)
    assert zero_off_diagonals(nm) == int(K * (K - 1) * zeta)
    np.testing.assert_allclose(nm.sum(axis=0), 1.0)
    assert np.trace(nm) == pytest.approx(K * 0.7)


def test_realized_noise_follows_the_matrix():
    labels = balanced_labels()
    nm = noise_matrix(K, 0.4, 0.4, np.full(K, 0.1), 5)
    realized = empirical_transition(apply_noise(labels, nm, 5), labels, K)
    assert np.abs(realized - nm).max() < 1e-3  # only integer truncation


def test_rho_zero_leaves_labels_untouched():
    labels = mnist_like_labels()
    nm = noise_matrix(K, 0.0, 0.8, np.full(K, 0.1), 0)
    np.testing.assert_array_equal(nm, np.eye(K))
    np.testing.assert_array_equal(apply_noise(labels, nm, 0), labels)


def test_noise_is_a_pure_function_of_the_seed():
    labels = balanced_labels(500)
    state = np.random.get_state()[1].copy()
    a = apply_noise(labels, noise_matrix(K, 0.2, 0.8, np.full(K, 0.1), 7), 7)
    b = apply_noise(labels, noise_matrix(K, 0.2, 0.8, np.full(K, 0.1), 7), 7)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.random.get_state()[1], state)  # global RNG untouched


def test_impossible_noise_is_a_clear_error():
    with pytest.raises(NoiseError, match="zeta=0.99"):
        noise_matrix(K, 0.5, 0.99, np.full(K, 0.1), 0)
    with pytest.raises(NoiseError, match="rho=0.95"):
        noise_matrix(K, 0.95, 0.0, np.full(K, 0.1), 0)
    with pytest.raises(ConfigError, match="zeta=1.*rho=0.2"):
        load_run_config({"rho": 0.2, "zeta": 1.0})
