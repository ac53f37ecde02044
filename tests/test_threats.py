"""The attack suite of docs/THREAT-MODEL.md: one lying node, a curious server, malformed
secure replies, and nodes that claim what is not theirs, each replayed through the
``faults`` key against the project's real ClientApp (its mods included) in this process
(:class:`tests.helpers.InProcessGrid`), with the server's round pipeline and Flower's
SecAgg+ workflow, and each refused by its defence.

Every test here failed on the server of commit 28de8bc (the attack succeeded or the
run crashed): docs/THREAT-MODEL.md names them.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

import fedefc_client.client
import fedefc_client.job
import fedefc_client.local_update
import fedefc_client.mods
import fedefc_client.run_client
import fedefc_client.server_checks
import fedefc_server.federation
import fedefc_server.node_answers
import fedefc_server.pipeline
import fedefc_server.registry
import fedefc_server.round_loop
import fedefc_server.secure_round
import fedefc_server.server_app
import fedefc_server.strategy
import fedefc_server.validation
from common.config import ConfigError, secagg_shares
from common.data_plan import data_plan
from common.faults import parse_faults, parse_server_faults
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from common.sample_roles import held_out_count
from common.secure_means import encode_tail, tail_scale
from common.update_bound import quantizer_range, secure_range
from common.verifiable_shares import COMPLAINTS
from fedefc_client.client_app import app as client_app
from fedefc_client.local_data import partition_data
from fedefc_server.allowlist import AllowedNode, Allowlist, AllowlistError, fingerprint
from fedefc_server.culprit_search import CulpritSearch
from fedefc_server.declarations import Declaration, SizeRule, admission
from fedefc_server.dishonest import DishonestGrid
from fedefc_server.failures import NodeFailed
from fedefc_server.registry_report import absence
from fedefc_server.secure_round import RoundRefused, ScreeningGrid
from fedefc_server.secure_sum import (
    bad_mean_update,
    check_secure_sum,
    group_accuracy,
    pull_bound,
)
from fedefc_server.summary import RunFacts, build_summary, run_report, summary_lines
from tests.helpers import (
    GLOBAL,
    OK,
    PARAMS,
    InProcessGrid,
    RoundDriver,
    make_driver,
    make_pipeline,
    manager,
    partition_nodes,
    records,
    simulate,
)
from tests.test_privacy import CPU, micro_config, plain_round, secure_loop, secure_round
from tests.test_privacy import server as fedefc_server_for

SECURE = {"secure-aggregation": True}


def stage_of(msg: Message) -> str | None:
    """The SecAgg+ stage a message of the workflow belongs to (requests carry it)."""
    return msg.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)


def configs(msg: Message) -> ConfigRecord:
    return msg.content.config_records.get(RECORD_KEY_CONFIGS, ConfigRecord())


# -- a curious server: a refused reply is never unmasked ------------------------------------
def test_a_secure_reply_refused_after_its_vector_arrived_is_never_unmasked(micro_mnist_dir,
                                                                           tmp_path):
    """Node 1001 inflates its clear count: refused once its masked vector has arrived.
    The server never asks for, and never receives, a share of its secrets: the attempt
    that received its vector has no unmask stage, and the round starts again without
    it. (At 28de8bc it became a dropout: its pairwise key was rebuilt.)"""
    flat = micro_config(micro_mnist_dir, tmp_path, 5, **SECURE, faults="samples=17@1@1")
    grid = InProcessGrid(client_app, flat, 5)
    fields, params = secure_round(flat, grid)
    liar = 1001
    unmask_requests = [m for m in grid.sent if stage_of(m) == Stage.UNMASK]
    for msg in unmask_requests:
        asked = configs(msg)
        assert liar not in asked[Key.DEAD_NODE_ID_LIST] + asked[Key.ACTIVE_NODE_ID_LIST]
    for msg in grid.received:
        assert liar not in configs(msg).get(Key.NODE_ID_LIST, [])  # no share of its secrets
    assert unmask_requests and all(m.metadata.dst_node_id != liar for m in unmask_requests)
    stages = [(stage_of(m), m.metadata.dst_node_id) for m in grid.sent]
    collected = [i for i, (s, nid) in enumerate(stages)
                 if s == Stage.COLLECT_MASKED_VECTORS and nid == liar]
    assert collected  # its masked vector was asked for (and arrived) ...
    after = [s for s, _ in stages[collected[0]:]]
    assert Stage.UNMASK not in after[:after.index(Stage.SETUP)]  # ... then no unmasking
    assert fields["secure_attempts"] == 2 and fields["partition_ids"] == [0, 2, 3, 4]
    assert fields["rejected_reasons"][0]["reason"].startswith("sample count 17 outside 1..16")
    assert params is not None
    # the thresholds Flower used are the ones the config check assumed (secagg_shares)
    setups = [configs(m) for m in grid.sent if stage_of(m) == Stage.SETUP]
    assert {(c[Key.SAMPLE_NUMBER], c[Key.SHARE_NUMBER], c[Key.THRESHOLD]) for c in setups} \
        == {(n, *secagg_shares(0, 0.67, n)) for n in (5, 4)}


def test_the_unmask_stage_may_not_name_a_received_vector_dropped():
    """The last guard: an unmask request that would treat a node whose vector arrived
    as dropped (its holders would send its pairwise key's shares) is never sent."""
    grid = ScreeningGrid(InProcessGrid(client_app, {}, 0), None, None, 3)
    grid.received = {7, 8, 9}
    request = Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [7, 9],
        Key.DEAD_NODE_ID_LIST: [8]})}), 7, MessageType.TRAIN)
    with pytest.raises(RoundRefused, match=re.escape("masks of node(s) [8]")):
        grid.send_and_receive([request])


@pytest.mark.parametrize("numbers", [(4, 4, 2), (2, 2, 2)], ids=["half", "two-clients"])
def test_a_round_flower_rounded_below_a_majority_or_the_minimum_is_refused(numbers):
    """The setup stage's own numbers (clients, shares, threshold), checked per round."""
    clients, shares, threshold = numbers
    grid = ScreeningGrid(InProcessGrid(client_app, {}, 0), None, None, 3)
    setup = Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: clients, Key.SHARE_NUMBER: shares,
        Key.THRESHOLD: threshold})}), 7, MessageType.TRAIN)
    with pytest.raises(RoundRefused, match="strict majority|below min-secure-clients"):
        grid.send_and_receive([setup])


@pytest.mark.parametrize("overrides, message", [
    ({"num-clients": 4, "fraction": 1.0, "reconstruction-threshold": 0.51},
     "a round of 4 clients would need only 2 of 4 shares"),
    ({"num-clients": 10, "fraction": 1.0, "reconstruction-threshold": 0.55},
     "a round of 4 clients would need only 2 of 4 shares"),
    ({"num-clients": 4, "fraction": 0.5}, "2 clients per round, below min-secure-clients=3"),
    ({"num-clients": 10, "fraction": 1.0, "num-shares": 4}, "num-shares=4 is even"),
], ids=["0.51-of-4", "0.55-at-4", "two-clients", "even-shares"])
def test_a_config_that_allows_a_minority_threshold_or_tiny_rounds_is_refused(overrides,
                                                                            message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config({**SECURE, **overrides})
    assert load_run_config({**SECURE, "num-clients": 10, "fraction": 1.0}).secure_aggregation


def test_too_few_nodes_for_a_secure_round_refuse_it_before_any_key_is_made(micro_mnist_dir,
                                                                          tmp_path):
    """Two of four nodes are refused at registration (they declare held-out samples the
    plan does not give them): two clients are left, below min-secure-clients = 3."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, faults="held-out=3@2-3")
    grid = InProcessGrid(client_app, flat, 4)
    fields, params = secure_round(flat, grid)
    assert params is None and fields["skipped"]
    assert fields["secure_refused"] == "2 clients left, below min-secure-clients=3"
    assert not any(stage_of(m) for m in grid.sent)  # no SecAgg+ message at all


# -- one lying node inside the mask: the decoded sum, checked ------------------------------
@pytest.mark.parametrize("fault, reason", [
    ("secure-acc=5@0@1", "the clients' mean accuracy"),
    ("secure-acc=410@0@1", "array 10 of the decoded sum holds"),
    ("weight=1000@0@1", "a weight was changed inside the mask"),
    ("garbage@0@1", "its 4 clients declared 80"),
], ids=["lying-accuracy", "absurd-accuracy", "inflated-weight", "garbage-vector"])
def test_a_steered_secure_sum_is_refused_and_never_feeds_prestopping(micro_mnist_dir, tmp_path,
                                                                     fault, reason):
    """At 28de8bc these sums were applied: an A(1) above 1 (above 100) fed the
    prestopping rule; the inflated weight shrank the model about 1000-fold; the garbage
    became the model."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, faults=fault)
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert params is None and fields["skipped"]
    assert reason in fields["refused_sum"]
    assert "A" not in fields  # nothing reached the prestopping rule


def flower_secure_sum(updates: list[list[np.ndarray]], counts: list[int], max_weight: float,
                      c: float) -> tuple[list[np.ndarray], int]:
    """What Flower's SecAgg+ hands the server for these clients' arrays without masks
    (the masks cancel): each client's arrays times q_k / 2^22, q_k = round(n_k / M
    2^22), quantized with Flower's quantizer; the sum dequantized, shifted and divided
    by the weight total as Flower's unmask stage does. (decoded arrays, weight total)"""
    total = 0
    summed = None
    for arrays, n in zip(updates, counts):
        q = round(n / max_weight * 2**22)
        total += q
        quantized = quantize([a * (q / 2**22) for a in arrays], c, 2**22)
        summed = quantized if summed is None else [s + x for s, x in zip(summed, quantized)]
    decoded = dequantize(summed, c, 2**22)
    return [(d - (len(counts) - 1) * c) * (2**22 / total) for d in decoded], total


def test_an_honest_sum_passes_its_checks_and_a_changed_weight_total_does_not():
    """Flower's own quantizer is the truth: three honest clients pass; a weight total
    off by more than K/2 (or 0: an inf/NaN model), or a count slot half a client more,
    is refused."""
    rng = np.random.default_rng(0)
    counts, c, m = [10, 20, 30], 8.0, 30.0
    updates = []
    for n in counts:
        tail, _ = encode_tail({"accuracy": rng.uniform(), "train-loss": 2.0}, n,
                              tail_scale(c, m))
        updates.append([rng.uniform(-1, 1, (4, 3)), tail])
    arrays, total = flower_secure_sum(updates, counts, m, c)
    assert check_secure_sum(arrays, total, counts, m, c) is None
    assert "a weight was changed" in check_secure_sum(arrays, total + 2, counts, m, c)
    assert "a weight was changed" in check_secure_sum(arrays, 0, counts, m, c)
    count_only = np.ones(len(updates[0][1]))
    count_only[0] = 1.5  # slot 0: 1.5 clients
    liar = [updates[0][0], updates[0][1] * count_only]
    arrays, total = flower_secure_sum([liar, *updates[1:]], counts, m, c)
    assert "count slot sums to 3.5 clients" in check_secure_sum(arrays, total, counts, m, c)


def test_honest_updates_at_the_bound_pass_and_one_client_beyond_it_does_not():
    """Flower's own quantizer is the truth. Three clients whose updates all have norm
    exactly B, in one direction (the mean's norm is then exactly B: the worst case),
    pass the mean's bound check at every rounding; one client whose update is 1.5 B
    inside its mask (its coordinates still inside the quantizer's range) is refused."""
    rng = np.random.default_rng(1)
    counts, m, bound = [10, 20, 30], 30.0, 0.01
    direction = rng.normal(size=(40, 25))
    direction /= np.linalg.norm(direction)
    c = quantizer_range(8.0, bound, 0.0, 0.0)  # dp-clip = B, no noise
    assert c == bound and np.abs(direction).max() * bound <= c
    reference = [rng.normal(size=(40, 25)).astype(np.float32)]

    def tails():
        return [encode_tail({"accuracy": 0.5}, n, tail_scale(c, m))[0] for n in counts]

    for _ in range(5):
        updates = [[bound * direction, t] for t in tails()]
        arrays, total = flower_secure_sum(updates, counts, m, c)
        assert check_secure_sum(arrays, total, counts, m, c) is None
        assert bad_mean_update(arrays[:-1], reference, bound, "dp-clip", 3, total, c) is None
    liar = [[1.5 * bound * direction, t] if i == 2 else [bound * direction, t]
            for i, t in enumerate(tails())]
    arrays, total = flower_secure_sum(liar, counts, m, c)
    assert check_secure_sum(arrays, total, counts, m, c) is None  # inside every range
    reason = bad_mean_update(arrays[:-1], reference, bound, "dp-clip", 3, total, c)
    assert "the decoded mean update has norm 0.0125, above 0.01, the bound dp-clip" in reason


def test_one_secure_client_moves_the_model_no_further_than_a_bounded_update(micro_mnist_dir,
                                                                           tmp_path):
    """Issue 29 (1): with dp-clip = 1e-4 on the honest clients, one client scaling what
    it sends inside its mask (within the quantizer's range of +-8; replayed here by
    ``faults = "secure-scale=1000@0"``) was accepted with a mean update of norm 233.
    Now the clients send updates quantized in +-dp-clip, and the decoded mean update
    must lie within dp-clip of the global model and within what the clients' reported
    norms allow (issue 47): the round is refused and the model kept. Without the attacker the secure round gives the plain FedAvg of
    the clipped updates within 1e-3 of the update's norm, plus the float32 rounding of
    the weights (2^-22 of their norm); before, quantizing the weights in +-8 put an
    error of up to 4e-6 on each of them, about 1e-4 over LeNet's 44k: more than the
    update itself."""
    keys = {"dp-clip": 1e-4, "diagnostics": False}
    secure = micro_config(micro_mnist_dir, tmp_path / "s", **SECURE, **keys)
    plain = micro_config(micro_mnist_dir, tmp_path / "p", **keys)
    fields, params = secure_round(secure, InProcessGrid(client_app, secure, 4))
    _, want = plain_round(plain, InProcessGrid(client_app, plain, 4))
    cfg = load_run_config(plain)
    init = get_weights(initial_model(cfg, partition_data(cfg, 0, CPU).data.task))
    got, want = parameters_to_ndarrays(params), parameters_to_ndarrays(want)
    moved = np.sqrt(sum(np.sum((w.astype(np.float64) - g) ** 2) for w, g in zip(want, init)))
    error = np.sqrt(sum(np.sum((a.astype(np.float64) - w) ** 2) for a, w in zip(got, want)))
    size = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in init))
    assert 0 < moved <= 1e-4 * (1 + 1e-5) and error <= 1e-3 * moved + 2.0**-22 * size
    attacked = {**secure, "faults": "secure-scale=1000@0"}
    fields, params = secure_round(attacked, InProcessGrid(client_app, attacked, 4))
    assert params is None and fields["skipped"]
    assert "the decoded mean update has norm" in fields["refused_sum"]
    # 1000 x an honest norm is above dp-clip, and above the clients' reports first
    assert "longer than it reports" in fields["refused_sum"]
    assert "that dp-clip sets" in fields["refused_sum"]


@pytest.mark.parametrize("aggregation, values, clients, bound", [
    ("median", [0.2, 0.5, 0.9], [3, 3, 4], 0.7),  # the middle group: 0.9 - 0.2
    ("median", [0.2, 0.5, 0.9, 0.6, 0.55], [3] * 5, 0.1),  # 0.6 - 0.5
    ("mean", [0.2, 0.5, 0.9], [3, 3, 4], 0.4),  # the largest group's share
    ("mean", [0.3], [9], 1.0),  # one sum: anywhere in [0, 1]
], ids=["median-of-3", "median-of-5", "mean-of-3", "one-group"])
def test_one_clients_pull_on_a_t_is_bounded_by_the_other_groups(aggregation, values,
                                                                  clients, bound):
    """Hand-computed: a client sets its own group's mean anywhere in [0, 1]; the median
    of the groups' means then stays between the other groups' means around it."""
    assert pull_bound(values, clients, aggregation) == pytest.approx(bound)
    assert group_accuracy([0.2, 0.5, 0.9], [3, 3, 4], "mean") == pytest.approx(0.57)


def test_one_client_moves_a_t_only_within_the_spread_of_the_other_groups(micro_mnist_dir,
                                                                         tmp_path):
    """Issue 29 (1): one secure client set A(t) to exactly 1.0 (a spike moved T_e from
    none to 9). The attacker here knows every other client's accuracy (the worst case)
    and adds, inside its mask, what sets its sum's mean accuracy to exactly 1.0. With
    one sum (secure-groups = 1) A(t) becomes 1.0, and the record says one client could
    have put it anywhere (A_pull_bound 1). With secure-groups = 3 and
    accuracy-aggregation = median, the nine clients are summed in three groups under
    separate masks: A(t) is the median of
    the groups' means (each the mean of its clients' accuracies in a plain round, the
    truth here), the model still the FedAvg of all nine, and the attacker moves A(t) by
    no more than the recorded A_pull_bound, the spread of the other two groups' means."""
    n, keys = 9, {"diagnostics": False}
    plain = micro_config(micro_mnist_dir, tmp_path / "p", n, **keys)
    truth, want = plain_round(plain, InProcessGrid(client_app, plain, n))
    acc = dict(zip(truth["partition_ids"], truth["client_acc"]))
    grouped = micro_config(micro_mnist_dir, tmp_path / "g", n, **SECURE, **keys, **{
        "secure-groups": 3, "accuracy-aggregation": "median"})
    honest, params = secure_round(grouped, InProcessGrid(client_app, grouped, n))
    groups = honest["secure_groups"]
    assert sorted(p for g in groups for p in g) == list(range(n)) and len(groups) == 3
    means = [float(np.mean([acc[p] for p in g])) for g in groups]
    assert honest["A_groups"] == pytest.approx(means, abs=1e-6)
    assert honest["A"] == pytest.approx(float(np.median(means)), abs=1e-6)
    low, _, high = sorted(means)
    assert honest["A_pull_bound"] == pytest.approx(high - low, abs=1e-5)
    for got, w in zip(parameters_to_ndarrays(params), parameters_to_ndarrays(want)):
        np.testing.assert_allclose(got, w, atol=2e-5)
    [own] = [g for g in groups if 0 in g]
    excess = len(own) - sum(acc[p] for p in own)  # added to its sum: its group's mean is 1
    faults = {"faults": f"secure-acc={excess!r}@0@1"}
    attacked, _ = secure_round({**grouped, **faults},
                               InProcessGrid(client_app, {**grouped, **faults}, n))
    assert attacked["A_groups"][groups.index(own)] == pytest.approx(1.0, abs=1e-5)
    assert abs(attacked["A"] - honest["A"]) <= honest["A_pull_bound"] + 1e-5
    faults = {"faults": f"secure-acc={n - sum(acc.values())!r}@0@1"}  # the mean becomes 1
    single = micro_config(micro_mnist_dir, tmp_path / "s", n, **SECURE, **keys, **faults)
    one, _ = secure_round(single, InProcessGrid(client_app, single, n))
    assert one["A"] == pytest.approx(1.0, abs=1e-5) and one["A_pull_bound"] == 1.0
    assert 1.0 - np.mean(list(acc.values())) > honest["A_pull_bound"]
    with pytest.raises(ConfigError, match="secure-groups=3 needs secure-aggregation=true"):
        load_run_config({"secure-groups": 3})


def plain_round_at(flat: dict, server_round: int, weights: list[np.ndarray]):
    """Round ``server_round`` without secure aggregation from ``weights``: its params."""
    cfg = load_run_config(flat)
    grid = InProcessGrid(client_app, flat, cfg.num_clients)
    sizes = [len(partition_data(cfg, k, CPU)) for k in range(cfg.num_clients)]
    driver = RoundDriver(make_pipeline(cfg, plan_sizes=sizes, max_private=10**6))
    params = ndarrays_to_parameters(weights)
    results, failures = [], []
    for proxy, ins in driver.configure_fit(server_round, params, grid.manager()):
        try:
            results.append((proxy, proxy.fit(ins, None, server_round)))
        except NodeFailed as err:  # the round's proxy names a failed client
            failures.append(err)
    new, _ = driver.aggregate_fit(server_round, results, failures)
    return driver.fields(), parameters_to_ndarrays(new)


def test_a_secure_run_with_one_adversarial_client_completes_with_the_honest_result(
        micro_mnist_dir, tmp_path):
    """Client 0 lies in every way the mask allows, one per round: its accuracy (round
    1), its weight (round 2), its whole vector (round 3), an unreadable vector (round
    4). The run completes. Round 1 is refused (the global model kept, no A(t)); the
    culprit search then sums three of the four clients and leaves one out: round 2's
    group holds client 0 and is refused, round 3's leaves it out and is applied; in
    round 4 its unreadable vector stops its group before the sum, and the round is
    summed again without it. Rounds 3 and 4 give the honest clients' FedAvg, round by
    round (the truth: the same rounds without secure aggregation, client 0 failing)."""
    faults = "secure-acc=410@0@1;weight=1000@0@2;garbage@0@3;garbage-bytes@0@4"
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, faults=faults, rounds=4,
                        prestopping=False)
    secure_loop(flat, tmp_path)
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4]
    for r in recs[1:3]:
        assert r["skipped"] and r["refused_sum"] and r.get("A") is None
    assert {r["test_acc"] for r in recs[:3]} == {recs[0]["test_acc"]}  # the model kept
    assert recs[2]["culprit_search"]["groups"] == [[0, 1, 3]]
    assert recs[3]["culprit_search"]["left_out"] == [0]
    last = recs[4]
    assert last["culprit_search"]["tried"] == [[0, 2, 3]] and last["secure_attempts"] == 3
    assert last["rejected_reasons"][0]["reason"] == "unreadable masked vector (ValueError)"
    for r in recs[3:]:
        assert r["partition_ids"] == [1, 2, 3] and 0 <= r["A"] <= 1
    cfg = load_run_config(flat)
    weights = get_weights(initial_model(cfg, partition_data(cfg, 0, CPU).data.task))
    crash = {**flat, "faults": "raise@0", "secure-aggregation": False}
    for rnd in (3, 4):
        honest, weights = plain_round_at(crash, rnd, weights)
        assert honest["partition_ids"] == [1, 2, 3]
        assert recs[rnd]["A"] == pytest.approx(np.mean(honest["client_acc"]), abs=1e-5)
    got = torch.load(tmp_path / "model.pt")
    for name, w in zip(got, weights):
        np.testing.assert_allclose(got[name].numpy(), w, atol=4e-5)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "degraded" and summary["refused_rounds"] == [1, 2]
    assert summary["degraded"].startswith("2 of 4 rounds refused (rounds 1-2): each kept "
                                          "the global model; last: ")


def test_a_secure_run_whose_model_never_changed_fails_and_says_why(micro_mnist_dir,
                                                                    tmp_path):
    """Issue 58: a client that breaks every round's sum (``secure-scale=1000@0`` with
    the defaults) kept the initial model for the whole run, and the run ended
    ``completed``, "client failures 0, rejected replies 0". Now such a run fails: its
    summary says ``failed`` and why, it writes no model, and its closing line is RUN
    FAILED."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, diagnostics=False,
                        faults="secure-scale=1000@0", rounds=2, prestopping=False)
    with pytest.raises(fedefc_server.round_loop.RunFailed, match="never changed"):
        secure_loop(flat, tmp_path)
    assert all(r["skipped"] and r["refused_sum"] for r in records(tmp_path)[1:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["refused_rounds"] == [1, 2]
    assert summary["failure"].startswith("the global model never changed: each of the 2 "
                                         "rounds kept it (round 2: the decoded mean update")
    assert not (tmp_path / "model.pt").exists()
    lines = [text for _, text in summary_lines(summary)]
    assert lines[-1].startswith("RUN FAILED: the global model never changed")
    assert "refused rounds 2 (global model kept)" in lines[0]


def test_refused_rounds_make_a_completed_run_degraded_in_its_summary_and_closing_lines():
    """A run some of whose secure rounds were refused still delivers a model, but its
    status is ``degraded``: the summary counts the refused rounds and says the last
    reason, the SUMMARY line counts them, the closing line is RUN DEGRADED."""
    cfg = load_run_config({"dataset": "mnist", "data-dir": "/data", "num-clients": 4,
                           "fraction": 1.0, "secure-aggregation": True})
    ok = {"n_clients": 4, "partition_ids": [0, 1, 2, 3]}
    rounds = [{"round": 0}, {"round": 1, **ok},
              {"round": 2, **ok, "skipped": True, "refused_sum": "a weight was changed"},
              {"round": 3, **ok, "n_clients": 0, "skipped": True,
               "secure_refused": "2 clients left"}, {"round": 4, **ok}]
    summary = {**build_summary(cfg, rounds, RunFacts({}, {})), "out_dir": "/r"}
    assert summary["status"] == "degraded" and summary["refused_rounds"] == [2, 3]
    assert summary["degraded"] == ("2 of 4 rounds refused (rounds 2-3): each kept the "
                                   "global model; last: 2 clients left")
    lines = [text for _, text in summary_lines(summary)]
    assert "refused rounds 2 (global model kept)" in lines[0]
    assert lines[-1] == "RUN DEGRADED: " + summary["degraded"]
    assert "  rounds refused: 2 (2-3), each kept the global model (reasons: " \
           "metrics.jsonl)" in run_report(summary)
    honest = build_summary(cfg, [r for r in rounds if r["round"] in (0, 1, 4)],
                           RunFacts({}, {}))
    assert honest["status"] == "completed" and honest["refused_rounds"] == []


@pytest.mark.parametrize("fault", ["secure-scale=1000@0", "other-seed@0"])
def test_the_client_that_breaks_every_sum_is_named_and_left_out_and_the_run_goes_on(
        micro_mnist_dir, tmp_path, fault):
    """Issue 58 (1): one client of six scales its update 1000-fold inside its mask in
    every round (``secure-scale=1000@0``, the defaults), or (3) deals consistent,
    verifiable shares of another mask seed than the one it masks with
    (``other-seed``). Before, every round's sum was refused, the model never moved, and
    nobody was named. Now round 1 is refused, the next rounds are summed in groups of
    at least min-secure-clients (3) that halve the suspects, and partition 0 is named
    and left out within ceil(log2 6) + 2 = 5 rounds; every group without it is applied,
    and the run trains on with the five others."""
    flat = micro_config(micro_mnist_dir, tmp_path, 6, **SECURE, diagnostics=False,
                        faults=fault, rounds=5, prestopping=False)
    secure_loop(flat, tmp_path)
    recs = records(tmp_path)[1:]
    assert recs[0]["refused_sum"] and recs[0]["culprit_search"] == {
        "found": "suspects [0, 1, 2, 3, 4, 5]: each refused sum since round 1 held one of them"}
    [named_at] = [r["round"] for r in recs if "named" in r.get("culprit_search", {})]
    assert named_at <= 1 + 3 + 1  # within ceil(log2 6) + 2 rounds of the first
    named = recs[named_at - 1]["culprit_search"]
    assert named["named"] == {"partition": 0, "node": "1000"}
    for r in recs[1:named_at]:  # each search round: groups of at least 3, one refused
        groups = r["culprit_search"]["groups"]
        assert all(len(g) >= 3 for g in groups)
        refused = [g["partitions"] for g in r["refused_groups"]]
        assert [g for g in groups if 0 in g] == refused
        assert r["partition_ids"] == sorted(p for g in groups for p in g if 0 not in g)
    for r in recs[named_at:]:  # left out: the others train as one sum
        assert r["partition_ids"] == [1, 2, 3, 4, 5] and not r.get("skipped")
        [missing] = r["missing"]
        assert missing["partition"] == 0 and "left out of the run: partition 0 is the one " \
            "client in every sum refused since round 1" in missing["reason"]
    assert any(n["node"] == "1000" for r in recs for n in r.get("refused_nodes", []))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "degraded" and summary["refused_rounds"] == [1]


def test_the_culprit_search_halves_the_suspects_and_names_only_the_one_left():
    """The search's rule (fedefc_server/culprit_search.py), by hand: a refused sum of six
    starts it; each round's test group holds half of the suspects filled up to three; a
    refused group's members intersected with the suspects are the new suspects; one
    left is named. Two refused groups in a round (not one liar) stop it naming no one;
    a refusal the suspects had no part in starts it again; ceil(log2 K) + 2 rounds
    without a refusal end it (K the clients of the sum that started it: 4 for 3);
    rounds of three clients are not split."""
    search = CulpritSearch()
    assert search.groups(list(range(6)), 3, 0, 1) is None  # no search: one sum
    assert search.after(1, [list(range(6))]) == (
        None, "suspects [0, 1, 2, 3, 4, 5]: each refused sum since round 1 held one of them")
    test, rest = search.groups(list(range(6)), 3, 0, 2)
    assert len(test) == len(rest) == 3 and sorted(test + rest) == list(range(6))
    assert search.after(2, [test])[0] is None and search.suspects == test
    groups = search.groups(list(range(6)), 3, 0, 3)
    assert [len(g) for g in groups] == [3, 3]
    [with_one] = [g for g in groups if len(set(g) & set(test)) == 1]
    named, found = search.after(3, [with_one])
    assert named == (set(with_one) & set(test)).pop() and search.suspects == []
    assert found == (f"partition {named} is the one client in every sum refused since round "
                     "1: it broke them from inside its mask")
    search.after(4, [[0, 1, 2]])
    assert search.after(5, [[0, 3, 4], [1, 2, 5]]) == (None, (
        "two sums of this round were refused: more than one client broke them, or the "
        "update bound is too small for this model; the search names no one"))
    assert search.suspects == [] and search.groups(list(range(6)), 3, 0, 6) is None
    search.after(6, [[0, 1, 2]])
    search.after(7, [[3, 4, 5]])  # the suspects had no part in it: it starts again
    assert search.suspects == [3, 4, 5] and search.since == 7
    assert search.groups([0, 1, 2], 3, 0, 8) is None  # nothing smaller than the round
    assert search.groups(list(range(6)), 3, 0, 11) is not None
    assert search.groups(list(range(6)), 3, 0, 12) is None and search.suspects == []
    assert CulpritSearch.of(CulpritSearch([1, 2], 4, 5, 3).state()) == CulpritSearch(
        [1, 2], 4, 5, 3)


# -- malformed secure replies: failures, never a crash --------------------------------------
@pytest.mark.parametrize("fault, partitions, reason", [
    ("garbage-bytes@0@1", [1, 2, 3], "unreadable masked vector (ValueError)"),
    ("unmask-nid=999@1@1", [0, 1, 2, 3], "unmask reply naming node ids it was not asked "
                                          "about ([999])"),
    ("bad-key@2@1", [0, 1, 3], "setup reply whose pk1 is no PEM public key"),
    ("self-share@2@1", [0, 1, 3], "share-keys reply addressing a share to its own node"),
], ids=["unreadable-vector", "bogus-unmask-node", "garbage-setup-key", "share-to-itself"])
def test_a_malformed_secure_reply_is_refused_not_a_crash(micro_mnist_dir, tmp_path, fault,
                                                          partitions, reason):
    """An unreadable masked vector: refused, the round starts again without its node.
    An unmask reply naming a node id it was not asked about (a KeyError inside
    Flower's workflow at 28de8bc): refused, its shares unused; the others' suffice. A
    garbage setup key, or a share addressed to its own node: at cae5715 each made the
    whole round fail naming no one (issue 29, finding 4: every other client failed on
    the key; the share went missing); now the node is named and drops out before it
    sends a vector, and the round sums the others."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, faults=fault)
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert params is not None and fields["partition_ids"] == partitions
    assert [r["reason"] for r in fields["rejected_reasons"]] == [reason]
    assert 0 <= fields["A"] <= 1


# -- identity and partitions -----------------------------------------------------------------
def keypair() -> tuple[bytes, str]:
    """(the public key as Flower stores it (PEM), its OpenSSH line (key.pub))."""
    public = ec.generate_private_key(ec.SECP384R1()).public_key()
    pem = public.public_bytes(serialization.Encoding.PEM,
                              serialization.PublicFormat.SubjectPublicKeyInfo)
    line = public.public_bytes(serialization.Encoding.OpenSSH,
                               serialization.PublicFormat.OpenSSH).decode()
    return pem, line


def write_allowlist(path, entries: list[dict]) -> str:
    lines = []
    for entry in entries:
        lines += ["[[node]]", *(f"{k} = {json.dumps(v)}" for k, v in entry.items())]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def federation(micro_mnist_dir, tmp_path, n: int, listed: dict[int, dict], **extra):
    """``n`` in-process nodes with keys, an allowlist with ``listed`` {k: entry fields}
    (partition k of the run's data by default), and the pipeline of the run."""
    keys = {1000 + k: keypair() for k in range(n)}
    entries = [{"public-key": keys[1000 + k][1], "partition-id": k, "data": "partition",
                "max-samples": 20, **fields} for k, fields in listed.items()]
    path = write_allowlist(tmp_path / "allowlist.toml", entries)
    flat = micro_config(micro_mnist_dir, tmp_path / "out", n, allowlist=path, **extra)
    grid = InProcessGrid(client_app, flat, n,
                         public_keys={nid: pem for nid, (pem, _) in keys.items()})
    cfg = load_run_config(flat)
    sizes = [len(partition_data(cfg, k, CPU)) for k in range(n)]
    return grid, make_pipeline(cfg, plan_sizes=sizes, max_private=10**6,
                               allowlist=Allowlist.load(path, n))


@pytest.mark.parametrize("fault, liar, claimed, own", [
    ("claim=0@3", "1003", 0, 3), ("claim=3@0", "1000", 3, 0)],
    ids=["liar-second", "liar-first"])
def test_only_listed_keys_join_and_none_takes_another_partition(micro_mnist_dir, tmp_path,
                                                                fault, liar, claimed, own):
    """Nodes 1000-1003 are listed for partitions 0-3, node 1004 is not. A listed node
    claiming another's partition (with that partition's public plan size) is refused
    whatever the order of arrival; the unlisted key is refused."""
    grid, pipeline = federation(micro_mnist_dir, tmp_path, 5, {k: {} for k in range(4)},
                                faults=fault)
    serving = pipeline.federation.serving(grid.manager(), 1)
    assert {pid: p.cid for pid, p in serving.items()} == {
        k: str(1000 + k) for k in range(4) if k != own}
    refused = {r["node"]: r["reason"] for r in pipeline.registry.take_news()["refused_nodes"]}
    assert refused[liar] == (f"declares partition {claimed}, but the allowlist gives its key "
                             f"partition {own}")
    assert re.fullmatch(r"its public key \(SHA256:[A-Za-z0-9+/]{43}\) is not on the allowlist",
                        refused["1004"])


def test_a_private_node_declares_at_most_its_allowlist_entry(micro_mnist_dir, tmp_path):
    """Node 1002 declares private data with 4,000 samples (at 28de8bc this skipped the
    exact-size check); its entry says partition data: refused. Node 1003 is listed as
    private with at most 30: 4,000 is refused, its own 20 accepted."""
    grid, pipeline = federation(micro_mnist_dir, tmp_path, 4,
                                {0: {}, 1: {}, 2: {}, 3: {"data": "private", "max-samples": 30}},
                                faults="private=4000@2-3")
    registry = pipeline.registry
    pipeline.federation.serving(grid.manager(), 1)
    reasons = {r["node"]: r["reason"] for r in registry.take_news()["refused_nodes"]}
    assert reasons == {"1002": "declares private data, but the allowlist says partition",
                       "1003": "declares 4000 samples, above its allowlist entry's "
                               "max-samples 30"}
    honest = {"partition-id": 3, "num-examples": 20, "data": "private", "held-out": 0}
    assert registry.admit("1003", honest, grid.public_keys[1003]) is None


def test_without_an_allowlist_a_second_claim_never_replaces_the_holder(micro_mnist_dir,
                                                                       tmp_path):
    """Node 1003 claims partition 0 with its public plan size after node 1000 did: at
    28de8bc it replaced node 1000; now it is refused while node 1000 is connected."""
    flat = micro_config(micro_mnist_dir, tmp_path, faults="claim=0@3")
    grid = InProcessGrid(client_app, flat, 4)
    cfg = load_run_config(flat)
    pipeline = make_pipeline(cfg, plan_sizes=[len(partition_data(cfg, k, CPU))
                                              for k in range(4)], max_private=10**6)
    serving = pipeline.federation.serving(grid.manager(), 1)
    assert {pid: p.cid for pid, p in serving.items()} == {0: "1000", 1: "1001", 2: "1002"}
    [refused] = pipeline.registry.take_news()["refused_nodes"]
    assert refused == {"node": "1003", "partition": 0, "reason": (
        "partition 0 is served by node 1000; a second node may take it only once that one "
        "has left")}


def test_an_evaluation_reply_counts_exactly_its_declared_held_out_samples(micro_mnist_dir,
                                                                          tmp_path):
    """Node 0 reports the training set's size as its held-out count (within the global
    bound of 28de8bc, where it outweighed every other node): refused; the federated
    accuracy is the others' weighted mean."""
    flat = micro_config(micro_mnist_dir, tmp_path, evaluation="both",
                        **{"local-test-fraction": 0.25})
    cfg = load_run_config(flat)
    train = len(partition_data(cfg, 0, CPU).data.train_y)
    flat["faults"] = f"eval-samples={train}@0"
    grid = InProcessGrid(client_app, flat, 4)
    parts = [len(ix) for ix in data_plan(cfg).client_indices]
    pipeline = make_pipeline(cfg, plan_sizes=[n - held_out_count(cfg, n) for n in parts],
                             plan_held_out=[held_out_count(cfg, n) for n in parts],
                             max_private=train)
    init = get_weights(initial_model(cfg, partition_data(cfg, 0, CPU).data.task))
    plan = pipeline.evaluation.plan(0, ndarrays_to_parameters(init), grid.manager())
    results = [(proxy, proxy.evaluate(ins, None, 0)) for proxy, ins in plan.instructions]
    fields, _, metrics = pipeline.evaluation.close(plan, results, [])
    held = held_out_count(cfg, parts[0])
    assert [r["reason"] for r in fields["federated_rejected_reasons"]] == [
        f"held-out sample count {train} differs from the {held} held-out samples its node "
        "declared"]
    others = [res for proxy, res in results if proxy.cid != "1000"]
    want = np.average([r.metrics["accuracy"] for r in others],
                      weights=[r.num_examples for r in others])
    assert fields["federated_acc"] == pytest.approx(want)
    assert fields["federated_samples"] == sum(r.num_examples for r in others)


# -- declarations bounded in every mode (issue 29, finding 3) -------------------------------
def test_without_an_allowlist_a_nodes_declaration_is_bounded_by_the_largest_partition(
        micro_mnist_dir, tmp_path):
    """At 6a260ce a private declaration was bounded by the whole training set (a node
    declaring 60,000 of MNIST's samples, plan 3,000, took 51 % of FedAvg's weight among
    20). With max-client-samples = 0 the run's bound is now the data plan's largest
    training and held-out sizes: node 1001 declares exactly them (accepted), node 1002
    the whole training set, node 1003 one held-out sample more; each refused node is
    named with its reason in the round's record."""
    flat = micro_config(micro_mnist_dir, tmp_path, evaluation="both",
                        **{"local-test-fraction": 0.25})
    cfg = load_run_config(flat)
    parts = [len(ix) for ix in data_plan(cfg).client_indices]
    most = max(n - held_out_count(cfg, n) for n in parts)
    most_held = max(held_out_count(cfg, n) for n in parts)
    train = len(data_plan(cfg).true_labels)
    assert train > most > 0 and most_held > 0
    flat["faults"] = (f"private={most}@1;held-out={most_held}@1;private={train}@2;"
                      f"private={most}@3;held-out={most_held + 1}@3")
    grid = InProcessGrid(client_app, flat, 4)
    pipeline = make_pipeline(cfg)
    pipeline.registry.rule = SizeRule.for_run(cfg, data_plan(cfg))
    serving = pipeline.federation.serving(grid.manager(), 1)
    assert {pid: p.cid for pid, p in serving.items()} == {0: "1000", 1: "1001"}
    news = pipeline.registry.take_news()
    assert news["declared"] == {0: parts[0] - held_out_count(cfg, parts[0]), 1: most}
    source = "the data plan's largest partition, as max-client-samples = 0"
    assert news["refused_nodes"] == [
        {"node": "1002", "partition": 2, "reason": f"declares {train} samples, above the "
         f"bound {most} ({source}); raise max-client-samples if nodes hold more"},
        {"node": "1003", "partition": 3, "reason": f"declares {most_held + 1} held-out "
         f"samples, above the bound {most_held} ({source}); raise max-client-samples if "
         "nodes hold more"}]


def test_the_bound_on_declarations_is_the_coordinators_key_or_the_plans_largest_partition():
    """Hand-computed: partitions of 30, 50 and 20 samples, a quarter held out (Python's
    round: 7.5 -> 8, 12.5 -> 12, 5): trained on 22, 38, 15. The default bounds a
    declaration by 38 and 12; max-client-samples = 100 bounds both counts by 100; with an
    allowlist the derived bound yields to the node's entry, the key does not."""
    cfg = load_run_config({"num-clients": 3, "evaluation": "both", "local-test-fraction": 0.25})
    plan = SimpleNamespace(client_indices=[np.arange(30), np.arange(50), np.arange(20)])
    rule = SizeRule.for_run(cfg, plan)
    assert (rule.plan_sizes, rule.plan_held_out) == ([22, 38, 15], [8, 12, 5])
    assert (rule.max_private, rule.held_out_bound) == (38, 12)
    private = lambda n, held: Declaration(1, n, "private", held)  # noqa: E731
    assert rule.vet(private(38, 12)) is None
    assert "declares 39 samples, above the bound 38" in rule.vet(private(39, 12))
    assert "declares 13 held-out samples, above the bound 12" in rule.vet(private(38, 13))
    assert rule.vet(Declaration(1, 38, "partition", 12)) is None  # the plan's, exactly
    keyed = SizeRule.for_run(load_run_config({**cfg.to_flat(), "max-client-samples": 100}),
                             plan)
    assert (keyed.max_private, keyed.held_out_bound) == (100, 100)
    assert keyed.vet(private(100, 100)) is None
    assert "above the bound 100 (max-client-samples)" in keyed.vet(private(101, 0))
    entry = AllowedNode.model_validate({"public-key": "SHA256:a", "partition-id": 1,
                                        "data": "private", "max-samples": 500,
                                        "held-out-samples": 50})
    assert rule.vet(private(400, 40), entry) is None
    assert "above the bound 100" in keyed.vet(private(400, 40), entry)
    assert "max-samples 500" in rule.vet(private(501, 40), entry)
    assert SizeRule.for_run(cfg, None).max_private is None  # no plan, no key: no bound


def test_a_deployment_without_an_allowlist_runs_only_when_the_coordinator_opens_it():
    """The admission mode (docs/THREAT-MODEL.md, "Identity and partitions"): at 6a260ce a
    deployment without an allowlist admitted any node, its private declarations bounded
    by 10^8 when the server held no data. Now it is refused unless open-deployment =
    true, and every mode but the allowlist needs a bound on what a node declares."""
    cfg = load_run_config({"num-clients": 3})
    bounded = SizeRule(3, None, 700)
    with pytest.raises(ConfigError) as err:
        admission(cfg, False, bounded)
    assert "set allowlist" in str(err.value) and "open-deployment = true" in str(err.value)
    opened = load_run_config({"num-clients": 3, "open-deployment": True})
    assert admission(opened, False, bounded) == {
        "mode": "open-deployment", "max_declared_samples": 700, "max_declared_held_out": 700,
        "bound": "max-client-samples"}
    assert admission(cfg, True, SizeRule(3, [5, 9, 7], 9, [1, 2, 1], 2, derived=True)) == {
        "mode": "simulation", "max_declared_samples": 9, "max_declared_held_out": 2,
        "bound": "the data plan's largest partition, as max-client-samples = 0"}
    for config, simulation in ((opened, False), (cfg, True)):
        with pytest.raises(ConfigError, match="no bound on what one node declares can be "
                                              "derived from the run.*set max-client-samples"):
            admission(config, simulation, SizeRule(3, None, None))
    listed = load_run_config({"num-clients": 3, "allowlist": "/etc/fedefc/allowlist.toml"})
    assert admission(listed, False, SizeRule(3, None, None))["bound"] == \
        "each node's allowlist entry"
    with pytest.raises(ConfigError, match="open-deployment=true and allowlist="):
        load_run_config({"allowlist": "/etc/a.toml", "open-deployment": True})


def test_the_server_app_refuses_an_unopened_deployment_and_tells_its_mode(tmp_path):
    """build() before round 1: without a simulation's grid and without an allowlist the
    run fails naming the keys; opened, the summary and its log line say which mode ran.
    Flower's simulation grid (also under a dishonest server's) is told apart."""
    flat = {"dataset": "npz", "evaluation": "federated", "num-classes": 3,
            "input-shape": "1x4x4", "model": "tests.own_models:tiny_cnn", "num-clients": 3,
            "out-dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match="a deployment without an allowlist"):
        fedefc_server.server_app.build(Context(1, 0, {}, RecordDict(), flat), None)
    assert not (tmp_path / "out").exists()
    opened = {**flat, "open-deployment": True, "max-client-samples": 250}
    loop, _ = fedefc_server.server_app.build(Context(1, 0, {}, RecordDict(), opened), None)
    admitted = loop.run_info["admission"]
    assert admitted["mode"] == "open-deployment" and admitted["max_declared_samples"] == 250
    summary = {**build_summary(load_run_config(opened), [], RunFacts(loop.run_info, {})),
               "out_dir": "/r"}
    assert summary["admission"] == admitted
    assert ("nodes admitted: any node that connected (open-deployment, no allowlist); "
            "declared sizes: at most 250 training and 250 held-out samples "
            "(max-client-samples)") in [text for _, text in summary_lines(summary)]
    simulated = object.__new__(InMemoryGrid)
    assert fedefc_server.server_app.is_simulation(simulated)
    assert fedefc_server.server_app.is_simulation(DishonestGrid(simulated, []))
    assert not fedefc_server.server_app.is_simulation(None)


# -- plain updates bounded by norm ----------------------------------------------------------
def norm_driver(**keys):
    driver = make_driver(**{"method": "fedavg", "num-clients": 3, "fraction": 1.0, **keys})
    nodes = partition_nodes(3)
    driver.configure_fit(1, PARAMS, manager(nodes))
    return driver, nodes


def update_of_norm(norm: float) -> list[np.ndarray]:
    """GLOBAL plus an update of L2 norm ``norm`` over its 17 float weights."""
    return [w + np.float32(norm / np.sqrt(17)) for w in GLOBAL]


@pytest.mark.parametrize("keys, accepted, refused", [
    ({"dp-clip": 1.0}, 1.0, 1.01),
    # with noise of multiplier 0.1 on 17 weights: 1 x (1 + 0.1 (sqrt(17) + 8)) = 2.2123
    ({"dp-clip": 1.0, "dp-noise-multiplier": 0.1}, 2.2, 2.23),
    ({"max-update-norm": 5.0}, 5.0, 5.01),
    ({"dp-clip": 1.0, "max-update-norm": 0.5}, 0.5, 0.51),
], ids=["dp-clip", "dp-clip-noised", "max-update-norm", "the-smaller"])
def test_the_server_verifies_the_clipping_norm_of_every_plain_update(keys, accepted, refused):
    driver, nodes = norm_driver(**keys)
    replies = [(nodes[0], FitRes(OK, ndarrays_to_parameters(update_of_norm(accepted)), 10,
                                 {"partition-id": 0})),
               (nodes[1], FitRes(OK, ndarrays_to_parameters(update_of_norm(refused)), 10,
                                 {"partition-id": 1})),
               (nodes[2], FitRes(OK, ndarrays_to_parameters(
                   [np.full_like(w, 1e30) for w in GLOBAL]), 10, {"partition-id": 2}))]
    driver.aggregate_fit(1, replies, [])
    fields = driver.fields()
    assert fields["partition_ids"] == [0]
    assert [r["reason"].split(" above ")[0] for r in fields["rejected_reasons"]] == [
        f"update norm {refused:.6g}", "update norm 4.12311e+30"]


def test_a_plain_update_of_huge_norm_is_refused_and_honest_clipped_noised_ones_pass(
        micro_mnist_dir, tmp_path):
    """Real clients with DP clipping and noise all pass the server's verification (no
    false refusal on LeNet's 44,426 weights); an update scaled 10^6-fold is refused by
    max-update-norm."""
    flat = micro_config(micro_mnist_dir, tmp_path, **{"dp-clip": 1.0,
                                                      "dp-noise-multiplier": 0.01})
    fields, _ = plain_round_at(flat, 1, init_weights(flat))
    assert fields["partition_ids"] == [0, 1, 2, 3] and fields["rejected"] == 0
    flat = micro_config(micro_mnist_dir, tmp_path, faults="scale=1e6@2@1",
                        **{"max-update-norm": 100.0})
    fields, _ = plain_round_at(flat, 1, init_weights(flat))
    assert fields["partition_ids"] == [0, 1, 3]
    assert "above 100, the bound max-update-norm sets" in fields["rejected_reasons"][0]["reason"]


def init_weights(flat: dict) -> list[np.ndarray]:
    cfg = load_run_config(flat)
    return get_weights(initial_model(cfg, partition_data(cfg, 0, CPU).data.task))


# -- the allowlist file ------------------------------------------------------------------------
def test_a_key_matches_its_entry_in_any_form_and_ssh_keygens_fingerprint():
    pem, line = keypair()
    assert fingerprint(pem) == fingerprint(line) == fingerprint(fingerprint(line))
    # known answer: `ssh-keygen -l -f` of this key printed this fingerprint
    known = ("ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBBEt2ByEa8u"
             "JUTjOFuvX3XzAFQqeNi0vZANzbJ87TRbRBueeYXiX6VN8KYNCz0CsJ7fzFE8K7PSIxw0RO42de+UaTi7Y"
             "xA3hiUbjJRPvExZN5H4B5GLNdbKTCLoEO3UC7A== site-a")
    assert fingerprint(known) == "SHA256:WtRWUOoZXUDNiVexE3F9Lyew0uMiPBmBBQKomikjunM"
    assert fingerprint(b"\x01" * 32) != fingerprint(line)  # a simulated node's random key


def test_a_node_key_is_matched_as_a_key_never_as_the_text_of_a_fingerprint(tmp_path):
    """Issue 29 (5): a node whose raw key bytes were the text ``SHA256:<fingerprint>`` of
    a listed key was found as that entry (the fingerprint function took the text for
    the fingerprint). Now a node's key is matched only once it parses as a key; entries
    may still be written as a fingerprint."""
    pem, line = keypair()
    listed = {"partition-id": 0, "data": "partition", "max-samples": 5}
    for form in (line, fingerprint(line)):
        allowlist = Allowlist.load(write_allowlist(tmp_path / "a.toml", [
            {"public-key": form, **listed}]), 4)
        assert allowlist.entry(pem).partition_id == 0
        assert allowlist.entry(fingerprint(line).encode()) is None
        assert allowlist.entry(b" " + fingerprint(line).encode()) is None


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("[[node]\n", "not valid TOML"),
    ('[[node]]\npublic-key = "ssh-rsa nonsense"\npartition-id = 0\ndata = "partition"\n'
     'max-samples = 5\n', "node.0.public-key: 'ssh-rsa nonsense'... is neither an OpenSSH"),
    ('[[node]]\npublic-key = "SHA256:a"\npartition-id = 0\ndata = "cloud"\nmax-samples = 5\n',
     "node.0.data: Input should be 'partition' or 'private'"),
    ('[[node]]\npublic-key = "SHA256:a"\npartition-id = 0\ndata = "partition"\nmax-samples = 5\n'
     '[[node]]\npublic-key = "SHA256:b"\npartition-id = 0\ndata = "partition"\nmax-samples = 5\n',
     "partition-id 0 appears in more than one entry"),
    ('[[node]]\npublic-key = "SHA256:a"\npartition-id = 9\ndata = "partition"\nmax-samples = 5\n',
     "partition-id 9 is outside 0..3"),
    ('[[node]]\npublic-key = "SHA256:a"\npartition-id = 0\ndata = "partition"\nmax-samples = 5\n'
     'held-out = 3\n', "node.0.held-out: Extra inputs are not permitted"),
], ids=["missing", "toml", "bad-key", "data-kind", "partition-twice", "outside", "typo"])
def test_a_bad_allowlist_is_refused_naming_the_entry_and_the_fix(tmp_path, content, message):
    path = tmp_path / "allowlist.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AllowlistError, match=re.escape(message)):
        Allowlist.load(str(path), 4)


def test_faults_of_the_attack_suite_parse_and_refuse_what_they_cannot_mean():
    faults = parse_faults("secure-acc=410@0@1;weight=1000@1;garbage@2;unmask-nid=999@3;"
                          "claim=0@3;private=4000@2;held-out=3@1;eval-samples=600@0;scale=1e6@2;"
                          "secure-scale=1000@0;secure-acc-set=1.0@1@2-3;bad-shares@2")
    assert [f.kind for f in faults][:3] == ["secure-acc", "weight", "garbage"]
    assert [f.kind for f in faults][-3:] == ["secure-scale", "secure-acc-set", "bad-shares"]
    issue_58 = parse_faults("label-shift=3@0;secure-ratio=4@0;unopenable=0@1;"
                            "other-commitment=1003@1@1;other-seed@2;empty-secret@2@3")
    assert [(f.kind, f.arg) for f in issue_58] == [
        ("label-shift", "3"), ("secure-ratio", "4"), ("unopenable", "0"),
        ("other-commitment", "1003"), ("other-seed", ""), ("empty-secret", "")]
    for bad in ("weight=1@0", "weight=2.5@0", "claim=x@0", "secure-acc=a@0",
                "secure-scale=x@0", "secure-acc-set@0", "label-shift=x@0", "unopenable@0",
                "secure-ratio@0"):
        with pytest.raises(ValueError, match="KIND@PIDS"):
            parse_faults(bad)
    server = parse_server_faults("clip=1e9@1-2;secagg-threshold=1;secagg-sample=2;unmask-both")
    assert [(f.kind, f.arg, f.rounds) for f in server] == [
        ("clip", "1e9", frozenset({1, 2})), ("secagg-threshold", "1", None),
        ("secagg-sample", "2", None), ("unmask-both", "", None)]
    for bad in ("clip", "clip=x", "secagg-threshold=1.5", "unmask-both=1", "raise@0",
                "clip=1@1@2"):
        with pytest.raises(ValueError, match=re.escape(f"server-faults entry {bad!r} is not "
                                                       "KIND[@ROUNDS]")):
            parse_server_faults(bad)
    with pytest.raises(ConfigError, match="server-faults entry 'clip' is not KIND"):
        load_run_config({"server-faults": "clip"})


def test_a_secure_run_with_a_scaling_client_keeps_the_honest_result(micro_mnist_dir, tmp_path):
    """The issue's done-when: ``faults = "secure-scale=1000@0"`` in a secure run with an
    update bound (dp-clip). With one sum per round every poisoned round is refused and
    the model stays the global one (at 6a260ce it was applied: the model moved by about
    400), so the run fails (issue 58: it never changed its model). With secure-groups = 3 of nine clients the attacker's group is refused and
    left out, and the round gives exactly the plain FedAvg of the six other clients
    (the truth: a plain round in which the attacker's group fails)."""
    keys = {"dp-clip": 1e-3, "diagnostics": False, "faults": "secure-scale=1000@0",
            "prestopping": False, "rounds": 2}
    flat = micro_config(micro_mnist_dir, tmp_path / "one", **SECURE, **keys)
    with pytest.raises(fedefc_server.round_loop.RunFailed, match="never changed"):
        secure_loop(flat, tmp_path / "one")
    recs = records(tmp_path / "one")
    for r in recs[1:]:
        assert r["skipped"] and "the decoded mean update has norm" in r["refused_sum"]
    grouped = micro_config(micro_mnist_dir, tmp_path / "g", 9, **SECURE, **keys,
                           **{"secure-groups": 3})
    fields, params = secure_round(grouped, InProcessGrid(client_app, grouped, 9))
    [own] = [g for g in fields["secure_groups"] if 0 in g]
    [refused] = fields["refused_groups"]
    assert refused["partitions"] == own
    assert "the decoded mean update has norm" in refused["reason"]
    others = sorted(set(range(9)) - set(own))
    assert fields["partition_ids"] == others
    crash = {**grouped, "secure-aggregation": False, "secure-groups": 1,
             "faults": f"raise@{','.join(map(str, own))}"}
    truth, want = plain_round_at(crash, 1, init_weights(crash))
    assert truth["partition_ids"] == others
    for got, w in zip(parameters_to_ndarrays(params), want):
        np.testing.assert_allclose(got, w, atol=1e-6)


def float_norm(arrays: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays
                             if a.dtype.kind == "f")))


def test_a_default_secure_run_refuses_a_client_scaling_its_update_1000_fold(micro_mnist_dir,
                                                                            tmp_path):
    """Issue 47 (3): ``faults = "secure-scale=1000@0"`` in a secure run with the
    defaults (no dp-clip, no max-update-norm). At 550afb3 the round was applied (the
    issue's replay: a mean update of norm 56 against 0.13 honest). Now the round's
    bound is secure-update-bound (1) x the global model's norm, every client reports its
    update's norm over it inside its tail, and the decoded mean update is refused as
    longer than those reports allow. The same round without the attacker passes, with
    its clients' mean ratio on record, and equals the round with no bound
    (secure-update-bound = 0) exactly: no honest update came near the bound."""
    flat = micro_config(micro_mnist_dir, tmp_path / "a", **SECURE, diagnostics=False,
                        faults="secure-scale=1000@0")
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert params is None and fields["skipped"]
    assert "a client's update is longer than it reports" in fields["refused_sum"]
    honest = {**flat, "faults": ""}
    fields, params = secure_round(honest, InProcessGrid(client_app, honest, 4))
    init = init_weights(honest)
    assert fields["update_bound"] == pytest.approx(float_norm(init), rel=1e-12)
    assert 0 < fields["update_ratio"] < 0.5
    unbounded = {**honest, "secure-update-bound": 0.0}
    _, free = secure_round(unbounded, InProcessGrid(client_app, unbounded, 4))
    for got, want in zip(parameters_to_ndarrays(params), parameters_to_ndarrays(free)):
        np.testing.assert_array_equal(got, want)


def test_the_default_bound_is_the_initial_models_norm_however_far_the_model_moves():
    """Issue 58 (2): the default bound was rho times the norm of the model each round
    sends, which a client pulling at the bound grew by 1.24 a round (4.4 x the initial
    norm by round 10). Now every round's bound, and the ``update-bound`` every training
    message carries, is rho times the initial model's norm, however the model moves
    (here it doubles), also after a resume (the ServerApp measures the initial model)."""
    cfg = load_run_config({"dataset": "mnist", "data-dir": "/data", "num-clients": 4,
                           "fraction": 1.0, "secure-aggregation": True,
                           "secure-update-bound": 0.5, "start-round": 0})
    init = [np.full((3, 4), 2.0, np.float32), np.array([7, 1])]  # float norm sqrt(48)
    nodes = partition_nodes(4, sizes=[100] * 4)
    pipeline = make_pipeline(cfg, plan_sizes=[100] * 4)
    for rnd, weights in ((1, init), (2, [init[0] * 2, init[1]]), (9, [init[0] * 30, init[1]])):
        plan = pipeline.plan(rnd, ndarrays_to_parameters(weights), manager(nodes))
        assert plan.expected.max_norm == pytest.approx(0.5 * np.sqrt(48), rel=1e-12)
        assert {ins.config["update-bound"] for _, ins in plan.instructions} == {
            plan.expected.max_norm}
    resumed = make_pipeline(cfg, plan_sizes=[100] * 4)
    resumed.initial_size = float_norm(init)
    plan = resumed.plan(10, ndarrays_to_parameters([init[0] * 30, init[1]]), manager(nodes))
    assert plan.expected.max_norm == pytest.approx(0.5 * np.sqrt(48), rel=1e-12)


@pytest.mark.parametrize("keys, text", [
    ({"secure-aggregation": True}, "secure-update-bound = 1: each update at most 1 x the "
     "initial model's norm, the decoded mean no longer than its clients' reported norms allow"),
    ({"secure-aggregation": True, "secure-update-bound": 0.0},
     "none (secure-update-bound = 0)"),
    ({"secure-aggregation": True, "max-update-norm": 2.5}, "max-update-norm = 2.5"),
    ({"dp-clip": 0.5, "dp-noise-multiplier": 1.1, "max-update-norm": 3.0},
     "dp-clip = 0.5 with dp-noise-multiplier = 1.1 and max-update-norm = 3"),
    ({}, "none")],
    ids=["secure-default", "secure-unbounded", "max-update-norm", "dp-and-norm", "plain"])
def test_the_summary_says_which_bound_the_runs_updates_had(keys, text):
    """Issue 47 (3): the summary's ``update_bound`` and its log line name the bound the
    run used: the keys it sets, else a secure run's default, else none."""
    cfg = load_run_config({"dataset": "mnist", "data-dir": "/data", "num-clients": 10,
                           "fraction": 0.5, **keys})
    summary = {**build_summary(cfg, [], RunFacts({}, {})), "out_dir": "/r"}
    assert summary["update_bound"] == text
    assert f"update bound: {text}" in [line for _, line in summary_lines(summary)]


def test_under_the_default_bound_every_honest_client_clips_to_it(micro_mnist_dir, tmp_path):
    """With secure-update-bound = 1e-4 every honest update is longer than the bound:
    each client clips it to B = 1e-4 x the model's norm and reports a ratio of 1, the
    sum passes, and the model moves by at most B (the quantizer's rounding aside)."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE, diagnostics=False,
                        **{"secure-update-bound": 1e-4})
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    init = init_weights(flat)
    bound = 1e-4 * float_norm(init)
    assert fields["update_bound"] == pytest.approx(bound, rel=1e-12)
    assert fields["update_ratio"] == pytest.approx(1.0, abs=1e-5)
    moved = float_norm([g.astype(np.float64) - w for g, w in
                        zip(parameters_to_ndarrays(params), init)])
    assert 0.5 * bound < moved <= bound * (1 + 1e-3)


def test_a_client_sets_its_sums_mean_accuracy_from_inside_its_mask(micro_mnist_dir, tmp_path):
    """``secure-acc-set=A``: the client adds K (A - a_k) to its accuracy inside its mask
    (taking the other K - 1 clients' accuracies for its own a_k), so A(t) becomes
    A + (sum of the others' - (K - 1) a_k) / K: computed here from a plain round's
    accuracies. The sum passes every check (the mean stays in [0, 1]), and the record
    says one client could have put A(t) anywhere (A_pull_bound 1)."""
    keys = {"diagnostics": False}
    plain = micro_config(micro_mnist_dir, tmp_path / "p", **keys)
    truth, _ = plain_round(plain, InProcessGrid(client_app, plain, 4))
    acc = dict(zip(truth["partition_ids"], truth["client_acc"]))
    flat = micro_config(micro_mnist_dir, tmp_path / "s", **SECURE, **keys,
                        faults="secure-acc-set=0.5@0@1")
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    want = 0.5 + (sum(acc[p] for p in (1, 2, 3)) - 3 * acc[0]) / 4
    assert params is not None and fields["A"] == pytest.approx(want, abs=1e-5)
    assert fields["A_pull_bound"] == 1.0


def run_secure_round(flat: dict, grid: InProcessGrid):
    """Round 1 of FedEFC under secure aggregation over ``grid``: (its outcome, the
    round pipeline, the client manager)."""
    cfg, pipeline, mgr, init = fedefc_server_for(flat, grid)
    params = ndarrays_to_parameters(init)
    plan = pipeline.plan(1, params, mgr)
    outcome = fedefc_server.secure_round.SecureRound(
        grid, Context(1, 0, {}, RecordDict(), flat), mgr, cfg)(
        fedefc_server.strategy.RoundStrategy(pipeline, plan), params)
    return outcome, pipeline, mgr


def quantizer_tolerance(flat: dict, partitions: list[int]) -> float:
    """How far SecAgg+'s weighted mean of ``partitions``' updates may lie from the plain
    one: each client's weighted value moves by less than a quantizer step 2c / 2^22
    (stochastic rounding), so the mean by less than K steps over the weight total."""
    cfg = load_run_config(flat)
    sizes = [len(partition_data(cfg, p, CPU)) for p in range(cfg.num_clients)]
    weight_total = sum(sizes[p] / max(sizes) for p in partitions)
    return len(partitions) * 2 * secure_range(cfg) / 2**22 / weight_total


@pytest.mark.parametrize("nodes, fault, complainers, reason", [
    (4, "bad-dealer@1@1", None, "fails its dealer's commitment (Feldman's check)"),
    (5, "bad-dealer@1@1", None, "fails its dealer's commitment (Feldman's check)"),
    (10, "bad-dealer@1@1", None, "fails its dealer's commitment (Feldman's check)"),
    (5, "unopenable=0@1@1", None, "encrypted shares that do not open under their "
                                  "channel's key (the holder proved the key)"),
    (5, "unopenable=1003@1@1", [1003], "encrypted shares that do not open under their "
                                       "channel's key (the holder proved the key)"),
    (5, "other-commitment=0@1@1", None, "carries another commitment than the dealer's"),
], ids=["bad-dealer-4", "bad-dealer-5", "bad-dealer-10", "unopenable-to-all",
        "unopenable-to-one", "other-commitment"])
def test_a_lying_dealer_is_named_at_share_time_and_the_round_goes_on_without_it(
        micro_mnist_dir, tmp_path, nodes, fault, complainers, reason):
    """Node 1001 deals lying shares, then answers the unmask stage honestly:
    ``bad-dealer``, shares off the polynomial it commits to (at 550afb3, without
    commitments, the round was refused naming no one with 5 nodes, and with 4 the run
    failed); ``unopenable``, ciphertexts that do not open, and ``other-commitment``,
    shares carrying another commitment than the one it sent the server (issue 58: each
    holder complained without a key, every node left the round and nobody was named;
    aimed at one holder, that honest holder was left out of every round with the
    dealer). Every holder checks its dealer's signature and its shares before it masks
    anything and complains with the proof (the channel's key, or a proof of it for
    shares that do not open); the server names node 1001 only, leaves it out of the run
    and starts the round again without it, keeping every honest holder: the round gives
    exactly the plain FedAvg of the others (the truth: a plain round in which node 1001
    fails)."""
    flat = micro_config(micro_mnist_dir, tmp_path / "s", nodes, **SECURE, faults=fault)
    grid = InProcessGrid(client_app, flat, nodes)
    outcome, pipeline, _ = run_secure_round(flat, grid)
    fields = outcome.record
    others = [p for p in range(nodes) if p != 1]
    assert fields["secure_attempts"] == 2 and fields["partition_ids"] == others
    assert {r["node"] for r in fields["rejected_reasons"]} == {"1001"}
    [named] = fields["rejected_reasons"]
    assert named["reason"].startswith("it dealt node ") and named["reason"].endswith(reason)
    assert pipeline.registry.partition_of("1001") is None  # left out of the run
    assert all(pipeline.registry.partition_of(str(1000 + p)) == p for p in others)
    complained = [r for r in grid.received if COMPLAINTS in configs(r)]
    assert sorted(r.metadata.src_node_id for r in complained) == (
        complainers or [1000 + p for p in others])
    assert all(configs(r)[COMPLAINTS] == [1001] for r in complained)
    crash = {**flat, "secure-aggregation": False, "faults": "raise@1"}
    truth, want = plain_round_at(crash, 1, init_weights(crash))
    assert truth["partition_ids"] == others
    for got, w in zip(parameters_to_ndarrays(outcome.parameters), want):
        np.testing.assert_allclose(got, w, atol=quantizer_tolerance(flat, others))


def test_a_dealer_that_seals_an_empty_secret_is_refused_at_share_time(micro_mnist_dir,
                                                                     tmp_path):
    """Issue 58 (3): a dealer that sealed an empty mask seed crashed the unmask step. Its
    share-keys reply is now refused as it arrives, naming it, and the round starts again
    without it."""
    flat = micro_config(micro_mnist_dir, tmp_path, 4, **SECURE, faults="empty-secret@1@1")
    outcome, _, _ = run_secure_round(flat, InProcessGrid(client_app, flat, 4))
    fields = outcome.record
    assert fields["secure_attempts"] == 2 and fields["partition_ids"] == [0, 2, 3]
    assert fields["rejected_reasons"] == [{"node": "1001", "partition": 1, "reason": (
        "share-keys reply whose commitment to b seals 0 bytes, not the 32 of a SecAgg+ b")}]


def test_a_server_that_forges_the_relayed_commitments_gets_no_channel_key(micro_mnist_dir,
                                                                          tmp_path):
    """A dishonest server relays every holder forged commitments
    (``server-faults = "secagg-commitments@0-3"``). Had a holder then complained with
    its channel keys, the server could have opened valid shares of every dealer and,
    from enough holders, unmasked a dealer whose vector arrived in the same stage. Each
    holder sees that the dealer did not sign the relayed commitments and refuses the
    message: no complaint, no key, no masked vector leaves any node, no node is left out
    of the run, and the round is refused."""
    flat = micro_config(micro_mnist_dir, tmp_path, **SECURE,
                        **{"server-faults": "secagg-commitments@0-3"})
    cfg = load_run_config(flat)
    inner = InProcessGrid(client_app, flat, 4)
    grid = DishonestGrid(inner, parse_server_faults(cfg.server_faults))
    _, pipeline, _, init = fedefc_server_for(flat, inner)
    mgr = manager([GridClientProxy(nid, grid, 1) for nid in inner.contexts])
    params = ndarrays_to_parameters(init)
    plan = pipeline.plan(1, params, mgr)
    outcome = fedefc_server.secure_round.SecureRound(
        grid, Context(1, 0, {}, RecordDict(), flat), mgr, cfg)(
        fedefc_server.strategy.RoundStrategy(pipeline, plan), params)
    assert outcome.parameters is None and outcome.record["skipped"]
    replies = [configs(r) for r in inner.received if not r.has_error()]
    assert not any(COMPLAINTS in record for record in replies)
    refusals = [r for r in inner.received if r.has_error()
                and "that node did not sign" in r.error.reason]
    assert len(refusals) == 4
    assert not any(Key.MASKED_PARAMETERS in record for record in replies)
    assert all(pipeline.registry.partition_of(str(1000 + k)) == k for k in range(4))


@pytest.mark.parametrize("nodes, faults", [
    (4, "bad-shares@1@1"), (4, "collude-shares@1,2@1"), (5, "collude-shares@1,2@1"),
    (10, "collude-shares@1,2@1")],
    ids=["one-random-of-4", "two-colluding-of-4", "two-colluding-of-5", "two-colluding-of-10"])
def test_lying_holders_are_named_by_their_returned_shares_alone(micro_mnist_dir, tmp_path,
                                                                nodes, faults):
    """Holders return wrong unmask shares: random bytes (``bad-shares``), or two holders
    agreeing on their lie (``collude-shares``: f(x) + 1). At 550afb3 (Reed-Solomon
    decoding of unverifiable shares) one liar of 4 and two colluding liars of 5 or 10
    were refused naming no one. Now every returned share is checked against its owner's
    commitment: each liar is named and left out of the run (also after a resume), its
    shares dropped; where the others' shares still reach the threshold (one of 4; two
    of 5, threshold 3; two of 10, threshold 7) the round goes on and gives the plain
    FedAvg of all the nodes (the liars' own updates were honest); two of 4 leave 2
    shares for a threshold of 3: the round is refused, nothing unmasked."""
    flat = micro_config(micro_mnist_dir, tmp_path / "s", nodes, **SECURE, faults=faults)
    grid = InProcessGrid(client_app, flat, nodes)
    outcome, pipeline, mgr = run_secure_round(flat, grid)
    fields = outcome.record
    liars = {"1001"} if faults.startswith("bad-shares") else {"1001", "1002"}
    assert {r["node"] for r in fields["rejected_reasons"]} == liars
    for r in fields["rejected_reasons"]:
        assert (r["reason"].endswith("fails its dealer's commitment (Feldman's check)")
                or "is not its holder's node id" in r["reason"]), r
    assert fields["secure_attempts"] == 1
    assert sorted(pipeline.federation.serving(mgr, 2)) == sorted(
        set(range(nodes)) - {int(n) - 1000 for n in liars})
    if nodes == 4 and len(liars) == 2:
        assert outcome.parameters is None and "fewer than the threshold 3" in (
            fields["secure_refused"])
        return
    assert fields["partition_ids"] == list(range(nodes))
    truth, want = plain_round_at({**flat, "secure-aggregation": False, "faults": ""}, 1,
                                 init_weights(flat))
    for got, w in zip(parameters_to_ndarrays(outcome.parameters), want):
        np.testing.assert_allclose(got, w, atol=quantizer_tolerance(flat, list(range(nodes))))
    # a resumed run (its checkpoint's state, as JSON) does not take the liars back
    _, resumed, mgr, _ = fedefc_server_for(flat, grid)
    resumed.load_state(json.loads(json.dumps(pipeline.state())))
    assert sorted(resumed.federation.serving(mgr, 2)) == sorted(
        set(range(nodes)) - {int(n) - 1000 for n in liars})
    for liar in liars:  # its partition's absence says why
        assert absence(resumed.registry, int(liar) - 1000)["reason"].startswith(
            "its node was refused: left out of the run: ")


def imported_modules(module) -> set[str]:
    """The modules ``module``'s source imports (absolute, or relative to its package)."""
    tree = ast.parse(Path(module.__file__).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.__name__.split(".")[:-node.level] + [base]).rstrip(".")
            out.add(base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_the_attacker_lives_beside_the_honest_path():
    """Issue 29 (6): MethodClient's fit, evaluate and get_properties called five fault
    hooks, and the secure-aggregation mods two more. Now no honest module of either app
    imports the fault modes (common.faults) or the attackers (fedefc_client.attacker,
    fedefc_server.dishonest); only the two composition points do: the ClientApp's run
    part and the ServerApp."""
    honest = [fedefc_client.client, fedefc_client.mods, fedefc_client.job,
              fedefc_client.local_update, fedefc_client.server_checks,
              fedefc_server.pipeline, fedefc_server.secure_round, fedefc_server.strategy,
              fedefc_server.round_loop, fedefc_server.validation, fedefc_server.registry,
              fedefc_server.federation, fedefc_server.node_answers]
    attackers = {"common.faults", "fedefc_client.attacker", "fedefc_server.dishonest"}
    for module in honest:
        assert not imported_modules(module) & attackers, module.__name__
    assert "fedefc_client.attacker" in imported_modules(fedefc_client.run_client)
    assert "fedefc_server.dishonest" in imported_modules(fedefc_server.server_app)


# -- the same attacks through Flower's simulation (`flwr run`) ---------------------------------
@pytest.mark.flower
def test_the_secure_attacks_replay_in_a_simulation(micro_mnist_dir, tmp_path):
    """Three clients lie inside the mask in rounds 1-3 (an accuracy, a weight, an
    unreadable vector): rounds 1 and 2 are refused (round 2 already summed by the
    culprit search: three of the four clients), round 3 starts again without the
    unreadable vector's node, round 4 is a search round; the run completes."""
    summary, recs = simulate(micro_mnist_dir, tmp_path / "run", "fedefc", **{
        "rounds": 4, "fraction": 1.0, "secure-aggregation": "true",
        "faults": '"secure-acc=410@0@1;weight=1000@1@2;garbage-bytes@2@3"'})
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4]
    assert "of the decoded sum holds" in recs[1]["refused_sum"] and recs[1].get("A") is None
    assert "a weight was changed inside the mask" in recs[2]["refused_sum"]
    assert recs[2]["culprit_search"]["groups"] == [[0, 1, 3]]  # the culprit search's
    assert recs[3]["partition_ids"] == [0, 1, 3] and recs[3]["secure_attempts"] == 3
    assert recs[3]["rejected_reasons"][0]["reason"] == "unreadable masked vector (ValueError)"
    assert len(recs[4]["partition_ids"]) == 3 and 0 <= recs[4]["A"] <= 1
    assert summary["rejected_replies"] == 1 and summary["refused_rounds"] == [1, 2]


@pytest.mark.flower
def test_the_identity_and_norm_attacks_replay_in_a_simulation(micro_mnist_dir, tmp_path):
    """Partition 3's node claims partition 0 (only one of the two serves it, whichever
    came first: a simulation has no allowlist), partition 1's update is scaled 10^6-fold
    in round 2, partition 2 reports 10^5 held-out samples in every evaluation."""
    summary, recs = simulate(micro_mnist_dir, tmp_path / "run", "fedavg", **{
        "fraction": 1.0, "evaluation": '"both"', "max-update-norm": 100.0,
        "faults": '"claim=0@3;scale=1e6@1@2;eval-samples=100000@2"'})
    [refused] = recs[1]["refused_nodes"]
    assert refused["partition"] == 0 and refused["reason"].startswith("partition 0 is served")
    assert all(set(r["partition_ids"]) <= {0, 1, 2} for r in recs[1:])
    assert recs[2]["partition_ids"] == [0, 2]
    assert "the bound max-update-norm sets" in recs[2]["rejected_reasons"][0]["reason"]
    for r in recs:
        [evaluation] = r["federated_rejected_reasons"]
        assert evaluation["partition"] == 2 and evaluation["reason"].startswith(
            "held-out sample count 100000 differs from the")
    assert summary["rejected_replies"] == 1
    # the summary says which mode ran and the bound of a declaration the plan did not fix
    cfg = load_run_config(json.loads((tmp_path / "run" / "config.json").read_text()))
    parts = [len(ix) for ix in data_plan(cfg).client_indices]
    assert summary["admission"] == {
        "mode": "simulation",
        "max_declared_samples": max(n - held_out_count(cfg, n) for n in parts),
        "max_declared_held_out": max(held_out_count(cfg, n) for n in parts),
        "bound": "the data plan's largest partition, as max-client-samples = 0"}
