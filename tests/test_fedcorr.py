"""FedCorr: LID, the detectors, the schedule, the corrections, and a real 3-round run."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from common.baselines.fedcorr import plan_fedcorr, relabel_confident, relabel_highest_loss
from common.baselines.lid import client_lid, lid_mle, nearest_distances
from common.baselines.noisy_clients import lid_noisy_clients, loss_noise_level
from common.config import ConfigError
from common.datasets import load_dataset
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from fedefc_cli.main import main
from fedefc_client.baselines.fedcorr import proximal_norm
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server import checkpoint
from fedefc_server.checkpoint import CheckpointError
from tests.helpers import (
    GLOBAL,
    PARAMS,
    FakeNode,
    make_driver,
    manager,
    simulate,
    trained_reply,
)


def brute_force_lid(points, k):
    """LID of every point by explicit loops: sort the distances to all other points."""
    out = []
    for i, p in enumerate(points):
        r = sorted(math.dist(p, q) for j, q in enumerate(points) if j != i)[:k]
        out.append(-1.0 / (sum(math.log(ri / r[-1]) for ri in r) / k))
    return np.array(out)


def test_lid_on_a_constructed_point_set():
    # The origin and k points on distinct axes at distances 1..k: the origin's k nearest
    # neighbours are at 1, 2, ..., k, so LID(0) = k / sum_i log(k / i) (closed form).
    k = 6
    points = np.vstack([np.zeros(k), np.diag(np.arange(1.0, k + 1))])
    lid = lid_mle(points, k)
    assert lid[0] == pytest.approx(k / sum(math.log(k / i) for i in range(1, k + 1)))
    np.testing.assert_allclose(lid, brute_force_lid(points, k), rtol=1e-10)
    np.testing.assert_allclose(lid_mle(7.5 * points, k), lid, rtol=1e-10)  # scale-free
    random_points = np.random.default_rng(0).random((60, 4))
    np.testing.assert_allclose(lid_mle(random_points, 5), brute_force_lid(random_points, 5),
                               rtol=1e-8)


def test_lid_of_near_duplicates_far_from_the_origin_is_exact():
    # The closed-form set above, shrunk to neighbours 1e-5..6e-5 apart and moved to
    # 1e4 on every axis. LID is translation and scale invariant, so the origin's LID is
    # still k / sum_i log(k / i). The expansion ||a||^2 + ||b||^2 - 2ab loses the 1e-10
    # squared distances against 1e8-sized squared norms (it gave 0 here).
    k = 6
    points = 1e4 + 1e-5 * np.vstack([np.zeros(k), np.diag(np.arange(1.0, k + 1))])
    np.testing.assert_allclose(nearest_distances(points, k)[0], 1e-5 * np.arange(1, k + 1),
                               rtol=1e-6)
    assert lid_mle(points, k)[0] == pytest.approx(
        k / sum(math.log(k / i) for i in range(1, k + 1)), rel=1e-5)
    # A cloud of near-duplicates (softmax-like outputs 1e-7 apart) at offset 1e4: every
    # point has a finite, positive LID, the same as the cloud's at the origin.
    cloud = 1e-7 * np.random.default_rng(4).random((200, 10))
    far = lid_mle(1e4 + cloud, 20)
    assert np.isfinite(far).all() and (far > 0).all()
    np.testing.assert_allclose(far, lid_mle(cloud, 20), rtol=1e-3)


@pytest.mark.parametrize("dim", [2, 5])
def test_lid_of_uniform_points_is_near_their_dimension(dim):
    points = np.random.default_rng(dim).random((1500, dim))
    assert client_lid(points, 20) == pytest.approx(dim, rel=0.15)


def test_lid_limits_duplicates_and_small_sets():
    points = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    lid = lid_mle(points, 3)
    assert lid[0] == 0.0 and lid[1] == 0.0  # a duplicate neighbour: LID 0
    assert np.isfinite(lid).all()
    assert client_lid(np.zeros((1, 3))) == 0.0
    with pytest.raises(ValueError, match="k=3"):
        nearest_distances(np.zeros((3, 2)), 3)


def test_lid_detector_flags_the_high_lid_clients():
    rng = np.random.default_rng(1)
    noisy = [2, 5, 11, 17]
    lid_sums = rng.normal(10.0, 0.3, 20)
    lid_sums[noisy] = rng.normal(14.0, 0.3, len(noisy))
    assert np.flatnonzero(lid_noisy_clients(lid_sums, 0)).tolist() == noisy
    assert not lid_noisy_clients(np.full(5, 3.0), 0).any()


def test_loss_noise_level_is_the_high_loss_share():
    rng = np.random.default_rng(2)
    losses = np.concatenate([rng.normal(0.1, 0.02, 140), rng.normal(3.0, 0.3, 60)])
    assert loss_noise_level(rng.permutation(losses), 0) == pytest.approx(0.3)


def test_schedule_splits_the_rounds_and_visits_every_client_once_per_iteration():
    plan = plan_fedcorr(rounds=100, num_clients=100, fraction=0.1, frac1=0.0, iterations=5,
                        finetune_share=0.5)
    assert plan.describe() == {"stage1_rounds": 50, "stage2_rounds": 25, "stage3_rounds": 25,
                               "clients_per_subround": 10, "subrounds_per_iteration": 10,
                               "iterations": 5}
    assert [plan.stage(r) for r in (1, 50, 51, 75, 76, 100)] == [1, 1, 2, 2, 3, 3]
    assert [r for r in range(1, 101) if plan.ends_iteration(r)] == [10, 20, 30, 40, 50]
    for iteration in range(2):
        rounds = range(iteration * 10 + 1, iteration * 10 + 11)
        visited = list(itertools.chain(*(plan.subround_clients(3, r) for r in rounds)))
        assert sorted(visited) == list(range(100))
    assert plan.subround_clients(3, 1) != plan.subround_clients(3, 11)
    uneven = plan_fedcorr(10, 7, 0.5, 0.0, 2, 0.5)  # 3 clients per sub-round: 3 sub-rounds
    assert (uneven.stage1_end, uneven.finetune_rounds) == (6, 2)
    assert sorted(itertools.chain(*(uneven.subround_clients(0, r) for r in (1, 2, 3)))) \
        == list(range(7))


def test_a_schedule_that_does_not_fit_is_a_config_error_naming_the_keys():
    with pytest.raises(ConfigError, match="fedcorr-iterations=5.*rounds=40"):
        load_run_config({"method": "fedcorr", "num-clients": 20, "fraction": 0.05,
                         "rounds": 40})
    load_run_config({"method": "fedavg", "num-clients": 20, "fraction": 0.05, "rounds": 40})


def test_proximal_norm_is_unsquared_and_has_a_zero_gradient_at_the_anchor():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0]]))
        model.bias.copy_(torch.tensor([4.0]))
    anchor = [torch.zeros(1, 2), torch.zeros(1)]
    value = proximal_norm(model, anchor)
    assert float(value.detach()) == pytest.approx(5.0)
    value.backward()
    np.testing.assert_allclose(model.weight.grad.numpy(), [[0.6, 0.0]])
    model.zero_grad()
    at_anchor = proximal_norm(model, [p.detach().clone() for p in model.parameters()])
    at_anchor.backward()
    assert float(at_anchor.detach()) == 0.0 and torch.isfinite(model.weight.grad).all()


def test_relabel_rules_on_a_constructed_client():
    labels = np.array([0, 0, 1, 1, 2, 2])
    losses = np.array([0.1, 3.0, 0.2, 2.0, 5.0, 0.3])
    probs = np.array([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.2, 0.7, 0.1],
                      [0.4, 0.3, 0.3], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]])
    # fraction 0.5 -> the 3 highest losses (samples 4, 1, 3); sample 3 is not confident.
    new = relabel_highest_loss(labels, losses, probs, 0.5, 0.5)
    assert new.tolist() == [0, 1, 1, 1, 2, 2]
    assert relabel_confident(labels, probs, 0.5).tolist() == [0, 1, 1, 1, 2, 0]
    assert relabel_highest_loss(labels, losses, probs, 0.0, 0.5).tolist() == labels.tolist()


def test_corrected_labels_persist_in_client_state():
    cfg = load_run_config({"method": "fedcorr", "num-clients": 20, "fraction": 0.5,
                           "iid": True, "local-epochs": 1, "rho": 0.4, "zeta": 0.4})
    local = partition_data(cfg, 1, torch.device("cpu"))
    state = RecordDict()
    client = MethodClient(cfg, 1, lambda: local, state)
    model = initial_model(cfg, local.data.task)  # not the process cache, which it edits below
    base = {"phase": 1, "seed": 1, "fedcorr-stage": 1}
    weights, n, m = client.fit(get_weights(model), {**base, "round": 1, "fedcorr-mu": 0.2})
    assert n == len(local) and m["loss"] == "cross-entropy+prox-norm"
    assert m["fedcorr-lid"] > 0 and 0.0 <= m["fedcorr-est-noise"] <= 1.0
    # A global model that is sure every sample is class 3: every label becomes 3.
    model.load_state_dict(dict(zip(model.state_dict(), map(torch.as_tensor, weights))))
    with torch.no_grad():
        model.classifier.bias[3] = 100.0
    confident = get_weights(model)
    _, n, m = client.fit(confident, {**base, "round": 2, "fedcorr-task": "relabel-confident"})
    not_three = int((local.labels != 3).sum())
    assert n == 0 and m["fedcorr-relabelled"] == m["fedcorr-corrected"] == not_three > 0
    assert (state["fedcorr-labels"]["values"].numpy() == 3).all()
    # The next messages start from the stored labels: nothing left to change.
    client.fit(weights, {**base, "round": 3, "fedcorr-mu": 0.0})
    _, _, m = client.fit(confident, {**base, "round": 4, "fedcorr-task": "relabel-confident"})
    assert m["fedcorr-relabelled"] == 0 and m["fedcorr-corrected"] == not_three


@pytest.fixture(scope="module")
def fedcorr_run(tiny_mnist_dir, tmp_path_factory):
    """3 rounds, 4 clients all in one sub-round: stage 1 = round 1 (one iteration),
    stage 2 = round 2, stage 3 = round 3."""
    return simulate(tiny_mnist_dir, tmp_path_factory.mktemp("fedcorr") / "run", "fedcorr",
                    **{"fraction": 1.0, "fedcorr-iterations": 1})


@pytest.mark.flower
def test_fedcorr_runs_its_three_stages_in_a_flower_simulation(fedcorr_run):
    summary, records = fedcorr_run
    assert summary["fedcorr_plan"]["stage1_rounds"] == 1
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    r1, r2, r3 = records[1:]
    assert [r["fedcorr_stage"] for r in (r1, r2, r3)] == [1, 2, 3]
    # Stage 1: every client once, each reporting its LID; the detection ran.
    assert r1["sampled"] == [0, 1, 2, 3] and sorted(r1["fedcorr_lid"]) == ["0", "1", "2", "3"]
    assert all(v > 0 for v in r1["fedcorr_lid"].values())
    noisy = r1["fedcorr_noisy"]
    assert noisy and set(noisy) < {0, 1, 2, 3}  # this seed flags some, not all
    assert sorted(map(int, r1["fedcorr_est_noise"])) == noisy
    assert r1["true_noise_flagged"] is not None  # the simulator's truth beside the flags
    # Before round 2 the flagged clients were corrected; stage 2 trains only the
    # clients whose estimated noise is at most the clean-set threshold.
    assert sorted(map(int, r2["fedcorr_relabel_highest_loss"])) == noisy
    clean = [p for p in range(4) if r1["fedcorr_est_noise"].get(str(p), 0.0) <= 0.1]
    assert set(r2["sampled"]) <= set(clean) and r2["fedcorr_clean_pool"] == len(clean)
    # Before round 3 (stage 3) the flagged clients relabelled their confident samples.
    assert sorted(map(int, r3["fedcorr_relabel_confident"])) == noisy
    assert r3["sampled"] == [0, 1, 2, 3]
    assert 0.0 <= summary["final_acc"] <= 1.0


def test_strategy_flags_corrects_and_restricts_stage_2_in_process():
    # 4 clients in one sub-round, 2 iterations (rounds 1-2), stage 2 = round 3, stage 3 = 4.
    nodes = [FakeNode(p, lambda config: {"fedcorr-relabelled": 3, "fedcorr-corrected": 5})
             for p in range(4)]
    m = manager(nodes)
    s = make_driver(**{
        "method": "fedcorr", "num-clients": 4, "fraction": 1.0, "rounds": 4,
        "fedcorr-iterations": 2})
    lids, est = [1.0, 1.1, 0.9, 5.0], [0.05, 0.02, 0.5, 0.4]

    def stage1_round(rnd):
        instructions = s.configure_fit(rnd, PARAMS, m)
        replies = [trained_reply(node, GLOBAL, **{"fedcorr-lid": lids[node.pid],
                                                      "fedcorr-est-noise": est[node.pid]})
                   for node, _ in instructions]
        s.aggregate_fit(rnd, replies, [])
        return {node.pid: ins.config for node, ins in instructions}

    configs = stage1_round(1)
    assert {c["fedcorr-stage"] for c in configs.values()} == {1}
    assert {c["fedcorr-mu"] for c in configs.values()} == {0.0}
    # client 2's 0.5 is not kept: clean
    assert s.server.noisy == [3] and s.server.est_noise == {3: 0.4}
    configs = stage1_round(2)
    assert [n.tasks[0]["fedcorr-task"] for n in nodes if n.tasks] == ["relabel-highest-loss"]
    assert nodes[3].tasks[0]["fedcorr-relabel-fraction"] == pytest.approx(0.4 * 0.5)
    assert s.fields()["fedcorr_relabel_highest_loss"] == {3: 3}
    assert configs[3]["fedcorr-mu"] == 0.4 and configs[0]["fedcorr-mu"] == 0.0
    assert s.server.lid_sum == {p: 2 * v for p, v in enumerate(lids)}
    restored = make_driver(**{
        "method": "fedcorr", "num-clients": 4, "fraction": 1.0, "rounds": 4,
        "fedcorr-iterations": 2})
    restored.server.load_state(json.loads(json.dumps(s.server.state())))
    a, b = restored.server, s.server
    assert (a.lid_sum, a.est_noise, a.noisy) == (b.lid_sum, b.est_noise, b.noisy)
    stage2 = s.configure_fit(3, PARAMS, m)  # stage 2: the clients with est noise <= 0.1
    assert sorted(node.pid for node, _ in stage2) == [0, 1, 2]
    assert len(nodes[3].tasks) == 2  # the second iteration's correction
    s.configure_fit(4, PARAMS, m)
    assert nodes[3].tasks[-1]["fedcorr-task"] == "relabel-confident"
    assert not any(n.tasks for n in nodes[:3])


FEDCORR_4 = {"method": "fedcorr", "num-clients": 4, "fraction": 1.0, "rounds": 4,
             "fedcorr-iterations": 2}


def test_the_plan_survives_a_checkpoint_and_a_resume_with_another_plan_is_refused():
    # 4 clients in one sub-round, 2 iterations: stage 1 = rounds 1-2; stage 2 gets
    # floor(0.5 x (4 - 2) + 0.5) = 1 round; stage 3 the last one.
    s = make_driver(**FEDCORR_4)
    s.server.lid_sum, s.server.est_noise, s.server.noisy = {0: 1.0, 3: 5.0}, {3: 0.4}, [3]
    state = json.loads(json.dumps(s.server.state()))
    assert state["fedcorr"]["plan"] == {"rounds": 4, "num_clients": 4, "per_subround": 4,
                                        "iterations": 2, "finetune_rounds": 1}
    restored = make_driver(**FEDCORR_4)
    restored.server.load_state(state)
    assert restored.server.plan == s.server.plan
    assert json.loads(json.dumps(restored.server.state()))["fedcorr"] == state["fedcorr"]
    # rounds=6 would give stage 2 floor(0.5 x 4 + 0.5) = 2 rounds: round 4, stage 3 in
    # the interrupted run, would become stage 2. Refused, naming the key.
    longer = make_driver(**{**FEDCORR_4, "rounds": 6})
    with pytest.raises(CheckpointError, match=r"finetune_rounds: 1 -> 2.*rounds=4"):
        longer.server.load_state(state)
    # Without stage 2 more rounds only lengthen stage 3: the same plan, accepted.
    share0 = {**FEDCORR_4, "fedcorr-finetune-share": 0.0}
    state0 = make_driver(**share0).server.state()
    make_driver(**{**share0, "rounds": 8}).server.load_state(json.loads(json.dumps(state0)))


@pytest.mark.parametrize("bad", ["3", -1, 2.5, True, None])
def test_a_correction_reply_with_a_bad_count_is_left_out_of_the_record(bad):
    answers = {2: {"fedcorr-relabelled": 4, "fedcorr-corrected": 6},
               3: {"fedcorr-relabelled": bad, "fedcorr-corrected": 5}}
    nodes = [FakeNode(p, lambda config, p=p: answers.get(p, {})) for p in range(4)]
    m = manager(nodes)
    s = make_driver(**FEDCORR_4)
    instructions = s.configure_fit(1, PARAMS, m)
    lids, est = [1.0, 1.1, 5.0, 5.0], [0.05, 0.02, 0.3, 0.4]
    s.aggregate_fit(1, [trained_reply(node, GLOBAL, **{"fedcorr-lid": lids[node.pid],
                                                           "fedcorr-est-noise": est[node.pid]})
                        for node, _ in instructions], [])
    assert s.server.noisy == [2, 3]
    s.configure_fit(2, PARAMS, m)  # the first iteration's correction goes to 2 and 3
    assert nodes[2].tasks and nodes[3].tasks
    fields = s.fields()
    assert fields["fedcorr_relabel_highest_loss"] == {2: 4}
    assert fields["fedcorr_relabel_highest_loss_corrected"] == {2: 6}


def test_a_resume_with_another_plan_fails_before_any_flower_process(tmp_path, capsys):
    """The launcher's preflight refuses it (exit 2, naming the plan and the rounds to
    use), so no SuperLink is started for a run the ServerApp would refuse."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_run_config({**FEDCORR_4, "prestopping": False, "out-dir": str(out)})
    state = make_driver(**FEDCORR_4).pipeline.state()
    weights = get_weights(initial_model(cfg, load_dataset(cfg).task))
    checkpoint.save(out, checkpoint.Checkpoint(2, weights, state, cfg.to_flat()))
    (out / "config.json").write_text(json.dumps(cfg.to_flat()))
    assert main(["resume", str(out), "--set", "rounds=6"]) == 2
    err = capsys.readouterr().err
    assert "FedCorr plan" in err and "rounds=4" in err
    assert not (out / "superlink.log").exists() and not (out / "summary.json").exists()
