"""The record of a client's sample roles (common/sample_roles.py; docs/FEDEFC.md §3.1,
§3.6-§3.8), checked against positions drawn by hand from the seeds the roles are named
by, and against the counts a node declares."""

import numpy as np
import pytest

from common.data_files import PrivateDataError
from common.methods import load_run_config
from common.sample_roles import SampleRoles, declared_sizes, held_out_count, training_size
from common.seeds import derive_seed

BASE = {"num-clients": 5, "fraction": 1.0, "accuracy-signal": "held-out",
        "twin-model": "off", "seed": 7}


def drawn(seed: int, name: str, pid: int, size: int) -> np.ndarray:
    return np.random.default_rng(derive_seed(seed, name, pid)).permutation(size)


def test_roles_are_the_seeded_draws_disjoint_and_covering_the_partition():
    """n = 50, 20 % held out (10), a 40 % share of the 40 trained on (16), verified
    labels and a 25 % estimation share of the 24 others (6), each drawn by hand."""
    cfg = load_run_config({**BASE, "evaluation": "federated", "local-test-fraction": 0.2,
                           "validation-labels": "verified", "estimation-share": 0.25})
    roles = SampleRoles.build(cfg, 3, 50, 10)
    perm = drawn(7, "local-test", 3, 50)
    np.testing.assert_array_equal(roles.held_out, np.sort(perm[:10]))
    np.testing.assert_array_equal(roles.train, np.sort(perm[10:]))
    assert sorted([*roles.train, *roles.held_out]) == list(range(50))  # a cover, disjoint
    np.testing.assert_array_equal(roles.share, np.sort(drawn(7, "validation", 3, 40)[:16]))
    rest = np.setdiff1d(np.arange(40), roles.share)
    np.testing.assert_array_equal(roles.estimation,
                                  np.sort(rest[drawn(7, "estimation", 3, 24)[:6]]))
    assert not np.isin(roles.estimation, roles.share).any()
    assert roles.declared == (40, 10) == declared_sizes(cfg, 50)
    assert roles.declared == (training_size(cfg, 50), held_out_count(cfg, 50))
    mask = roles.checked_mask()  # over the partition: the share's rows in it
    assert mask.sum() == 16 and set(np.flatnonzero(mask)) == set(roles.train[roles.share])


@pytest.mark.parametrize("phase_2", ["estimate", "train", "guard-slice"])
def test_what_each_phase_trains_on_and_counts_q_on(phase_2):
    cfg = load_run_config({**BASE, "validation-phase-2": phase_2})
    roles = SampleRoles.build(cfg, 1, 30, 10)
    share = np.sort(drawn(7, "validation", 1, 30)[:12])
    slice_ = share[::2]
    np.testing.assert_array_equal(roles.share, share)
    np.testing.assert_array_equal(roles.guard_slice, slice_)
    assert roles.held_out is None and roles.declared == (30, 0)
    assert roles.held_back(None) is None  # a method without phases trains on all
    np.testing.assert_array_equal(roles.held_back(1), share)
    np.testing.assert_array_equal(roles.trained_on(1), np.setdiff1d(np.arange(30), share))
    phase_2_out = {"estimate": share, "train": None, "guard-slice": slice_}[phase_2]
    read_on = slice_ if phase_2 == "guard-slice" else share
    np.testing.assert_array_equal(roles.guard(2), read_on)
    if phase_2_out is None:
        assert roles.held_back(2) is None
        np.testing.assert_array_equal(roles.counted(2), np.arange(30))
    else:
        np.testing.assert_array_equal(roles.held_back(2), phase_2_out)
        np.testing.assert_array_equal(roles.counted(2), phase_2_out)
    np.testing.assert_array_equal(
        roles.trained_on(2), np.setdiff1d(np.arange(30), [] if phase_2_out is None
                                          else phase_2_out))


def test_the_twin_keeps_only_the_guard_slice_out():
    cfg = load_run_config({**BASE, "twin-model": "on"})
    roles = SampleRoles.build(cfg, 2, 40, 10)
    assert roles.twin_slice
    twin = roles.twin()
    np.testing.assert_array_equal(twin.share, roles.share[::2])
    assert twin.estimation is None and twin.declared == roles.declared
    np.testing.assert_array_equal(twin.trained_on(2),
                                  np.setdiff1d(np.arange(40), roles.share[::2]))
    clean = load_run_config({**BASE, "twin-model": "on", "clean-validation-per-class": 2})
    assert SampleRoles.build(clean, 2, 40, 10).twin().share is None  # read on the server


def test_verified_labels_follow_a_nodes_mask_and_refuse_an_unusable_one():
    """With a node's ``verified`` mask (over its samples) the share is the marked
    samples of its training part; a simulated client without a mask keeps the seeded
    share; a node's own data without a usable mask is refused."""
    cfg = load_run_config({**BASE, "evaluation": "federated", "local-test-fraction": 0.2,
                           "validation-labels": "verified"})
    mask = np.zeros(50, dtype=bool)
    mask[::5] = True
    roles = SampleRoles.build(cfg, 0, 50, 10, mask, simulated=False, where="node")
    np.testing.assert_array_equal(roles.share, np.flatnonzero(mask[roles.train]))
    seeded = SampleRoles.build(cfg, 0, 50, 10)
    np.testing.assert_array_equal(seeded.share, np.sort(drawn(7, "validation", 0, 40)[:16]))
    for bad, problem in ((None, "names no verified sample"),
                         (np.ones(50, dtype=bool), "none is left to train on")):
        with pytest.raises(PrivateDataError, match=problem):
            SampleRoles.build(cfg, 0, 50, 10, bad, simulated=False, where="node")


def test_no_share_without_the_held_out_signal_or_below_two_samples():
    assert SampleRoles.build(load_run_config({**BASE, "accuracy-signal": "global"}),
                             0, 50, 10).share is None
    one = SampleRoles.build(load_run_config(BASE), 0, 1, 10)
    assert one.share is None and one.estimation is None and one.checked_mask() is None
    assert one.held_back(1) is None and list(one.counted(2)) == [0]
