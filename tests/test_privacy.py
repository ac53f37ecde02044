"""Trust and privacy (docs/PRIVACY.md): weights bound to declared sizes and partition
ids bound to nodes; secure aggregation (Flower's SecAgg+) with the accuracies inside the
secure sum; client-side differential privacy; the audit of what leaves a client.

The secure rounds here run in this process: Flower's SecAgg+ workflow drives the
project's strategy, and :class:`tests.helpers.InProcessGrid` delivers every message to
the project's real ClientApp (mods included) on real MNIST images, so the messages the
tests inspect are the ones the server received.
"""

import json
import re

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import (
    FitIns,
    FitRes,
    bytes_to_ndarray,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import ConfigError
from common.data_plan import data_plan
from common.methods import load_run_config
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from common.sample_roles import training_size
from common.secure_means import SLOTS, decode_tail, encode_tail, tail_scale
from common.training import BatchTransform, predict_proba
from common.twin import paired
from fedefc_client.node_state import save_vector
from fedefc_client.client_app import app as client_app
from fedefc_client.job import NOISE_MODEL, LocalJob
from fedefc_client.local_data import partition_data
from fedefc_client.audit import audit_mod, audit_path, describe_reply
from fedefc_client.mods import clipping_mod, noise_mod, secure_tail_mod
from fedefc_server import checkpoint, server_app
from fedefc_server.declarations import SizeRule
from fedefc_server.registry import PartitionRegistry
from fedefc_server.round_loop import RoundLoop
from fedefc_server.secure_round import SecureRound
from fedefc_server.strategy import RoundStrategy
from tests.helpers import (
    GLOBAL,
    OK,
    PARAMS,
    FakeProxy,
    InProcessGrid,
    RoundDriver,
    make_driver,
    make_pipeline,
    manager,
    partition_nodes,
    records,
    trained_reply,
)

CPU = torch.device("cpu")


# -- weights bound to facts -------------------------------------------------------------
def test_a_declaration_is_fixed_for_the_run_and_a_changed_one_is_refused():
    registry = PartitionRegistry(SizeRule(10, None, 10**8))
    first = FakeProxy("a", 3, 120)
    registry.refresh(manager([first]), 1)
    assert registry.declared == {3: 120}
    assert registry.take_news() == {"declared": {3: 120}}
    # the node restarts (a new Flower node id): while the old one is connected the new
    # one waits; once the old one has left, the same sizes are the same partition...
    again = FakeProxy("b", 3, 120)
    assert list(registry.refresh(manager([first, again]), 2).values()) == [first]
    assert list(registry.refresh(manager([again]), 3).values()) == [again]
    assert registry.take_news()["reassigned"] == {3: "b"}
    # ...other sizes are refused with the reason, recorded once, and never sampled
    liar = FakeProxy("c", 3, 1200)
    for rnd in (4, 5):
        serving = registry.refresh(manager([again, liar]), rnd)
        assert serving == {3: again} and registry.partition_of("c") is None
    news = registry.take_news()
    assert news["refused_nodes"] == [{"node": "c", "partition": 3, "reason": (
        "declares 1200 samples (0 held out) for partition 3, which was declared with 120 "
        "(0 held out); a declaration is fixed for the run")}]


@pytest.mark.parametrize("props, reason", [
    ({"partition-id": 1, "data": "partition"}, "num-examples missing"),
    ({"partition-id": "1", "num-examples": 5, "data": "partition"}, "partition-id missing"),
    ({"partition-id": 1, "num-examples": True, "data": "partition"}, "num-examples missing"),
    ({"partition-id": 1, "num-examples": 5, "data": "cloud"}, "data 'cloud' is not one of"),
    ({"partition-id": 1, "num-examples": 11, "data": "partition"},
     "declares 11 samples for partition 1, whose size in the run's data plan is 10"),
    ({"partition-id": 1, "num-examples": 4001, "data": "private"},
     "declares 4001 samples, above the bound 4000 (max-client-samples); raise "
     "max-client-samples if nodes hold more"),
    ({"partition-id": 7, "num-examples": 5, "data": "private"}, "partition id 7 outside 0..3"),
], ids=["no-size", "pid-text", "size-bool", "data-kind", "not-the-plan", "private-too-big",
        "pid-range"])
def test_the_registry_vets_every_declaration(props, reason):
    registry = PartitionRegistry(SizeRule(4, [10, 10, 10, 10], 4000))
    assert reason in registry.admit("node", props)
    assert registry.declared == {}
    private = {"partition-id": 1, "num-examples": 4000, "data": "private"}
    assert registry.admit("node", private) is None  # own data: its own size


@pytest.mark.parametrize("order", ["liar-first", "liar-last"])
def test_a_reply_claiming_another_nodes_partition_is_rejected_whatever_the_order(order):
    strategy = make_driver(**{"method": "fedavg", "num-clients": 3, "fraction": 1.0})
    nodes = partition_nodes(3)
    strategy.configure_fit(1, PARAMS, manager(nodes))
    honest = [trained_reply(n, [w + n.partition_id for w in GLOBAL]) for n in nodes]
    liar = trained_reply(nodes[0], GLOBAL, **{"partition-id": 2})  # node 0 claims 2
    replies = [liar, *honest[1:]] if order == "liar-first" else [*honest[1:], liar]
    params, _ = strategy.aggregate_fit(1, replies, [])
    fields = strategy.fields()
    assert fields["partition_ids"] == [1, 2] and fields["rejected"] == 1
    assert fields["rejected_reasons"][0]["reason"] == (
        "partition id 2 is not its node's registered partition 0")
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], GLOBAL[0] + 1.5)


def test_confident_learning_may_count_fewer_samples_but_never_more():
    strategy = make_driver(**{"method": "confident-learning", "num-clients": 3,
                              "fraction": 1.0})
    nodes = partition_nodes(3, sizes=[10, 10, 10])
    strategy.configure_fit(1, PARAMS, manager(nodes))
    replies = [trained_reply(nodes[0], GLOBAL, 7, accuracy=0.5),
               trained_reply(nodes[1], GLOBAL, 10, accuracy=0.5),
               trained_reply(nodes[2], GLOBAL, 11, accuracy=0.5)]
    strategy.aggregate_fit(1, replies, [])
    fields = strategy.fields()
    assert fields["num_examples"] == [7, 10]
    assert "sample count 11 outside 1..10" in fields["rejected_reasons"][0]["reason"]


def test_declared_sizes_survive_a_checkpoint():
    strategy = make_driver(**{"num-clients": 4, "prestopping": True})
    strategy.registry.refresh(manager(partition_nodes(4, sizes=[5, 6, 7, 8])), 1)
    state = json.loads(json.dumps(strategy.pipeline.state()))
    resumed = make_driver(**{"num-clients": 4, "prestopping": True})
    resumed.pipeline.load_state(state)
    assert resumed.registry.declared == {0: 5, 1: 6, 2: 7, 3: 8}
    serving = resumed.registry.refresh(manager(partition_nodes(4, base=9, sizes=[5, 6, 7, 80])),
                                       7)
    assert sorted(serving) == [0, 1, 2]  # partition 3 came back with another size


# -- the accuracies inside the secure sum -------------------------------------------------
def secagg_mean(values, sizes, max_weight, clipping=8.0, quantized=False):
    """What SecAgg+ hands the server for the tails of clients with ``values`` (one per
    client: its accuracy) and ``sizes``: sum_k w_k t_k / sum_k w_k, w_k = n_k / M."""
    scale = tail_scale(clipping, max_weight)
    tails = [encode_tail({"accuracy": v, "train-loss": 2 * v}, n, scale)[0]
             for v, n in zip(values, sizes)]
    w = np.array(sizes, dtype=float) / max_weight
    if quantized:  # Flower's weight factor: round(w * 2**22) / 2**22
        w = np.round(w * 2**22) / 2**22
    return sum(wk * t for wk, t in zip(w, tails)) / w.sum()


@pytest.mark.parametrize("quantized", [False, True])
def test_the_secure_sum_of_the_tails_is_the_unweighted_mean(quantized):
    values, sizes = [0.1, 0.2, 0.3, 1.0], [10, 50, 100, 7]
    means = decode_tail(secagg_mean(values, sizes, max_weight=100, quantized=quantized))
    assert means["accuracy"] == pytest.approx(0.4, abs=1e-6 if quantized else 1e-12)
    assert means["train-loss"] == pytest.approx(0.8, abs=2e-5 if quantized else 1e-12)
    weighted = np.average(values, weights=sizes)  # what FedAvg weighting would give
    assert abs(weighted - 0.4) > 0.05


def test_a_tail_stays_inside_the_clipping_range_and_leaves_the_clear_metrics():
    tail, clear = encode_tail({"accuracy": 1.0, "train-loss": 50.0, "partition-id": 3,
                               "loss": "cross-entropy"}, 40, tail_scale(8.0, 40))
    assert clear == {"partition-id": 3, "loss": "cross-entropy"}
    w = 40 / 40
    assert np.all(w * tail <= 8.0 / 2 + 1e-12)  # half the clipping range, any size
    loss = [name for name, _ in SLOTS].index("train-loss")
    assert tail[loss] == tail[0]  # a loss above its bound is clipped to it
    assert decode_tail(np.zeros(len(SLOTS))) == {}


def micro_config(data_dir, out, n_nodes=4, **extra) -> dict:
    return load_run_config({
        "dataset": "mnist", "data-dir": str(data_dir), "model": "lenet",
        "num-clients": n_nodes, "fraction": 1.0, "rounds": 3, "local-epochs": 1,
        "batch-size": 8, "start-round": 0, "gamma-thr": 1, "iid": True,
        "client-threads": 1, "out-dir": str(out), "accuracy-signal": "global",
        "q-pooling": "none", **extra}).to_flat()  # stateless clients: an exact resume


def server(flat: dict, grid: InProcessGrid):
    """FedEFC's round pipeline (stub evaluation) and the client manager over ``grid``'s
    nodes."""
    cfg = load_run_config(flat)
    data = partition_data(cfg, 0, CPU).data
    init = get_weights(initial_model(cfg, data.task))
    sizes = [len(partition_data(cfg, k, CPU))
             for k in range(cfg.num_clients)]
    return cfg, make_pipeline(cfg, plan_sizes=sizes, max_private=10**6), grid.manager(), init


def secure_round(flat: dict, grid: InProcessGrid, weights: list[np.ndarray] | None = None,
                 t_e: int | None = None):
    """Round 1 under secure aggregation, from the initial model or ``weights`` (in phase 2
    with ``t_e = 0``): (its record fields, the new parameters)."""
    cfg, pipeline, mgr, init = server(flat, grid)
    if hasattr(pipeline.server, "prestopper"):  # FedEFC's family; FedDitto has none
        pipeline.server.prestopper.t_e = t_e
    params = ndarrays_to_parameters(init if weights is None else weights)
    plan = pipeline.plan(1, params, mgr)
    outcome = SecureRound(grid, Context(1, 0, {}, RecordDict(), flat), mgr, cfg)(
        RoundStrategy(pipeline, plan), params)
    return {**plan.record, **outcome.record}, outcome.parameters


def plain_round(flat: dict, grid: InProcessGrid, weights: list[np.ndarray] | None = None,
                t_e: int | None = None):
    """Round 1 without it: (its record fields, the new parameters)."""
    cfg, pipeline, mgr, init = server(flat, grid)
    pipeline.server.prestopper.t_e = t_e
    driver = RoundDriver(pipeline)
    instructions = driver.configure_fit(1, ndarrays_to_parameters(init if weights is None
                                                                  else weights), mgr)
    results = [(proxy, proxy.fit(ins, None, 1)) for proxy, ins in instructions]
    params, _ = driver.aggregate_fit(1, results, [])
    return driver.fields(), params


@pytest.fixture(scope="module")
def rounds(micro_mnist_dir, tmp_path_factory):
    """Round 1 of a 4-client FedEFC federation, plain and under secure aggregation
    (without the simulation-only diagnostics, as a deployment with private data)."""
    base = tmp_path_factory.mktemp("privacy")
    plain = micro_config(micro_mnist_dir, base / "plain", diagnostics=False)
    secure = micro_config(micro_mnist_dir, base / "secure", diagnostics=False,
                          **{"secure-aggregation": True})
    plain_grid, secure_grid = InProcessGrid(client_app, plain, 4), InProcessGrid(client_app,
                                                                                  secure, 4)
    return {"plain": (*plain_round(plain, plain_grid), plain_grid),
            "secure": (*secure_round(secure, secure_grid), secure_grid)}


def scalars(msg: Message):
    """Every (record, key, value) of the config and metric records of a reply."""
    if msg.has_error():
        return
    content = msg.content
    for group in (content.config_records, content.metric_records):
        for name, record in group.items():
            for key, value in record.items():
                for v in (value if isinstance(value, list) else [value]):
                    yield name, key, v


def test_the_server_learns_a_t_and_never_a_clients_accuracy(rounds):
    plain_fields, plain_params, plain_grid = rounds["plain"]
    fields, secure_params, secure_grid = rounds["secure"]
    accuracies = plain_fields["client_acc"]  # the same model, seeds and data in both
    assert len(accuracies) == 4 and len(set(accuracies)) > 1
    # the server obtains A(t) ...
    assert fields["A"] == pytest.approx(np.mean(accuracies), abs=1e-6)
    assert fields["client_acc"] is None and fields["n_clients"] == 4
    # the update's norm over the round's bound (issue 47) is summed too, never per client
    # with a twin, its reading on the guard slice too (docs/FEDEFC.md §3.8)
    assert fields["server_saw"]["sum_only"] == ["weights", "accuracy", "guard-accuracy",
                                                "train-loss", "update-ratio"]
    assert not {"accuracy", "guard-accuracy", "update-ratio"} & set(
        fields["server_saw"]["per_client"])
    # ... from messages none of which holds one client's accuracy in the clear
    replies = secure_grid.received
    assert replies and not any(m.has_error() for m in replies)
    for msg in replies:
        for name, key, value in scalars(msg):
            assert key not in ("accuracy", "guard-accuracy"), (name, key)
            assert not (isinstance(value, float) and value in accuracies), (name, key, value)
        assert all(len(rec) == 0 for rec in msg.content.array_records.values())
    # the arrays travelled as masked integer vectors only; read as if they were not
    # masked, a client's tail does not give its accuracy back
    masked = [msg for msg in replies
              if Key.MASKED_PARAMETERS in msg.content.config_records.get(RECORD_KEY_CONFIGS, {})]
    assert len(masked) == 4
    for msg in masked:
        vector = [bytes_to_ndarray(b) for b in
                  msg.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        assert all(v.dtype.kind in "iu" for v in vector)
        as_if_clear = dequantize(vector[-1:], 8.0, 2**22)[0]
        # unmasked, the ratio gives an accuracy back to within the quantization error;
        # 1e-5, not 1e-3: a masked ratio fell within 1e-3 of one by chance once
        assert not any(abs(as_if_clear[1] / as_if_clear[0] - a) < 1e-5 for a in accuracies)
    # and the model is FedAvg's up to the quantization step
    for got, want in zip(parameters_to_ndarrays(secure_params),
                         parameters_to_ndarrays(plain_params)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert fields["train_loss"] == pytest.approx(plain_fields["train_loss"], abs=1e-4)


def test_a_secure_round_is_a_pure_function_of_its_config(rounds, micro_mnist_dir, tmp_path):
    """The masks come from the OS's entropy but cancel exactly; the stochastic rounding
    is seeded from (seed, partition, round): the same config gives the same model."""
    _, first, _ = rounds["secure"]
    flat = micro_config(micro_mnist_dir, tmp_path, diagnostics=False,
                        **{"secure-aggregation": True})
    _, again = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert again.tensors == first.tensors


def secure_loop(flat: dict, out, ckpt: checkpoint.Checkpoint | None = None) -> None:
    """The round loop with secure rounds over a fresh in-process federation (a new Flower
    run: empty node state), from round 1 or after ``ckpt``, as the ServerApp builds it."""
    grid = InProcessGrid(client_app, flat, int(flat["num-clients"]))
    cfg, pipeline, mgr, init = server(flat, grid)
    if ckpt:
        pipeline.load_state(ckpt.strategy)
    pipeline.evaluator = lambda weights: (0.0, float(weights[-1][0]))
    model = initial_model(cfg, partition_data(cfg, 0, CPU).data.task)
    loop = RoundLoop(client_manager=mgr, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(ckpt.weights if ckpt else init), cfg=cfg,
                     recorder=RunRecorder(out, flat, resume_round=ckpt.round if ckpt else None),
                     model=model, run_info={}, first_round=ckpt.round + 1 if ckpt else 1,
                     secure_round=SecureRound(grid, Context(1, 0, {}, RecordDict(), flat),
                                              mgr, cfg))
    loop.fit(cfg.rounds, None)


def test_a_secure_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(
        micro_mnist_dir, tmp_path):
    """SecAgg+'s keys and masks live for one round, so the checkpoint of a secure round
    holds all a resumed run needs: two rounds, then a third after a restart, end where
    three rounds in one go end."""
    whole = micro_config(micro_mnist_dir, tmp_path / "whole", **{"secure-aggregation": True})
    secure_loop(whole, tmp_path / "whole")
    part = micro_config(micro_mnist_dir, tmp_path / "part", **{"secure-aggregation": True,
                                                               "rounds": 2})
    secure_loop(part, tmp_path / "part")
    ckpt = checkpoint.load(tmp_path / "part")
    assert ckpt.round == 2 and ckpt.strategy["declared_sizes"] == {str(k): 20 for k in range(4)}
    secure_loop({**part, "rounds": 3}, tmp_path / "part", ckpt)
    a, b = torch.load(tmp_path / "whole" / "model.pt"), torch.load(tmp_path / "part" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("round", "A", "phase", "t_e", "partition_ids")
    assert [{k: r.get(k) for k in keys} for r in records(tmp_path / "whole")] == \
        [{k: r.get(k) for k in keys} for r in records(tmp_path / "part")]


def round_fields(flat: dict, weights: list[np.ndarray]) -> dict:
    """The record fields of round 1 of a 4-client federation that receives ``weights``:
    plain, or under secure aggregation when the run config says so."""
    run = secure_round if load_run_config(flat).secure_aggregation else plain_round
    return run(flat, InProcessGrid(client_app, flat, 4), weights)[0]


def test_the_held_out_signal_travels_inside_the_secure_sum(micro_mnist_dir, tmp_path):
    """Every client in every round, the held-out signal (docs/FEDEFC.md §3.1). Each
    client's A_k is the received model's accuracy on its validation share,
    recomputed here; a plain round reports each, a secure round only their mean."""
    keys = {"diagnostics": False, "accuracy-signal": "held-out", "validation-fraction": 0.5,
            "rho": 0.4, "zeta": 0.4}
    plain = micro_config(micro_mnist_dir, tmp_path / "plain", **keys)
    secure = micro_config(micro_mnist_dir, tmp_path / "secure", **keys,
                          **{"secure-aggregation": True})
    cfg = load_run_config(secure)
    clients = [partition_data(cfg, k, CPU) for k in range(4)]
    model = initial_model(cfg, clients[0].data.task)
    for k, local in enumerate(clients):  # a received model that has learnt something
        LocalJob(cfg, local, model, None, 1, k).train()
    assert cfg.twinned  # every client, every round: the pair travels inside the sum too
    weights = paired(get_weights(model))
    held_out, on_all = [], []
    for local in clients:
        pred = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU)).argmax(1)
        val = local.validation
        assert len(val) == 10
        held_out.append(float(np.mean(pred[val] == local.labels[val])))
        on_all.append(float(np.mean(pred == local.labels)))
    assert held_out != pytest.approx(on_all)  # the two signals differ here
    assert round_fields(plain, weights)["client_acc"] == pytest.approx(held_out, abs=1e-12)
    fields = round_fields(secure, weights)
    assert fields["client_acc"] is None
    assert fields["A"] == pytest.approx(np.mean(held_out), abs=1e-6)


def test_the_phase_2_guards_signal_travels_inside_the_secure_sum(micro_mnist_dir, tmp_path):
    """Under the phase-2 guard (the held-out signal, every client every round), a phase-2
    reply carries A_k: the received model's prediction of the share's observed labels
    through the Q the client trained with last round, kept in its node's state
    (docs/FEDEFC.md §3.4); recomputed here from the model's predictions and each node's
    Q. A plain round reports each, a secure round only their mean."""
    keys = {"diagnostics": False, "accuracy-signal": "held-out", "validation-fraction": 0.5,
            "rho": 0.4, "zeta": 0.4}
    plain = micro_config(micro_mnist_dir, tmp_path / "plain", **keys)
    secure = micro_config(micro_mnist_dir, tmp_path / "secure", **keys,
                          **{"secure-aggregation": True})
    cfg = load_run_config(secure)
    assert cfg.guarded
    clients = [partition_data(cfg, k, CPU) for k in range(4)]
    model = initial_model(cfg, clients[0].data.task)
    for k, local in enumerate(clients):  # a received model that has learnt something
        LocalJob(cfg, local, model, None, 1, k).train()
    assert cfg.twinned  # every client, every round: the pair travels inside the sum too
    weights = paired(get_weights(model))
    rng = np.random.default_rng(3)
    noise = [0.5 * np.eye(10) + 0.5 * rng.dirichlet(np.ones(10), size=10).T for _ in clients]
    through_q, plain_acc = [], []
    for local, q in zip(clients, noise):
        probs = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU))
        val = local.validation
        through_q.append(float(np.mean((probs[val] @ q.T).argmax(1) == local.labels[val])))
        plain_acc.append(float(np.mean(probs[val].argmax(1) == local.labels[val])))
    assert through_q != pytest.approx(plain_acc)  # Q changes the prediction here

    def fields(flat, run):
        grid = InProcessGrid(client_app, flat, 4)
        for k, q in enumerate(noise):
            save_vector(grid.contexts[1000 + k].state, NOISE_MODEL, q.ravel())
        return run(flat, grid, weights, t_e=0)[0]

    plain_fields = fields(plain, plain_round)
    assert plain_fields["client_loss"] == ["forward-corrected"] * 4  # phase 2
    assert plain_fields["client_acc"] == pytest.approx(through_q, abs=1e-12)
    secure_fields = fields(secure, secure_round)
    assert secure_fields["client_acc"] is None
    assert secure_fields["A"] == pytest.approx(np.mean(through_q), abs=1e-6)


def test_plain_replies_carry_each_accuracy(rounds):
    """The contrast: without secure aggregation every accuracy reaches the server."""
    _, _, grid = rounds["plain"]
    sent = {v for m in grid.received for _, key, v in scalars(m) if key == "accuracy"}
    assert len(sent) >= 2


def test_a_refused_reply_is_kept_out_of_the_sum(micro_mnist_dir, tmp_path):
    """Node 1 inflates its count, node 3 claims partition 2: both are refused before the
    sum (the round starts again without them; nothing of theirs is unmasked:
    tests/test_threats.py); the sum is the other three's."""
    faults = {"faults": "samples=17@1@1;pid=2@3@1"}
    flat = micro_config(micro_mnist_dir, tmp_path / "s", 5, **{"secure-aggregation": True},
                        **faults)
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 5))
    assert fields["partition_ids"] == [0, 2, 4] and fields["failures"] == 0
    reasons = sorted(r["reason"] for r in fields["rejected_reasons"])
    assert reasons == ["partition id 2 is not its node's registered partition 3",
                       "sample count 17 outside 1..16, the partition's declared size"]
    reference_flat = micro_config(micro_mnist_dir, tmp_path / "p", 5, **faults)
    ref, ref_params = plain_round(reference_flat, InProcessGrid(client_app, reference_flat, 5))
    assert ref["partition_ids"] == [0, 2, 4]
    assert fields["A"] == pytest.approx(ref["A"], abs=1e-6)
    for got, want in zip(parameters_to_ndarrays(params), parameters_to_ndarrays(ref_params)):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_client_failing_in_training_is_a_dropout_the_sum_survives(micro_mnist_dir, tmp_path):
    flat = micro_config(micro_mnist_dir, tmp_path / "s", 5, **{"secure-aggregation": True,
                                                               "faults": "raise@4@1"})
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 5))
    assert fields["partition_ids"] == [0, 1, 2, 3] and fields["failures"] == 1
    assert "InjectedFault" in fields["failure_reasons"][0]
    assert params is not None and 0 <= fields["A"] <= 1


@pytest.mark.parametrize("fault, field, reason", [
    ("shape@0@1", "rejected_reasons", "array 1 has shape (151,), expected (6, 1, 5, 5)"),
    ("nan@0@1", "failure_reasons", "the trained weights hold NaN or Inf"),
], ids=["wrong-shape", "nan"])
def test_a_broken_update_never_enters_the_sum(micro_mnist_dir, tmp_path, fault, field, reason):
    """A wrongly shaped masked vector is refused before the sum; an honest client with
    non-finite weights refuses to mask them (it fails: a dropout)."""
    flat = micro_config(micro_mnist_dir, tmp_path, **{"secure-aggregation": True,
                                                      "faults": fault})
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert fields["partition_ids"] == [1, 2, 3]
    assert reason in (fields[field][0] if field == "failure_reasons"
                      else fields[field][0]["reason"])
    assert all(np.isfinite(a).all() for a in parameters_to_ndarrays(params))


def test_a_round_below_the_reconstruction_threshold_keeps_the_model(micro_mnist_dir,
                                                                    tmp_path):
    """Two of four clients fail: two shares per secret, three needed (0.67 x 4); two
    masked vectors are allowed here (min-secure-clients = 2), so Flower's own check
    stops the round."""
    flat = micro_config(micro_mnist_dir, tmp_path, **{"secure-aggregation": True,
                                                      "faults": "raise@0-1@1",
                                                      "min-secure-clients": 2})
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 4))
    assert params is None and fields["secure_aggregation_halted"] and fields["skipped"]


@pytest.mark.parametrize("overrides, message", [
    ({"method": "fedcorr"}, "method 'fedcorr' needs every client's own values"),
    ({"method": "fednoro"}, "its server clusters each client's per-class losses"),
    ({"method": "rofl"}, "weights each client's class centroids"),
    ({"accuracy-aggregation": "trimmed-mean"}, "which secure aggregation hides"),
    ({"accuracy-aggregation": "median"}, "the median of the groups' mean accuracies, and "
                                         "secure-groups=1 gives fewer than 3 groups"),
    ({"secure-groups": 3, "num-clients": 8, "fraction": 1.0},
     "secure-groups=3 with 8 clients per round gives groups of 2, below min-secure-clients=3"),
    ({"num-clients": 2, "fraction": 0.5}, "SecAgg+ sums the updates of 2..1024 clients"),
    ({"num-shares": 2}, "num-shares=2: a client's secrets go to 3..10"),
    ({"reconstruction-threshold": 0.5}, "greater than 0.5"),
    ({"evaluation": "both"}, "evaluate reply carries its held-out loss and accuracy"),
], ids=["fedcorr", "fednoro", "rofl", "trimmed-mean", "median-of-one-group", "small-groups",
        "one-client", "shares", "threshold", "federated-evaluation"])
def test_secure_aggregation_refuses_what_it_cannot_serve(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config({"secure-aggregation": True, **overrides})


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedditto", "forward-correction",
                                    "confident-learning", "fedefc"])
def test_every_method_that_needs_only_sums_accepts_secure_aggregation(method):
    assert load_run_config({"secure-aggregation": True, "method": method}).secure_aggregation


def secure_reply(received, trained, **run) -> list[np.ndarray]:
    """The arrays a secure training reply carries out of the tail mod (before masking)
    for a client that received ``received`` and trained ``trained``."""
    fitins = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(received), {
        "round": 1, "secagg-scale": 4.0}), True)
    ctxt = Context(1, 1000, {"partition-id": 0}, RecordDict(),
                   {"secure-aggregation": True, **run})

    def reply(m, c):
        res = FitRes(OK, ndarrays_to_parameters(trained), 10, {"partition-id": 0})
        return Message(compat.fitres_to_recorddict(res, True), reply_to=m)

    out = secure_tail_mod(Message(fitins, 1000, MessageType.TRAIN), ctxt, reply)
    return reply_arrays(out)


def test_a_secure_client_sends_its_update_and_never_one_beyond_the_runs_bound():
    """Issue 29 (1): the masked vector carries the update (trained minus received), which
    the quantizer's range is sized for, then the tail; an honest client whose update is
    longer than max-update-norm does not send it (it fails: a dropout), as the server
    would refuse it in a plain round. Before, the vector carried the trained weights."""
    received = [np.full((3, 4), 0.5, np.float32), np.array([7, 1])]
    trained = [received[0] + np.float32(0.25), np.array([9, 1])]  # an update of norm 0.866
    *update, tail = secure_reply(received, trained)
    np.testing.assert_allclose(update[0], np.full((3, 4), 0.25))
    np.testing.assert_array_equal(update[1], [2, 0])
    assert tail.shape == (len(SLOTS),)
    assert len(secure_reply(received, trained, **{"max-update-norm": 0.9})) == 3
    with pytest.raises(ValueError, match="the update's norm 0.866025 is above 0.5, the bound "
                                         "max-update-norm sets"):
        secure_reply(received, trained, **{"max-update-norm": 0.5})


# -- differential privacy -------------------------------------------------------------------
def train_message(received, clip: float) -> Message:
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(received),
                                                 {KEY_CLIPPING_NORM: clip, "round": 1}), True)
    return Message(content, 1000, MessageType.TRAIN)


def reply_with(trained):
    def call_next(msg, ctxt):
        fitres = FitRes(OK, ndarrays_to_parameters(trained), 5,
                        {"partition-id": 0})
        return Message(compat.fitres_to_recorddict(fitres, True), reply_to=msg)
    return call_next


def reply_arrays(msg: Message) -> list[np.ndarray]:
    return parameters_to_ndarrays(compat.recorddict_to_fitres(msg.content, True).parameters)


def dp_context(clip: float, z: float) -> Context:
    return Context(1, 1000, {"partition-id": 0}, RecordDict(),
                   {"dp-clip": clip, "dp-noise-multiplier": z})


def test_the_update_is_clipped_to_dp_clip_then_noised_with_z_times_it():
    received = [np.zeros(20_000, np.float32), np.zeros(3, np.int64)]
    trained = [np.full(20_000, 0.1, np.float32), np.array([1, 2, 3])]  # update norm 14.1
    msg = train_message(received, 2.0)
    clipped = reply_arrays(clipping_mod(msg, dp_context(2.0, 0.0), reply_with(trained)))
    assert np.linalg.norm(clipped[0]) == pytest.approx(2.0, rel=1e-5)
    noisy_a = reply_arrays(noise_mod(msg, dp_context(2.0, 0.5),
                                     lambda m, c: clipping_mod(m, c, reply_with(trained))))
    noisy_b = reply_arrays(noise_mod(msg, dp_context(2.0, 0.5),
                                     lambda m, c: clipping_mod(m, c, reply_with(trained))))
    noise = noisy_a[0] - clipped[0]
    assert noise.std() == pytest.approx(0.5 * 2.0, rel=0.03) and abs(noise.mean()) < 0.03
    assert not np.array_equal(noisy_a[0], noisy_b[0])  # OS entropy, not the run's seed
    np.testing.assert_array_equal(noisy_a[1], trained[1])  # integer arrays are left alone


def test_a_model_that_did_not_move_passes_the_clipping_unchanged():
    """An update of norm 0 (a client whose model did not move, e.g. with dead ReLUs under
    heavy noise) is returned as it is; Flower's clipping would divide by its norm."""
    received = [np.full(4, 0.5, np.float32), np.zeros(2, np.int64)]
    msg = train_message(received, 1.0)
    same = reply_arrays(clipping_mod(msg, dp_context(1.0, 0.0), reply_with(received)))
    for got, want in zip(same, received):
        np.testing.assert_array_equal(got, want)


# -- the audit ------------------------------------------------------------------------------
def test_the_audit_records_keys_types_and_bytes_of_every_reply(tmp_path):
    arrays = [np.zeros((3, 4), np.float32), np.zeros(5, np.float32)]
    fitres = FitRes(OK, ndarrays_to_parameters(arrays), 7,
                    {"partition-id": 2, "accuracy": 0.5, "loss": "cross-entropy"})
    request = Message(RecordDict(), 1000, MessageType.TRAIN, group_id="4")

    def call_next(msg, ctxt):
        return Message(compat.fitres_to_recorddict(fitres, True), reply_to=msg)

    ctxt = Context(1, 1000, {"partition-id": 2}, RecordDict(),
                   {"audit": True, "out-dir": str(tmp_path)})
    audit_mod(request, ctxt, call_next)
    cfg = load_run_config(ctxt.run_config)
    [entry] = [json.loads(x) for x in audit_path(cfg, 2).read_text().splitlines()]
    assert entry["round"] == "4" and entry["type"] == "train"
    records = entry["records"]
    assert records["fitres.metrics"]["keys"] == {"partition-id": "int", "accuracy": "float",
                                                 "loss": "str"}
    assert records["fitres.metrics"]["bytes"] == 8 + 8 + len("cross-entropy")
    assert records["fitres.num_examples"]["keys"] == {"num_examples": "int"}
    assert records["fitres.parameters"]["arrays"] == 2
    # each array travels as .npy bytes: its 4-byte floats plus a header
    assert records["fitres.parameters"]["bytes"] > 4 * (12 + 5)
    assert entry == {**describe_reply(call_next(request, ctxt)), "time": entry["time"]}


def test_a_partition_declares_what_it_trains_on_after_holding_out_its_test_part(
        micro_mnist_dir, tmp_path):
    """With federated evaluation a client trains on its partition less the held-out part:
    the server's expected declaration is that size, the one the client reports."""
    flat = micro_config(micro_mnist_dir, tmp_path, evaluation="both",
                        **{"local-test-fraction": 0.25, "open-deployment": True})
    loop, _ = server_app.build(Context(1, 0, {}, RecordDict(), flat), None)
    cfg = load_run_config(flat)
    sizes = loop.pipeline.registry.rule.plan_sizes
    for pid, idx in enumerate(data_plan(cfg).client_indices):
        held = round(0.25 * len(idx))
        assert held > 0
        assert sizes[pid] == len(partition_data(cfg, pid, CPU)) == len(idx) - held == \
            training_size(cfg, len(idx))
