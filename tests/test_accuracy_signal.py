"""The accuracy signal of FedEFC's phase 1 (docs/FEDEFC.md §3.1): the validation share
behind the ``held-out`` signal, and where a run keeps none; and the counts a FedEFC client
pools over its phase-2 rounds (``q-pooling``, §4.7).

The secure-aggregation path of the signal is tested with the other secure rounds in
test_privacy.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib

import numpy as np
import pytest
import torch
from cleanlab.count import compute_confident_joint
from flwr.app import RecordDict

from common.data_plan import data_plan
from common.methods import (
    METHODS,
    changed_keys,
    counts_pooling,
    load_object,
    load_run_config,
    q_estimator_used,
    resumes_exactly,
    validation_share,
)
from common.models import ClassifierShape
from common.params import get_weights
from common.runtime import initial_model, model_for
from common.sample_roles import SampleRoles, training_size
from common.training import BatchTransform, predict_proba
from common.transition import column_normalize, estimate_transition, shrink_to_identity
from fedefc_cli.grid import Grid
from fedefc_cli.run_configs import CONFIGS_DIR, inexact_resume_note, resume_config
from fedefc_client import local_data
from fedefc_client.client import MethodClient
from fedefc_client.job import LocalJob
from fedefc_client.local_data import node_data, partition_data
from fedefc_client.local_update import POOLED_COUNTS, fedefc
from fedefc_server.prestopping_server import PrestoppingServer

CPU = torch.device("cpu")
NODE = "node 9 (partition-id 2)"


def silo(**keys):
    """A cross-silo run on the embedded data: 5 clients, all of them every round, with
    the held-out signal; one model (the twin is tests/test_twin.py's)."""
    return load_run_config({"num-clients": 5, "fraction": 1.0, "accuracy-signal": "held-out",
                            "twin-model": "off", **keys})


def rows_of(x: torch.Tensor) -> set[bytes]:
    return {bytes(row.numpy().tobytes()) for row in x}


# -- the validation share ---------------------------------------------------------------------
def test_the_share_is_a_seeded_fraction_of_the_training_part():
    cfg = silo()
    assert validation_share(cfg) == 0.4
    val = SampleRoles.build(cfg, 3, 50, 10).share
    assert len(val) == 20 and len(np.unique(val)) == 20 and list(val) == sorted(val)
    assert 0 <= val.min() and val.max() < 50
    assert np.array_equal(val, SampleRoles.build(silo(), 3, 50, 10).share)  # a pure function
    assert not np.array_equal(val, SampleRoles.build(cfg, 4, 50, 10).share)  # per partition
    assert not np.array_equal(val, SampleRoles.build(silo(seed=1), 3, 50, 10).share)  # per seed
    assert len(SampleRoles.build(silo(**{"validation-fraction": 0.3}), 3, 50, 10).share) == 15
    assert len(SampleRoles.build(silo(**{"validation-fraction": 0.01}), 3, 50, 10).share) == 1
    assert len(SampleRoles.build(silo(**{"validation-fraction": 0.99}), 3, 50, 10).share) == 49
    assert SampleRoles.build(cfg, 3, 1, 10).share is None  # a single sample is trained on
    capped = silo(**{"validation-max-per-class": 1})  # at most 1 x 10 classes
    assert len(SampleRoles.build(capped, 3, 50, 10).share) == 10
    assert len(SampleRoles.build(capped, 3, 20, 10).share) == 8  # the fraction, below the cap


@pytest.mark.parametrize("keys", [
    {"method": "fedavg"}, {"method": "fedcorr"}, {"accuracy-signal": "global"},
    {"accuracy-signal": "local-train"}])
def test_no_share_without_a_held_out_signal_of_a_prestopping_method(keys):
    """FedAvg and the methods without a phase switch train on everything; so does FedEFC
    with the paper's signal (its results stay those of docs/RESULTS.md)."""
    cfg = silo(**keys)
    assert validation_share(cfg) == 0.0 and SampleRoles.build(cfg, 3, 50, 10).share is None
    assert partition_data(cfg, 3, CPU).validation is None


def test_the_share_lies_in_the_training_part_never_in_the_evaluation_hold_out(tmp_path):
    """Simulation and a SuperNode with cache-dir: the same share, its samples among
    those the client trains on and none of them among its federated-evaluation hold-out;
    the declared size (what every reply counts) is the training part, share included."""
    cfg = silo(evaluation="both")
    idx = data_plan(cfg).client_indices[2]
    local = partition_data(cfg, 2, CPU)
    train = SampleRoles.build(cfg, 2, len(idx), 10).train
    assert len(local) == len(train) == training_size(cfg, len(idx))
    val = local.validation
    assert len(val) == round(cfg.validation_fraction * len(train))
    shared, kept_out = rows_of(local.x[torch.as_tensor(val)]), rows_of(local.held_out.x)
    assert len(shared) == len(val) and not shared & kept_out
    np.testing.assert_array_equal(local.labels[val],
                                  data_plan(cfg).noisy_labels[idx[train[val]]])
    node = node_data(cfg, 2, {"cache-dir": str(tmp_path / "cache")}, NODE, CPU)
    again = node_data(cfg, 2, {"cache-dir": str(tmp_path / "cache")}, NODE, CPU)  # cached
    for other in (node, again):
        np.testing.assert_array_equal(other.validation, val)
        assert torch.equal(other.x[torch.as_tensor(val)], local.x[torch.as_tensor(val)])


def test_a_private_nodes_share_is_disjoint_from_its_hold_out(tmp_path):
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(60, 4)) + 10.0, np.arange(60) % 3
    path = tmp_path / "node.npz"
    np.savez(path, features=x, labels=y)
    cfg = load_run_config({"dataset": "npz", "evaluation": "federated", "num-classes": 3,
                           "input-shape": "4", "num-clients": 3, "fraction": 1.0,
                           "accuracy-signal": "held-out"})
    local = node_data(cfg, 2, {"data-path": str(path)}, NODE, CPU)
    train = SampleRoles.build(cfg, 2, 60, 3).train
    assert len(local) == 48 and len(local.held_out) == 12
    assert len(local.validation) == 19  # round(0.4 * 48)
    shared = rows_of(local.x[torch.as_tensor(local.validation)])
    assert len(shared) == 19 and not shared & rows_of(local.held_out.x)
    np.testing.assert_array_equal(local.labels[local.validation], y[train][local.validation])


def test_the_share_is_stable_across_rounds_and_a_restarted_process():
    """What a resumed run sees: a new process rebuilds the client's data from the run
    config alone; every round of phase 1 holds back the same samples."""
    cfg = silo()
    local = partition_data(cfg, 1, CPU)
    model = initial_model(cfg, local.data.task)
    held = [LocalJob(cfg, local, model, 1, r, 100 + r).held_back for r in (1, 2, 9)]
    assert all(np.array_equal(h, local.validation) for h in held)
    local_data._CACHE.clear()  # as in a new process
    rebuilt = partition_data(cfg, 1, CPU)
    assert rebuilt is not local
    np.testing.assert_array_equal(rebuilt.validation, local.validation)


def fit_once(cfg, local, phase: int):
    """One fit from the same initial weights and seed; (weights, count, metrics)."""
    model = initial_model(cfg, local.data.task)
    client = MethodClient(cfg, 1, lambda: local, RecordDict())
    return client.fit(get_weights(model), {"phase": phase, "round": 2, "seed": 7})


def test_phase_1_never_trains_on_the_share():
    """Scrambling the share's images changes nothing a phase-1 update computes but the
    signal; every reply counts the client's declared size."""
    cfg = silo(iid=True, **{"local-epochs": 1})
    local = partition_data(cfg, 1, CPU)
    x = local.x.clone()
    val = torch.as_tensor(local.validation)
    x[val] = torch.randint(0, 256, x[val].shape, dtype=x.dtype)
    scrambled = dataclasses.replace(local, x=x)
    (w1, n1, m1), (w2, n2, m2) = fit_once(cfg, local, 1), fit_once(cfg, scrambled, 1)
    assert n1 == n2 == len(local)
    assert all(np.array_equal(a, b) for a, b in zip(w1, w2))
    assert m1["accuracy"] != m2["accuracy"]


@pytest.mark.parametrize("use", ["estimate", "train"])
def test_phase_2_estimates_q_on_the_share_or_trains_on_it(use):
    """``validation-phase-2``: "estimate" keeps the share out of training and takes Q
    from the received model's predictions on it; "train" trains on every sample and
    takes Q from all of them (the paper's estimate). Q is recomputed here from the
    model's predictions (common/transition.py is tested against cleanlab)."""
    cfg = silo(rho=0.4, zeta=0.4, **{"local-epochs": 1, "validation-phase-2": use,
                                     "q-pooling": "none", "q-estimator": "counted"})
    local = partition_data(cfg, 1, CPU)
    model = initial_model(cfg, local.data.task)
    probs = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU))
    job = LocalJob(cfg, local, model, 2, 3, 3)
    trained = job.training_set()
    n, metrics, _ = fedefc(job)
    at = local.validation if use == "estimate" else np.arange(len(local))
    np.testing.assert_allclose(job.last_q, estimate_transition(probs[at], local.labels[at]))
    keep = np.ones(len(local), dtype=bool)
    if use == "estimate":
        keep[local.validation] = False
    assert torch.equal(trained.x, local.x[torch.as_tensor(np.flatnonzero(keep))])
    assert n == len(local) and metrics["loss"] == "forward-corrected"


def test_phase_2_pools_the_counts_of_the_clients_rounds():
    """``q-pooling = "cumulative"`` (the default when every client trains every round):
    the Q of a client's second phase-2 round is the column-normalized sum of cleanlab's
    confident joints of both rounds' received models on the share; with ``none`` it is
    the second round's alone, and nothing is kept in the node's state."""
    cfg = silo(rho=0.4, zeta=0.4, **{"local-epochs": 1, "q-estimator": "counted"})
    assert cfg.q_pooling == "auto" and cfg.q_pooling_mode == "cumulative"
    local = partition_data(cfg, 1, CPU)
    val = local.validation
    models = [initial_model(cfg, local.data.task) for _ in range(2)]
    LocalJob(cfg, local, models[1], 1, 1, 1).train()  # the second round's model has learnt
    joints = [compute_confident_joint(local.labels[val], predict_proba(
        m, local.x, BatchTransform.of(local.spec, CPU))[val], calibrate=False) for m in models]
    for pooling, expected in (("cumulative", joints[0] + joints[1]), ("none", joints[1])):
        keys = load_run_config({**cfg.to_flat(), "q-pooling": pooling})
        state = RecordDict()
        for rnd, model in zip((3, 4), models):  # a copy: the update trains it in place
            job = LocalJob(keys, local, copy.deepcopy(model), 2, rnd, rnd, state)
            fedefc(job)
        np.testing.assert_allclose(job.last_q, column_normalize(expected))
        assert (POOLED_COUNTS in state) == (pooling == "cumulative")
    assert not np.allclose(column_normalize(joints[0] + joints[1]), column_normalize(joints[1]))


def test_the_shrunk_estimator_pulls_the_pooled_counts_towards_the_identity():
    """``q-estimator = "shrunk"`` (the default when every client trains every round): the
    Q of a client's second phase-2 round is the column-normalized sum of both rounds'
    cleanlab confident joints, each column shrunk towards e_j by the evidence of this
    round's counts (common/transition.py: shrink_to_identity, tested by hand there)."""
    cfg = silo(rho=0.4, zeta=0.4, **{"local-epochs": 1})
    assert cfg.q_estimator == "auto" and q_estimator_used(cfg) == "shrunk"
    local = partition_data(cfg, 1, CPU)
    val = local.validation
    models = [initial_model(cfg, local.data.task) for _ in range(2)]
    LocalJob(cfg, local, models[1], 1, 1, 1).train()
    joints = [compute_confident_joint(local.labels[val], predict_proba(
        m, local.x, BatchTransform.of(local.spec, CPU))[val], calibrate=False) for m in models]
    state = RecordDict()
    for rnd, model in zip((3, 4), models):
        job = LocalJob(cfg, local, copy.deepcopy(model), 2, rnd, rnd, state)
        fedefc(job)
    expected = shrink_to_identity(column_normalize(joints[0] + joints[1]), joints[1].sum(0))
    np.testing.assert_allclose(job.last_q, expected)
    assert not np.allclose(expected, column_normalize(joints[0] + joints[1]))


@pytest.mark.parametrize("keys, pooling", [
    ({}, "none"),                                            # the default run: 10 of 20
    ({"num-clients": 100, "fraction": 0.1}, "none"),        # the paper's settings
    ({"num-clients": 5, "fraction": 0.9}, "none"),          # int(4.5) = 4 of 5
    ({"num-clients": 5, "fraction": 1.0}, "cumulative"),    # every client, every round
    ({"num-clients": 5, "fraction": 1.0, "q-pooling": "none"}, "none"),
    ({"num-clients": 20, "fraction": 0.5, "q-pooling": "cumulative"}, "cumulative"),
    ({"num-clients": 5, "fraction": 1.0, "method": "confident-learning"}, "none"),
    ({"num-clients": 5, "fraction": 1.0, "method": "fedavg"}, "none"),
])
def test_the_counts_are_pooled_where_every_client_trains_every_round(keys, pooling):
    """``auto`` pools where every client trains in every round, a named pooling is kept,
    and only FedEFC pools; the summary says what the run did, and a pooling run does not
    resume exactly (its nodes' state starts empty in a resumed run)."""
    cfg = load_run_config(keys)
    assert counts_pooling(cfg) == pooling
    assert resumes_exactly(cfg) == (pooling == "none" and METHODS[cfg.method].exact_resume)
    if METHODS[cfg.method].prestopping:
        server = PrestoppingServer(cfg, ClassifierShape(10, 84))
        assert server.summary_fields()["q_pooling"] == pooling


@pytest.mark.parametrize("keys, says", [
    ({"num-clients": 5, "fraction": 1.0}, "pooled phase-2 counts (q-pooling)"),
    ({"num-clients": 5, "fraction": 1.0, "q-pooling": "none"}, None),
    ({"num-clients": 20, "fraction": 0.5}, None),
    ({"method": "fedcorr"}, "what fedcorr's clients keep across rounds"),
])
def test_resuming_a_run_that_cannot_end_exactly_says_so(keys, says, tmp_path):
    """``fedefc resume`` prints what the nodes' state held and that the resumed run will
    not end bit for bit as the uninterrupted one; nothing for a run that will."""
    (tmp_path / "config.json").write_text(json.dumps(load_run_config(keys).to_flat()))
    note = inexact_resume_note(resume_config(str(tmp_path), []))
    assert (note is None) == (says is None)
    if says:
        assert says in note and "will not end bit for bit" in note


def test_a_stored_run_from_before_the_estimator_and_the_guard_is_todays_where_neither_runs():
    """A run stored without ``q-estimator``, ``phase-2-guard`` and
    ``validation-max-per-class`` counted Q, had no guard and no cap: today's config where
    ``auto`` resolves to those (part of the clients per round, or FedAvg), another where
    the defaults now shrink and guard (a grid must not mix them)."""
    new = ("q-estimator", "phase-2-guard", "validation-max-per-class")
    for keys, same in (({"num-clients": 20, "fraction": 0.5}, True),
                       ({"num-clients": 5, "fraction": 1.0, "method": "fedavg"}, True),
                       ({"num-clients": 5, "fraction": 1.0}, False),
                       ({"num-clients": 5, "fraction": 1.0, "q-estimator": "counted",
                         "phase-2-guard": "off"}, True)):
        wanted = load_run_config(keys).to_flat()
        older = {k: v for k, v in wanted.items() if k not in new}
        assert (changed_keys(older, wanted) == {}) == same, keys
    full = load_run_config({"num-clients": 5, "fraction": 1.0}).to_flat()
    assert changed_keys({**full, "q-estimator": "shrunk", "phase-2-guard": "on"}, full) == {}
    assert changed_keys({**full, "validation-max-per-class": 7}, full) == {
        "validation-max-per-class": (7, full["validation-max-per-class"])}


def test_a_stored_run_from_before_pooling_is_todays_config_where_nothing_pools():
    """A run stored without ``q-pooling`` pooled nothing: today's config where ``auto``
    resolves to ``none`` (or the method does not pool), another config where FedEFC now
    pools (a grid must not mix them)."""
    for keys, same in (({"num-clients": 20, "fraction": 0.5}, True),
                       ({"num-clients": 5, "fraction": 1.0, "method": "fedavg"}, True),
                       ({"num-clients": 5, "fraction": 1.0}, False),
                       ({"num-clients": 5, "fraction": 1.0, "q-pooling": "none"}, True)):
        wanted = load_run_config({"q-estimator": "counted", "phase-2-guard": "off",
                                  **keys}).to_flat()
        older = {k: v for k, v in wanted.items() if k != "q-pooling"}
        assert (changed_keys(older, wanted) == {}) == same, keys
    full = load_run_config({"num-clients": 5, "fraction": 1.0}).to_flat()
    assert changed_keys({**full, "q-pooling": "cumulative"}, full) == {}


def test_the_held_out_signal_is_the_received_models_accuracy_on_the_share():
    """Computed here from the received model's predictions; after the model has fitted
    the client's noisy training part, the paper's signal (accuracy on the labels it
    trained on) measures that fit, the held-out one does not."""
    cfg = silo(iid=True, rho=0.4, zeta=0.4, **{"num-clients": 10, "local-epochs": 1})
    local = partition_data(cfg, 1, CPU)
    model = initial_model(cfg, local.data.task)
    memorize = LocalJob(load_run_config({**cfg.to_flat(), "local-epochs": 40}), local,
                        model, 1, 1, 1)
    memorize.train()  # 40 epochs on the training part, the share held back
    weights = get_weights(model)
    probs = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU)).argmax(1)
    val = local.validation
    train = np.setdiff1d(np.arange(len(local)), val)
    expected = {"held-out": float(np.mean(probs[val] == local.labels[val])),
                "global": float(np.mean(probs == local.labels))}
    reported = {}
    for signal in expected:
        keys = {**cfg.to_flat(), "accuracy-signal": signal}
        client = MethodClient(load_run_config(keys), 1, lambda: local, RecordDict())
        reported[signal] = client.fit(weights, {"phase": 1, "round": 2, "seed": 2})[2]["accuracy"]
        assert reported[signal] == pytest.approx(expected[signal], abs=1e-12)
    assert float(np.mean(probs[train] == local.labels[train])) > 0.95  # it fitted the noise
    assert reported["global"] > reported["held-out"] + 0.2


@pytest.mark.parametrize("method, phase, passes", [
    ("fedavg", None, 0),   # reads no prediction: none is made
    ("fedprox", None, 0),
    ("fedefc", 1, 1),      # A_k, the paper's signal: the received model on every sample
    ("fedefc", 2, 1),      # Q from the received model's predictions (docs/FEDEFC.md §4)
])
def test_a_client_predicts_with_the_received_model_only_where_it_reads_the_predictions(
        method, phase, passes):
    """The prediction pass over the local data (eval mode) is made once where the
    signal or the method reads it and not at all elsewhere: FedAvg's clients pay none.
    Counted with a forward hook on the process's model, the one the client trains."""
    cfg = load_run_config({"method": method, "num-clients": 4, "fraction": 0.5,
                           "local-epochs": 1})
    local = partition_data(cfg, 1, CPU)
    weights = get_weights(initial_model(cfg, local.data.task))
    seen = []
    model = model_for(cfg, local.data.task, CPU)
    hook = model.register_forward_hook(
        lambda m, args, out: None if m.training else seen.append(len(args[0])))
    try:
        config = {"round": 2, "seed": 2, **({} if phase is None else {"phase": phase})}
        _, _, metrics = MethodClient(cfg, 1, lambda: local, RecordDict()).fit(weights, config)
    finally:
        hook.remove()
    assert sum(seen) == passes * len(local)
    if phase == 1:  # taken from the received model, before training changed it
        received = predict_proba(initial_model(cfg, local.data.task), local.x,
                                 BatchTransform.of(local.spec, CPU)).argmax(1)
        assert metrics["accuracy"] == pytest.approx(np.mean(received == local.labels),
                                                    abs=1e-12)


def test_the_received_models_predictions_cannot_be_read_after_training():
    """A local update that reads ``job.probs`` after it trained would count Q from the
    trained model, not the received one: refused, saying why."""
    cfg = load_run_config({"local-epochs": 1})
    local = partition_data(cfg, 1, CPU)
    job = LocalJob(cfg, local, initial_model(cfg, local.data.task), 2, 3, 3)
    job.train()
    with pytest.raises(RuntimeError, match="before it trains"):
        job.probs  # noqa: B018


# -- where a run keeps no share -----------------------------------------------------------------
@pytest.mark.parametrize("keys, signal", [
    ({}, "global"),                                          # the default run: 10 of 20
    ({"num-clients": 100, "fraction": 0.1}, "global"),      # the paper's settings
    ({"num-clients": 5, "fraction": 0.9}, "global"),        # int(4.5) = 4 of 5
    ({"num-clients": 3, "fraction": 0.99}, "global"),       # 2 of 3
    ({"num-clients": 5, "fraction": 1.0}, "held-out"),      # every client, every round
    ({"num-clients": 1, "fraction": 1.0}, "held-out"),      # the one client, every round
    ({"num-clients": 5, "fraction": 1.0, "prestopping": False}, "global"),  # no signal used
    ({"num-clients": 5, "fraction": 1.0, "accuracy-signal": "global"}, "global"),
    ({"num-clients": 100, "fraction": 0.1, "accuracy-signal": "held-out"}, "held-out"),
])
def test_the_default_signal_is_the_papers_unless_every_client_trains_every_round(keys, signal):
    """``auto`` (the default) keeps the paper's signal, and no share, wherever a round
    samples part of the clients, and takes the held-out one when every client trains in
    every round (docs/FEDEFC.md §3.1); a named signal is kept as named."""
    cfg = load_run_config(keys)
    assert cfg.accuracy_signal == keys.get("accuracy-signal", "auto")
    assert cfg.accuracy_signal_mode == signal
    share = cfg.validation_fraction if signal == "held-out" else 0.0
    assert validation_share(cfg) == share
    assert validation_share(load_run_config({**keys, "method": "fedavg"})) == 0.0
    with open(CONFIGS_DIR.parent / "pyproject.toml", "rb") as fh:
        app = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert app["accuracy-signal"] == "auto"


def test_a_stored_run_of_the_papers_signal_is_todays_auto_where_auto_resolves_to_it():
    """Results and checkpoints made before ``auto`` (stored ``global``, or without the key)
    still count as this config where ``auto`` resolves to the paper's signal, and as
    another config where it resolves to the held-out one (a grid must not mix them)."""
    partial = load_run_config({"num-clients": 20, "fraction": 0.5}).to_flat()
    full = load_run_config({"num-clients": 5, "fraction": 1.0}).to_flat()
    for wanted, same in ((partial, True), (full, False)):
        older = {k: v for k, v in wanted.items() if k != "accuracy-signal"}
        for stored in ({**wanted, "accuracy-signal": "global"}, older):
            assert (changed_keys(stored, wanted) == {}) == same
    assert changed_keys({**full, "accuracy-signal": "held-out"}, full) == {}


@pytest.mark.parametrize("keys, signal, share", [
    ({"num-clients": 5, "fraction": 1.0}, "held-out", 0.4),
    ({"num-clients": 20, "fraction": 0.5}, "global", 0.0),
    ({"num-clients": 5, "fraction": 1.0, "validation-fraction": 0.2}, "held-out", 0.2),
])
def test_the_summary_says_which_signal_auto_chose_and_the_share_it_kept(keys, signal, share):
    server = PrestoppingServer(load_run_config(keys), ClassifierShape(10, 84))
    fields = server.summary_fields()
    assert fields["accuracy_signal"] == signal and fields["validation_share"] == share


def test_a_changed_share_orphans_only_the_stored_runs_that_kept_one():
    """The default share went from 0.2 to 0.4 (docs/FEDEFC.md §3.1): a stored run with
    0.2 that kept no share (another method, the paper's signal) is still this config; one
    that kept a share of 0.2 is another."""
    for keys, kept in (({"method": "fedavg", "num-clients": 5, "fraction": 1.0}, False),
                       ({"num-clients": 20, "fraction": 0.5}, False),
                       ({"num-clients": 5, "fraction": 1.0}, True),
                       ({"accuracy-signal": "held-out"}, True)):
        wanted = load_run_config(keys).to_flat()
        assert wanted["validation-fraction"] == 0.4
        stored = {**wanted, "validation-fraction": 0.2}
        assert changed_keys(stored, wanted) == ({"validation-fraction": (0.2, 0.4)} if kept
                                                else {})


def test_the_methods_with_a_share_are_the_ones_with_fedefcs_server():
    for method in METHODS.values():
        assert method.prestopping == issubclass(load_object(method.server), PrestoppingServer)
    assert {m for m, entry in METHODS.items() if entry.prestopping} == {
        "fedefc", "forward-correction", "confident-learning"}


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIGS_DIR / "grids").glob("*.toml")
                                        if p.stem.startswith(("paper-", "mnist-lite-"))))
def test_every_paper_and_mnist_lite_cell_keeps_the_papers_signal(name, tmp_path):
    """The shipped cross-device grids run the paper's signal and its prestopping rule
    (no minimum gain), train on all their data, count each phase-2 round anew with the
    paper's estimator and run to the last round without the phase-2 guard, one model
    (no twin)."""
    for cell in Grid.load(name).cells(tmp_path, ["data-dir=/data"]):
        cfg = load_run_config(cell.config)
        assert cfg.accuracy_signal_mode in ("global", "local-train"), cell
        assert validation_share(cfg) == 0.0, cell
        assert counts_pooling(cfg) == "none", cell
        assert q_estimator_used(cfg) == "counted", cell
        assert not cfg.guarded, cell
        assert cfg.min_gain_setting == 0.0, cell
        assert not cfg.twinned, cell  # one model
