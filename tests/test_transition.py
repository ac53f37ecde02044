"""FedEFC's count matrix and Q (docs/FEDEFC.md §4) against cleanlab and hand computations."""

import numpy as np
import pytest
from cleanlab.count import calibrate_confident_joint, compute_confident_joint

from common.noise import apply_noise, empirical_transition, noise_matrix
from common.transition import (
    COUNT_RULES,
    class_thresholds,
    column_normalize,
    count_matrix,
    cross_fitted_accuracy,
    estimate_transition,
    label_prior_weighting,
    matrix_agreement,
    shrink_to_identity,
)


def random_probs(rng, n, k, temperature=1.0):
    logits = rng.normal(size=(n, k)) / temperature
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("seed", range(6))
def test_cleanlab_rule_equals_cleanlab_confident_joint(seed):
    rng = np.random.default_rng(seed)
    k = 10
    probs = random_probs(rng, 500, k, temperature=0.3 + 0.3 * seed)
    labels = rng.integers(0, k, 500)
    if seed % 2:  # some classes absent locally, as on non-IID clients
        labels = labels % 6
    expected = compute_confident_joint(labels, probs, calibrate=False)
    np.testing.assert_array_equal(count_matrix(probs, labels, "cleanlab"), expected)


# Hand-computed case: 3 classes, 5 samples.
PROBS = np.array([
    [0.70, 0.20, 0.10],  # label 0
    [0.50, 0.45, 0.05],  # label 0
    [0.10, 0.80, 0.10],  # label 1
    [0.40, 0.50, 0.10],  # label 1
    [0.30, 0.30, 0.40],  # label 2
])
LABELS = np.array([0, 0, 1, 1, 2])
# tau = (mean P[:,0] over label 0, mean P[:,1] over label 1, mean P[:,2] over label 2)
TAU = np.array([0.60, 0.65, 0.40])


def test_thresholds_are_class_means_and_absent_class_has_none():
    np.testing.assert_allclose(class_thresholds(PROBS, LABELS), TAU)
    tau = class_thresholds(PROBS[:4], LABELS[:4])
    assert np.isinf(tau[2])


def test_paper_rule_counts_every_column_that_meets_its_threshold():
    # confident sets: s0 {0}, s1 {} , s2 {1}, s3 {}, s4 {2}; plus s1: 0.45<0.65 no, 0.5<0.6 no.
    # P[s0,2]=0.10<0.4; P[s4,*]: 0.3<0.6, 0.3<0.65, 0.4>=0.4 -> {2}
    expected = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(count_matrix(PROBS, LABELS, "paper"), expected)


def test_rules_differ_on_a_sample_above_two_thresholds():
    # One sample labelled 0 that meets the thresholds of classes 1 and 2 but whose
    # argmax over all classes is class 0 (which it does not meet).
    probs = np.array([
        [0.90, 0.05, 0.05],  # label 0 -> tau_0 = mean(0.9, 0.46) = 0.68
        [0.46, 0.30, 0.24],  # label 0: P0 .46 < .68; P1 .30 >= .25; P2 .24 >= .2
        [0.10, 0.20, 0.70],  # label 1 -> tau_1 = mean(.20, .30) = .25
        [0.20, 0.30, 0.50],  # label 1
        [0.30, 0.50, 0.20],  # label 2 -> tau_2 = .20
    ])
    labels = np.array([0, 0, 1, 1, 2])
    # sample 1 meets {1, 2}: cleanlab -> argmax over all = 0; masked -> argmax of {1, 2} = 1;
    # paper -> both 1 and 2.
    # Other samples: s0 meets {0}; s2 meets {2} (.2<.25; .7>=.2); s3 meets {1,2}: cleanlab
    # argmax all=2, masked argmax{1,2}=2, paper both; s4 meets {1, 2}: .5>=.25,.2>=.2 ->
    # cleanlab argmax all = 1, masked = 1, paper both.
    cl = count_matrix(probs, labels, "cleanlab")
    ma = count_matrix(probs, labels, "masked")
    pa = count_matrix(probs, labels, "paper")
    np.testing.assert_array_equal(cl, [[2, 0, 0], [0, 1, 2], [0, 1, 1]])
    np.testing.assert_array_equal(ma, [[1, 1, 0], [0, 1, 2], [0, 1, 1]])
    np.testing.assert_array_equal(pa, [[1, 1, 1], [0, 1, 2], [0, 1, 1]])


def test_the_issues_example_counts_into_an_absent_class_under_cleanlab_only():
    """Four samples with probabilities [0.3, 0.3, 0.4], labels [0, 0, 1, 1]: thresholds
    tau = (0.3, 0.3, inf); every sample meets classes 0 and 1, and its argmax over all
    classes is 2, a class nobody here holds. cleanlab counts all four in column 2
    (whose column becomes [.4, .4, .2] after the diagonal is raised to 1); the present
    rule counts each at its argmax over classes 0 and 1 (the first: 0)."""
    probs = np.tile([0.3, 0.3, 0.4], (4, 1))
    labels = np.array([0, 0, 1, 1])
    q = estimate_transition(probs, labels, "cleanlab")
    np.testing.assert_allclose(q[:, 2], [0.4, 0.4, 0.2])
    counts = count_matrix(probs, labels, "cleanlab-present")
    np.testing.assert_array_equal(counts, [[2, 0, 0], [2, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(estimate_transition(probs, labels, "cleanlab-present")[:, 2],
                                  [0, 0, 1])
    # under label-prior weighting cleanlab's column 2 even loses its diagonal: Q[2][2] = 0
    assert estimate_transition(probs, labels, "cleanlab", "label-prior")[2, 2] == 0


def test_cleanlab_present_equals_cleanlab_when_every_class_is_held():
    rng = np.random.default_rng(3)
    probs = random_probs(rng, 400, 6)
    labels = rng.integers(0, 6, 400)
    np.testing.assert_array_equal(count_matrix(probs, labels, "cleanlab-present"),
                                  count_matrix(probs, labels, "cleanlab"))


def test_columns_sum_to_one_and_absent_class_is_unit_column():
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 300, 5)
    labels = rng.integers(0, 4, 300)  # class 4 never observed
    for rule in COUNT_RULES:
        for weighting in ("none", "label-prior"):
            q = estimate_transition(probs, labels, rule, weighting)
            np.testing.assert_allclose(q.sum(axis=0), 1.0)
            if rule != "cleanlab":
                np.testing.assert_array_equal(q[:, 4], np.eye(5)[4])


def test_cleanlab_rule_can_count_an_absent_class_through_the_overall_argmax():
    """cleanlab's confident joint sends a sample above two thresholds to its argmax over
    ALL classes, which may be a class nobody holds locally: that column is then not e_4
    (e_j holds for 'masked' and 'paper' only: docs/FEDEFC.md §4.2)."""
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 300, 5)
    labels = rng.integers(0, 4, 300)
    tau = class_thresholds(probs, labels)
    several = (probs >= tau - 1e-6).sum(1) > 1
    to_absent = several & (probs.argmax(1) == 4)
    assert to_absent.any()
    counts = count_matrix(probs, labels, "cleanlab")
    np.testing.assert_array_equal(counts[:, 4] - np.eye(5, dtype=int)[4] * (counts[4, 4] == 1),
                                  np.bincount(labels[to_absent], minlength=5))


def test_column_normalize_hand_case():
    c = np.array([[3, 1], [1, 4]])
    np.testing.assert_allclose(column_normalize(c), [[0.75, 0.2], [0.25, 0.8]])
    np.testing.assert_allclose(column_normalize(np.zeros((2, 2))), np.eye(2))


def test_label_prior_weighting_hand_case():
    # rows rescaled to the local label fractions: p~ = (3/4, 1/4)
    c = np.array([[2, 2], [1, 3]])
    labels = np.array([0, 0, 0, 1])
    w = label_prior_weighting(c, labels)
    np.testing.assert_allclose(w, [[0.375, 0.375], [0.0625, 0.1875]])
    np.testing.assert_allclose(column_normalize(w), [[0.375 / 0.4375, 0.375 / 0.5625],
                                                     [0.0625 / 0.4375, 0.1875 / 0.5625]])


def test_label_prior_weighting_matches_cleanlab_calibration_up_to_rounding():
    rng = np.random.default_rng(1)
    probs = random_probs(rng, 4000, 6, 0.5)
    labels = rng.integers(0, 6, 4000)
    cj = compute_confident_joint(labels, probs, calibrate=False)
    ours = column_normalize(label_prior_weighting(cj, labels))
    theirs = column_normalize(calibrate_confident_joint(cj, labels))
    assert np.abs(ours - theirs).max() < 2e-3


@pytest.mark.parametrize("rule", COUNT_RULES)
def test_oracle_predictor_recovers_the_noise_matrix(rule):
    k = 10
    true = np.repeat(np.arange(k), 1000)
    nm = noise_matrix(k, 0.3, 0.6, np.full(k, 0.1), 11)
    noisy = apply_noise(true, nm, 11)
    probs = np.full((len(true), k), 0.1 / (k - 1))
    probs[np.arange(len(true)), true] = 0.9  # an oracle that knows the true label
    q = estimate_transition(probs, noisy, rule)
    assert np.abs(q - nm).max() < 0.05
    assert np.abs(q - empirical_transition(noisy, true, k)).max() < 1e-2


# -- the shrunk estimator (docs/FEDEFC.md §4.8) ---------------------------------------------


def test_a_column_without_evidence_is_the_identitys_and_one_with_overwhelming_evidence_counts():
    """Column 0 rests on no sample (only the raised diagonal), column 1 on two million,
    column 2 is already e_2: the shrunk Q keeps e_0, the counted column 1 to 1e-6, e_2."""
    counts = np.array([[1, 600_000, 0],
                       [0, 1_400_000, 0],
                       [0, 0, 7]])
    q = shrink_to_identity(column_normalize(counts), counts.sum(axis=0))
    np.testing.assert_allclose(q[:, 0], [1, 0, 0])
    np.testing.assert_allclose(q[:, 1], [0.3, 0.7, 0], atol=1e-6)
    assert not np.allclose(q[:, 1], [0, 1, 0])
    np.testing.assert_allclose(q[:, 2], [0, 0, 1])
    np.testing.assert_allclose(q.sum(axis=0), 1.0)


def test_the_shrinkage_of_a_hand_counted_column():
    """Counts (8, 2, 0) in column 0: q = (0.8, 0.2, 0), lambda = (1 - 0.68) / (9 * 0.08)
    = 4/9, so Q*[:, 0] = 4/9 e_0 + 5/9 q = (8/9, 1/9, 0); column 1 (1, 3, 0): q = (1/4,
    3/4, 0), lambda = (1 - 10/16) / (3 * 2/16) = 1, the identity's column."""
    counts = np.array([[8, 1, 0], [2, 3, 0], [0, 0, 5]])
    q = shrink_to_identity(column_normalize(counts), counts.sum(axis=0))
    np.testing.assert_allclose(q[:, 0], [8 / 9, 1 / 9, 0])
    np.testing.assert_allclose(q[:, 1], [0, 1, 0])
    np.testing.assert_allclose(q[:, 2], [0, 0, 1])


# -- the cross-fitted guard score (docs/FEDEFC.md §3.4) -------------------------------------


def test_the_cross_fitted_score_of_a_hand_counted_case():
    """Four samples, every one predicted (0.9, 0.1), labels (1, 1, 1, 0); no shrinkage.
    Even positions {0, 2} are read through Q counted on odd {1, 3}: tau = (0.9, 0.1),
    both samples meet both thresholds, so each counts at its argmax 0: C = [[1, 0],
    [1, 0]], diagonal raised: [[1, 0], [1, 1]], Q = [[1/2, 0], [1/2, 1]]; Q p = (0.45,
    0.55) predicts 1: both even samples (labels 1, 1) right. Odd {1, 3} through Q counted
    on even {0, 2} (labels 1, 1): tau_0 = inf, each sample counts in column 1: C =
    [[0, 0], [0, 2]], raised: [[1, 0], [0, 2]], Q = I: predicts 0, right for sample 3
    (label 0) only. 3 of 4, where the plain accuracy is 1 of 4."""
    probs = np.tile([0.9, 0.1], (4, 1))
    labels = np.array([1, 1, 1, 0])
    assert cross_fitted_accuracy(probs, labels, shrunk=False) == 0.75
    assert np.mean(probs.argmax(1) == labels) == 0.25
    assert cross_fitted_accuracy(probs[:1], labels[:1]) == 0.0  # one sample: plain


def test_the_cross_fitted_score_reads_a_model_of_the_true_labels_through_the_noise():
    """Labels that a class-conditional noise moved (class j observed as j + 1 at rates
    0.8, 0.3, 0.7, 0.2, 0.3: the noise sends most of classes 0 and 2 elsewhere): a model
    that predicts the true class is read through the noise, so it scores the best any
    prediction of the observed labels can (the largest entry of each column of the
    noise: about 0.74), far above its plain accuracy against the observed labels (about
    0.54), which prefers a model of the noise; one whose predictions are noise itself
    (random) scores about the most frequent label's share."""
    rng = np.random.default_rng(0)
    k, n = 5, 4000
    true = rng.integers(0, k, n)
    flip = rng.random(n) < np.array([0.8, 0.3, 0.7, 0.2, 0.3])[true]
    labels = np.where(flip, (true + 1) % k, true)
    knows = np.full((n, k), 0.02)
    knows[np.arange(n), true] = 0.92
    best = np.mean([max(np.mean(labels[true == j] == i) for i in range(k)) for j in range(k)])
    score = cross_fitted_accuracy(knows, labels)
    assert score == pytest.approx(best, abs=0.02) and score > 0.7
    assert np.mean(knows.argmax(1) == labels) < score - 0.15
    guess = random_probs(rng, n, k)
    assert cross_fitted_accuracy(guess, labels) < 0.3


def test_matrix_agreement():
    a = np.eye(3)
    assert matrix_agreement(a, a) == (pytest.approx(1.0), 0.0)
    b = np.full((3, 3), 1 / 3)
    cos, l1 = matrix_agreement(a, b)
    assert cos == pytest.approx(1 / np.sqrt(3))
    assert l1 == pytest.approx(3 * (2 / 3) + 6 * (1 / 3))
