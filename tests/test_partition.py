"""Bernoulli-Dirichlet and IID partitions (docs/FEDEFC.md §1.3)."""

import numpy as np
import pytest

from common.partition import PartitionError, bernoulli_dirichlet, iid

K, N = 10, 100
LABELS = np.repeat(np.arange(K), 6000)


def classes_per_client(parts, labels=LABELS):
    return np.array([len(np.unique(labels[p])) for p in parts])


@pytest.mark.parametrize("alpha,p", [(100, 0.8), (10, 0.5), (1, 0.2)])
def test_every_sample_assigned_exactly_once(alpha, p):
    parts = bernoulli_dirichlet(LABELS, N, K, p, alpha, seed=1)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(LABELS)
    np.testing.assert_array_equal(np.sort(allidx), np.arange(len(LABELS)))


@pytest.mark.parametrize("alpha,p", [(100, 0.8), (10, 0.5), (1, 0.2)])
def test_every_client_holds_a_class(alpha, p):
    parts = bernoulli_dirichlet(LABELS, N, K, p, alpha, seed=2)
    assert (classes_per_client(parts) >= 1).all()


def test_same_seed_same_partition_other_seed_other_partition():
    a = bernoulli_dirichlet(LABELS, N, K, 0.5, 10, seed=3)
    b = bernoulli_dirichlet(LABELS, N, K, 0.5, 10, seed=3)
    c = bernoulli_dirichlet(LABELS, N, K, 0.5, 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_p_controls_classes_per_client():
    means = [classes_per_client(bernoulli_dirichlet(LABELS, N, K, p, 10, seed=0)).mean()
             for p in (0.2, 0.5, 0.8)]
    assert means[0] < means[1] < means[2]
    assert means[1] == pytest.approx(K * 0.5, abs=1.0)


def test_alpha_controls_balance_of_a_class_across_holders():
    """Smaller alpha -> more uneven Dirichlet shares -> larger spread of client sizes."""
    def spread(alpha):
        parts = bernoulli_dirichlet(LABELS, N, K, 1.0, alpha, seed=0)
        sizes = np.array([len(p) for p in parts])
        return sizes.std() / sizes.mean()
    assert spread(1) > spread(10) > spread(100)


def held(parts, labels=LABELS):
    """Phi as the partition realized it: client k holds class j."""
    phi = np.zeros((len(parts), K), dtype=int)
    for k, part in enumerate(parts):
        phi[k, np.unique(labels[part])] = 1
    return phi


@pytest.mark.parametrize("clients,p", [(2, 0.5), (3, 0.5), (2, 0.05)])
def test_small_federations_hold_every_class(clients, p):
    """Few clients miss a class often (0.5**2 per class for 2 clients at p = 0.5): such a
    column of Phi is redrawn, so every class has a holder and every sample an owner."""
    missed = 0
    for seed in range(20):
        first = np.random.default_rng(seed).binomial(1, p, size=(clients, K))
        missed += int((first.sum(axis=0) == 0).any())
        parts = bernoulli_dirichlet(LABELS, clients, K, p, 10, seed=seed)
        phi = held(parts)
        assert (phi.sum(axis=0) >= 1).all() and (phi.sum(axis=1) >= 1).all()
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    assert missed > 0  # the redraw was exercised


def test_phi_without_empty_rows_or_columns_is_used_as_drawn():
    """Where the first Bernoulli draw needs no redraw, each client holds exactly the
    classes of that draw (the redraws consume no random numbers in that case)."""
    checked = 0
    for seed in range(10):
        first = np.random.default_rng(seed).binomial(1, 0.5, size=(N, K))
        if (first.sum(axis=0) == 0).any() or (first.sum(axis=1) == 0).any():
            continue
        np.testing.assert_array_equal(held(bernoulli_dirichlet(LABELS, N, K, 0.5, 10, seed)),
                                      first)
        checked += 1
    assert checked > 0


def test_iid_split_is_equal_and_complete():
    parts = iid(60_000, N, seed=0)
    assert {len(p) for p in parts} == {600}
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(60_000))
    with pytest.raises(PartitionError):
        iid(5, 10, seed=0)
