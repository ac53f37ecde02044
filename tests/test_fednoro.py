"""FedNoRo: the per-class-loss detector, DaAgg, the losses, and a real 3-round run."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.common import parameters_to_ndarrays

from common.baselines.daagg import daagg_distances, daagg_weights, model_distance, weighted_average
from common.baselines.fednoro import distillation_weight, log_prior, per_class_mean_loss
from common.baselines.noisy_clients import fednoro_noisy_clients, normalized_class_losses
from common.exchange import pack_array
from fedefc_client.baselines.fednoro import distillation_loss, logit_adjusted_ce
from fedefc_server.baselines.fednoro import read_class_losses
from tests.helpers import (
    PARAMS,
    FakeNode,
    make_driver,
    manager,
    simulate,
    trained_reply,
)


def test_class_losses_fill_missing_classes_and_min_max_each_column():
    m = np.array([[1.0, np.nan], [3.0, 2.0], [2.0, 4.0]])
    np.testing.assert_allclose(normalized_class_losses(m), [[0.0, 0.0], [1.0, 0.0], [0.5, 1.0]])
    assert (normalized_class_losses(np.full((2, 2), 1.0)) == 0).all()


def test_detector_flags_the_clients_noisy_by_construction():
    rng = np.random.default_rng(0)
    noisy = [1, 4, 9, 13, 18]
    losses = rng.uniform(0.2, 0.4, (20, 10))
    for c in noisy:  # noisy clients: high loss on the classes their labels corrupt
        losses[c, rng.choice(10, 6, replace=False)] = rng.uniform(1.8, 2.4, 6)
    losses[rng.random((20, 10)) < 0.2] = np.nan  # classes a client does not hold
    assert np.flatnonzero(fednoro_noisy_clients(losses, votes=9)).tolist() == noisy


def test_daagg_weights_on_a_hand_computed_case():
    # Three clients; 0 and 1 clean, 2 noisy. Each model: a 2-vector, a 1-vector and an
    # integer counter (skipped by the distance).
    models = [[np.array([0.0, 0.0]), np.array([0.0]), np.array(7)],
              [np.array([3.0, 0.0]), np.array([4.0]), np.array(9)],
              [np.array([6.0, 0.0]), np.array([8.0]), np.array(1)]]
    assert model_distance(models[0], models[1]) == pytest.approx(5.0)
    # d_2 = min(||w2 - w0|| = 10, ||w2 - w1|| = 5) = 5, normalized by max d = 5 -> 1.
    d = daagg_distances(models, np.array([False, False, True]))
    np.testing.assert_allclose(d, [0.0, 0.0, 1.0])
    w = daagg_weights(np.array([100, 200, 100]), d)
    total = 300 + 100 / math.e
    np.testing.assert_allclose(w, [100 / total, 200 / total, 100 / math.e / total])
    avg = weighted_average(models, w)
    np.testing.assert_allclose(avg[0], [w[1] * 3 + w[2] * 6, 0.0])
    assert avg[2].dtype == models[0][2].dtype and int(avg[2]) == round(7 * w[0] + 9 * w[1] + w[2])
    # No clean (or no noisy) client in the round: FedAvg's weights.
    assert (daagg_distances(models, np.array([True, True, True])) == 0).all()
    np.testing.assert_allclose(daagg_weights(np.array([1, 3]), np.zeros(2)), [0.25, 0.75])


def test_distillation_weight_ramps_like_the_reference():
    # 1-based round t is the reference's rnd = t - 1; begin 10, end 49, scale 0.8.
    assert distillation_weight(11, 10, 49, 0.8) == pytest.approx(0.8 * math.exp(-5))
    assert distillation_weight(30, 10, 49, 0.8) == pytest.approx(
        0.8 * math.exp(-5 * (1 - 19 / 39) ** 2))
    assert distillation_weight(50, 10, 49, 0.8) == pytest.approx(0.8)
    assert distillation_weight(90, 10, 49, 0.8) == pytest.approx(0.8)


def test_logit_adjusted_losses_by_hand():
    labels = np.array([0, 0, 0, 1])  # class 2 absent: log pi = -inf
    log_pi = torch.as_tensor(log_prior(labels, 3), dtype=torch.float32)
    np.testing.assert_allclose(log_pi[:2].numpy(), np.log([0.75, 0.25]), rtol=1e-6)
    assert torch.isinf(log_pi[2])
    logits = torch.tensor([[1.0, 2.0, 5.0], [0.5, -1.0, 3.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    la = logit_adjusted_ce(logits, y, log_pi)
    adjusted = logits[:, :2].detach() + torch.log(torch.tensor([0.75, 0.25]))
    assert la.item() == pytest.approx(float(F.cross_entropy(adjusted, y)), rel=1e-6)
    la.backward()
    assert (logits.grad[:, 2] == 0).all()  # the absent class plays no part
    teacher = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    plain = distillation_loss(logits, y, teacher, log_pi, 0.0, 0.8)
    assert plain.item() == pytest.approx(la.item(), rel=1e-6)
    soft = torch.softmax(teacher / 0.8, dim=1)
    log_pred = torch.log_softmax(logits.detach() + log_pi, dim=1)
    log_pred[:, 2] = 0.0  # the reference's replacement of -inf
    kl = float((soft * (soft.log() - log_pred)).sum() / 2)
    assert distillation_loss(logits, y, teacher, log_pi, 1.0, 0.8).item() == pytest.approx(kl)


def test_per_class_mean_loss_marks_absent_classes():
    out = per_class_mean_loss(np.array([1.0, 3.0, 5.0]), np.array([0, 0, 2]), 4)
    np.testing.assert_allclose(out, [2.0, np.nan, 5.0, np.nan])


def test_strategy_detects_on_every_client_then_aggregates_with_daagg_in_process():
    noisy = {1, 4}

    def class_losses(pid):  # 3 classes: GLOBAL's classifier is 3 x 4
        losses = np.full(3, 0.3) + 0.01 * pid
        if pid in noisy:
            losses[:2] = 2.0
        if pid == 2:
            losses[2] = np.nan  # a class client 2 does not hold
        return {"fednoro-class-losses": pack_array(losses)}

    sizes = {p: 10 * (p + 1) for p in range(6)}
    nodes = [FakeNode(p, lambda config, p=p: class_losses(p), sizes[p]) for p in range(6)]
    m = manager(nodes)
    keys = {"method": "fednoro", "num-clients": 6, "fraction": 1.0, "rounds": 3,
            "fednoro-warmup": 1}
    s = make_driver(**keys)
    first = s.configure_fit(1, PARAMS, m)
    assert not any(n.tasks for n in nodes) and "fednoro-noisy" not in first[0][1].config
    instructions = s.configure_fit(2, PARAMS, m)
    assert all([t["fednoro-task"] for t in n.tasks] == ["class-losses"] for n in nodes)
    assert s.server.noisy == noisy
    assert {node.pid: ins.config["fednoro-noisy"] for node, ins in instructions} == \
        {p: int(p in noisy) for p in range(6)}
    rng = np.random.default_rng(0)
    models = {p: [rng.normal(size=(3, 4)).astype(np.float32),
                  rng.normal(size=5).astype(np.float32)] for p in range(6)}
    replies = [trained_reply(node, models[node.pid]) for node, _ in instructions]
    params, _ = s.aggregate_fit(2, replies[::-1], [])
    flags = np.array([p in noisy for p in range(6)])
    ordered = [models[p] for p in range(6)]
    coefs = daagg_weights(np.array([sizes[p] for p in range(6)]),
                          daagg_distances(ordered, flags))
    for got, want in zip(parameters_to_ndarrays(params), weighted_average(ordered, coefs)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert s.fields()["daagg_weights"] == pytest.approx(dict(enumerate(coefs)))
    restored = make_driver(**keys)
    restored.pipeline.load_state(json.loads(json.dumps(s.pipeline.state())))
    assert restored.server.noisy == noisy


BAD_CLASS_LOSSES = {  # case: (the reply's metrics without the partition id, reason)
    "missing": ({}, "no fednoro-class-losses"),
    "text": ({"fednoro-class-losses": "0.3,0.3,0.3"}, "undecodable"),
    "garbage bytes": ({"fednoro-class-losses": b"not npy"}, "undecodable"),
    "empty bytes": ({"fednoro-class-losses": b""}, "undecodable"),
    "too long": ({"fednoro-class-losses": pack_array(np.full(4, 0.3))}, "expected 3 floats"),
    "matrix": ({"fednoro-class-losses": pack_array(np.full((3, 1), 0.3))}, "expected 3 floats"),
    "integers": ({"fednoro-class-losses": pack_array(np.ones(3, np.int64))}, "expected 3 floats"),
    "Inf": ({"fednoro-class-losses": pack_array(np.array([0.3, np.inf, 0.3]))}, "Inf"),
    "negative": ({"fednoro-class-losses": pack_array(np.array([0.3, -1.0, 0.3]))}, "negative"),
    "all NaN": ({"fednoro-class-losses": pack_array(np.full(3, np.nan))}, "no class"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLASS_LOSSES))
def test_detection_leaves_out_a_reply_without_a_valid_class_loss_vector(case):
    # Six clients, 3 classes (GLOBAL's classifier is 3 x 4); 1 and 4 noisy by
    # construction, client 2 lacks class 2 (NaN: legitimate, used); client 5 replies
    # with a bad vector: left out (treated as clean), the others still give {1, 4}.
    noisy = {1, 4}

    def answer(pid):
        if pid == 5:
            return BAD_CLASS_LOSSES[case][0]
        losses = np.full(3, 0.3) + 0.01 * pid
        if pid in noisy:
            losses[:2] = 2.0
        if pid == 2:
            losses[2] = np.nan
        return {"fednoro-class-losses": pack_array(losses)}

    nodes = [FakeNode(p, lambda config, p=p: answer(p)) for p in range(6)]
    s = make_driver(**{
        "method": "fednoro", "num-clients": 6, "fraction": 1.0, "rounds": 3,
        "fednoro-warmup": 1})
    s.configure_fit(2, PARAMS, manager(nodes))
    assert s.server.noisy == noisy
    info = s.fields()
    assert info["fednoro_detection_clients"] == [0, 1, 2, 3, 4]
    assert list(info["fednoro_detection_skipped"]) == [5]
    assert BAD_CLASS_LOSSES[case][1] in info["fednoro_detection_skipped"][5]


def test_a_class_loss_vector_with_absent_classes_is_read_as_sent():
    sent = np.array([0.5, np.nan, 1.25, np.nan])  # what a client lacking classes 1, 3 sends
    got = read_class_losses({"fednoro-class-losses": pack_array(sent)}, 4)
    np.testing.assert_array_equal(got, sent)


@pytest.fixture(scope="module")
def fednoro_run(tiny_mnist_dir, tmp_path_factory):
    """3 rounds, 4 clients, 2 per round: warm-up = round 1, detection before round 2."""
    return simulate(tiny_mnist_dir, tmp_path_factory.mktemp("fednoro") / "run", "fednoro",
                    **{"fraction": 0.5, "fednoro-warmup": 1})


@pytest.mark.flower
def test_fednoro_detects_once_on_every_client_then_distills_and_uses_daagg(fednoro_run):
    summary, records = fednoro_run
    r1, r2, r3 = records[1:]
    assert r1["client_loss"] == ["logit-adjusted"] * 2 and "daagg_weights" not in r1
    # The detection asked all four clients, though only two train per round.
    assert r2["fednoro_detection_clients"] == [0, 1, 2, 3] and len(r2["sampled"]) == 2
    # In a simulation the registry asks a node only when it is first needed: round 1's
    # two sampled nodes, then the detection's other two (fedefc_server/registry.py).
    assert sorted(map(int, r1["declared"])) == r1["sampled"]
    assert sorted(map(int, {**r1["declared"], **r2["declared"]})) == [0, 1, 2, 3]
    noisy = set(r2["fednoro_noisy"])
    assert noisy <= {0, 1, 2, 3} and summary["fednoro_noisy"] == sorted(noisy)
    assert sorted(map(int, r2["fednoro_true_noise"])) == [0, 1, 2, 3]
    assert "fednoro_detection_clients" not in r3  # once only
    for r in (r2, r3):
        assert r["fednoro_kd_weight"] == pytest.approx(0.8 * math.exp(-5))
        expected = ["logit-adjusted+distillation" if p in noisy else "logit-adjusted"
                    for p in r["partition_ids"]]
        assert r["client_loss"] == expected
        assert sorted(map(int, r["daagg_weights"])) == r["sampled"]
        assert sum(r["daagg_weights"].values()) == pytest.approx(1.0)
        mixed = 0 < len(set(r["sampled"]) & noisy) < len(r["sampled"])
        assert (r["daagg_weights"] != pytest.approx(r["fedavg_weights"])) == mixed
