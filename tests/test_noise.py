"""Noise synthesis (docs/FEDEFC.md §1.1) against cleanlab and exact expectations."""

import numpy as np
import pytest
from cleanlab.benchmarking.noise_generation import (
    generate_noise_matrix_from_trace,
    generate_noisy_labels,
)

from common.config import ConfigError
from common.data_plan import build_data_plan
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


def test_the_reference_draw_is_cleanlabs_one_stream_seeded_42(embedded):
    """noise-draw=reference reproduces the reference code's labelling: cleanlab's matrix
    with seed=42 and the flips of the whole training set (in its order) from the same
    global NumPy stream, whatever the run's seed; the partition still follows the seed."""

    true = embedded.train_y.numpy()
    prior = np.bincount(true, minlength=K) / len(true)
    nm = generate_noise_matrix_from_trace(K, K * (1 - 0.4), py=prior,
                                          frac_zero_noise_rates=0.8, valid_noise_matrix=True,
                                          seed=42)
    expected = generate_noisy_labels(true, nm)  # continues the stream seed=42 started
    feds = [build_data_plan(embedded, load_run_config(
        {"rho": 0.4, "zeta": 0.8, "noise-draw": "reference", "seed": seed})) for seed in (0, 3)]
    for fed in feds:
        np.testing.assert_array_equal(fed.noise_matrices[0], nm)
        np.testing.assert_array_equal(fed.noisy_labels, expected)
    assert not all(np.array_equal(a, b) for a, b in zip(*(f.client_indices for f in feds)))
    other = build_data_plan(embedded, load_run_config(
        {"rho": 0.4, "zeta": 0.8, "noise-draw": "reference", "noise-seed": 7}))
    assert not np.array_equal(other.noisy_labels, expected)


def test_noise_seed_pins_the_noise_and_defaults_to_the_seed(embedded):
    def fed(**keys):
        return build_data_plan(embedded, load_run_config({"rho": 0.2, "zeta": 0.8,
                                                               "iid": True, **keys}))

    today = fed(seed=1)
    assert np.array_equal(fed(seed=1, **{"noise-seed": 1}).noisy_labels, today.noisy_labels)
    pinned = [fed(seed=s, **{"noise-seed": 5}) for s in (1, 2)]
    # same noise matrix and flips per sample, other partitions
    np.testing.assert_array_equal(pinned[0].noise_matrices[0], pinned[1].noise_matrices[0])
    np.testing.assert_array_equal(pinned[0].noisy_labels, pinned[1].noisy_labels)
    assert not np.array_equal(pinned[0].noisy_labels, today.noisy_labels)
    assert not all(np.array_equal(a, b) for a, b in zip(pinned[0].client_indices,
                                                         pinned[1].client_indices))


def test_the_reference_draw_takes_one_noise_group():
    with pytest.raises(ConfigError, match="noise-draw='reference'.*noise-groups"):
        load_run_config({"noise-draw": "reference", "noise-groups": "0.2:0.4;0.4:0.8"})
