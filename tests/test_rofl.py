"""RoFL: centroid updates, sample selection and label replacement, and a real 3-round run."""

import json
import math

import numpy as np
import pytest
import torch

from common.baselines.rofl import (
    aggregate_centroids,
    centroid_weight,
    forget_rate,
    uses_pseudo_labels,
)
from common.exchange import pack_array, unpack_array
from common.models import ClassifierShape, TaskShape, build_model, classifier_shape
from common.params import get_weights
from fedefc_client.baselines.rofl import (
    class_means,
    nearest_centroid,
    rofl_loss,
    rofl_targets,
    small_loss_indices,
    update_centroids,
)
from tests.helpers import (
    GLOBAL,
    PARAMS,
    FakeNode,
    make_driver,
    manager,
    simulate,
    trained_reply,
)


def test_schedules_follow_the_reference_shifted_to_one_based_rounds():
    assert forget_rate(1, 0.2, 10) == 0.0 and forget_rate(10, 0.2, 10) == pytest.approx(0.2)
    assert forget_rate(5, 0.2, 10) == pytest.approx(0.2 * 4 / 9)
    assert forget_rate(60, 0.2, 10) == 0.2
    assert centroid_weight(1, 1.0, 100) == pytest.approx(0.01)
    assert centroid_weight(150, 1.0, 100) == 1.0
    assert not uses_pseudo_labels(100, 100) and uses_pseudo_labels(101, 100)


def test_small_loss_selection_keeps_the_lowest_losses():
    losses = torch.tensor([0.5, 0.1, 2.0, 0.3, 1.0])
    assert small_loss_indices(losses, 0.4).tolist() == [1, 3, 0]  # int(0.6 * 5) = 3
    assert small_loss_indices(losses, 0.0).tolist() == [1, 3, 0, 4, 2]
    assert small_loss_indices(losses[:1], 0.9).tolist() == [0]  # never an empty batch


def test_label_replacement_mask_on_a_constructed_batch():
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    features = torch.tensor([[2.0, 0.1], [0.1, 3.0], [-1.0, -0.2], [5.0, 4.0]])
    labels = torch.tensor([0, 0, 2, 1])
    pseudo = torch.tensor([1, 1, 0, 2])
    nearest = nearest_centroid(features, centroids)
    assert nearest.tolist() == [0, 1, 2, 0]
    agree = nearest == labels
    assert agree.tolist() == [True, False, True, False]
    # From T_pl on, a disagreeing label is replaced by the pseudo-label; before, kept.
    assert rofl_targets(labels, agree, pseudo, True).tolist() == [0, 1, 2, 2]
    assert rofl_targets(labels, agree, pseudo, False).tolist() == [0, 0, 2, 1]


def test_local_centroid_update_by_hand():
    f_k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    features = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    labels = torch.tensor([0, 0, 2])
    means, present = class_means(features, labels, 3)
    np.testing.assert_allclose(means.numpy(), [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    assert present.tolist() == [True, False, True]
    # class 0: s = cos((1,0),(1,1)) = 1/sqrt(2), s^2 = 1/2 -> (1, 0.5); class 1 absent:
    # unchanged; class 2: s = 1 -> the batch mean (2, 2).
    new = update_centroids(f_k, means, present)
    np.testing.assert_allclose(new.numpy(), [[1.0, 0.5], [0.0, 1.0], [2.0, 2.0]], rtol=1e-6)


def test_server_centroid_aggregation_by_hand():
    f_g = np.array([[1.0, 0.0], [0.0, 1.0]])
    f_1 = np.array([[2.0, 0.0], [0.0, 0.0]])  # holds no class 1
    f_2 = np.array([[1.0, 1.0], [0.0, 3.0]])
    s = 1 / math.sqrt(2)  # cos(f_G[0], f_2[0])
    new = aggregate_centroids(f_g, [f_1, f_2])
    np.testing.assert_allclose(new[0], (np.array([2.0, 0.0]) + s * np.array([1.0, 1.0])) / (1 + s))
    np.testing.assert_allclose(new[1], [0.0, 3.0])
    # Round 1 (no f_G yet): plain mean over the clients that hold the class.
    np.testing.assert_allclose(aggregate_centroids(None, [f_1, f_2]), [[1.5, 0.5], [0.0, 3.0]])
    # Cosine weights that do not sum to a positive number keep the old centroid.
    np.testing.assert_allclose(aggregate_centroids(f_g, [-f_g])[0], f_g[0])


def test_centroid_term_trains_the_features_of_agreeing_samples():
    # The paper's loss: the feature is not detached, so the centroid term's gradient on a
    # feature is 2 * lambda_cen * (feature - centroid) where the label agrees, else 0.
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    features = torch.tensor([[2.0, 1.0], [0.5, 0.5]], requires_grad=True)
    logits = torch.zeros(2, 2, requires_grad=True)
    labels = torch.tensor([0, 1])
    agree = torch.tensor([True, False])
    loss = rofl_loss(logits, features, labels, labels, agree, centroids, 0.5, 0.0)
    assert loss.item() == pytest.approx(math.log(2) + 0.5 * (1.0 + 1.0))
    loss.backward()
    np.testing.assert_allclose(features.grad.numpy(), [[1.0, 1.0], [0.0, 0.0]])
    # The reimplementation's detached feature: same value, no gradient from the term.
    features.grad = None
    detached = rofl_loss(logits, features, labels, labels, agree, centroids, 0.5, 0.0, True)
    assert detached.item() == pytest.approx(loss.item())
    detached.backward()
    assert features.grad is None and logits.grad is not None


@pytest.mark.parametrize("name, width", [("lenet", 84), ("cnn9", 128), ("resnet18", 512),
                                         ("cnn", 128), ("mlp", 64)])
def test_the_centroid_shape_is_the_models_classes_and_feature_width(name, width):
    # K x D: the classes and the feature width of docs/BASELINE-METHODS.md (LeNet 84, 9-conv
    # CNN 128, ResNet 512; the small CNN 128, the MLP 64), measured on the model itself.
    task = TaskShape((3, 32, 32), 7)
    model = build_model(name, task, seed=0)
    assert classifier_shape(model, task) == ClassifierShape(7, width)
    assert get_weights(model)[-2].shape == (7, width)  # its classifier, registered last


def test_strategy_aggregates_and_sends_the_global_centroids_in_process():
    keys = {"method": "rofl", "num-clients": 4, "fraction": 1.0, "rounds": 3}
    s = make_driver(**keys)
    m = manager([FakeNode(p) for p in range(4)])
    rng = np.random.default_rng(0)
    previous = None
    for rnd in (1, 2):
        instructions = s.configure_fit(rnd, PARAMS, m)
        sent = [ins.config.get("rofl-centroids") for _, ins in instructions]
        if previous is None:
            assert sent == [None] * 4  # round 1: no f_G yet
        else:
            for blob in sent:
                np.testing.assert_array_equal(unpack_array(blob), previous.astype(np.float32))
        local = {node.pid: rng.random((3, 4)).astype(np.float32)  # K x D of GLOBAL's (3, 4)
                 for node, _ in instructions}
        s.aggregate_fit(rnd, [trained_reply(node, GLOBAL, **{
            "rofl-local-centroids": pack_array(local[node.pid])}) for node, _ in instructions], [])
        expected = aggregate_centroids(previous, [local[p] for p in range(4)])
        np.testing.assert_allclose(s.server.centroids, expected)
        previous = expected
    restored = make_driver(**keys)
    restored.pipeline.load_state(json.loads(json.dumps(s.pipeline.state())))
    np.testing.assert_array_equal(restored.server.centroids, s.server.centroids)


@pytest.fixture(scope="module")
def rofl_run(tiny_mnist_dir, tmp_path_factory):
    """3 rounds, 4 clients, 2 per round; pseudo-labels from round 2 (T_pl = 1)."""
    return simulate(tiny_mnist_dir, tmp_path_factory.mktemp("rofl") / "run", "rofl",
                    **{"fraction": 0.5, "rofl-t-pl": 1, "rofl-num-gradual": 2})


@pytest.mark.flower
def test_rofl_keeps_global_centroids_and_replaces_labels_in_a_flower_simulation(rofl_run):
    summary, records = rofl_run
    r1, r2, r3 = records[1:]
    assert [r["rofl_forget_rate"] for r in (r1, r2, r3)] == [0.0, 0.2, 0.2]
    assert [r["rofl_pseudo_labels"] for r in (r1, r2, r3)] == [False, True, True]
    assert all(r["client_loss"] == ["rofl", "rofl"] for r in (r1, r2, r3))
    assert all(r["rofl_centroid_norm"] > 0 for r in (r1, r2, r3))
    assert "rofl_centroid_shift" not in r1 and r2["rofl_centroid_shift"] > 0
    # Round 1 keeps every label; afterwards the small-loss samples whose nearest
    # centroid disagrees take the global model's pseudo-label.
    assert r1["rofl_replaced"] == 0 and r1["rofl_kept"] == sum(r1["num_examples"])
    assert r2["rofl_replaced"] > 0 and r2["rofl_kept"] < sum(r2["num_examples"])
    assert 0.0 < r3["rofl_agree_rate"] <= 1.0
    assert 0.0 <= summary["final_acc"] <= 1.0
