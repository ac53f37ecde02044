"""The round pipeline against Flower's own FedAvg, and FedEFC's phase switch, driven
through Flower's Strategy calls (one RoundStrategy per round)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import FedAvg

from fedefc_client.client_app import app as client_app
from fedefc_server import federation
from fedefc_server.declarations import SizeRule
from fedefc_server.failures import NodeRefused, RunFailed
from tests.helpers import (
    PARAMS,
    FakeProxy,
    InProcessGrid,
    make_driver,
    manager,
    partition_manager,
    partition_nodes,
    trained_reply,
)


def fedefc(**overrides):
    """FedEFC on 10 clients, 5 per round, switching at the first round without gain."""
    return make_driver(**{"method": "fedefc", "num-clients": 10, "fraction": 0.5,
                          "start-round": 0, "gamma-thr": 1, "rounds": 10, "prestopping": True,
                          **overrides})


def fleet(rng, n_nodes):
    """Nodes serving partitions 0..n-1 with random sizes, and their client manager."""
    nodes = partition_nodes(n_nodes, sizes=[int(x) for x in rng.integers(1, 500, n_nodes)])
    return nodes, manager(nodes)


def fit_results(rng, nodes, accuracies=None):
    results = []
    for node in nodes:
        arrays = [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=5).astype(np.float32)]
        metrics = {} if accuracies is None else {  # with a twin, its reading too
            "accuracy": accuracies[node.partition_id],
            "guard-accuracy": accuracies[node.partition_id]}
        results.append(trained_reply(node, arrays, **metrics))
    return results


@pytest.mark.parametrize("method", ["fedavg", "fedefc"])
def test_aggregation_equals_flower_fedavg(method):
    rng = np.random.default_rng(0)
    nodes, m = fleet(rng, 10)
    results = fit_results(rng, nodes[:6], accuracies=[0.5] * 6)
    strategy = make_driver(**{"method": method, "num-clients": 10, "fraction": 1.0})
    strategy.configure_fit(1, PARAMS, m)
    ours, _ = strategy.aggregate_fit(1, list(results), [])
    theirs, _ = FedAvg().aggregate_fit(1, list(results), [])
    for a, b in zip(parameters_to_ndarrays(ours), parameters_to_ndarrays(theirs)):
        np.testing.assert_array_equal(a, b)
    # and the weighted mean by sample count, computed independently
    n = np.array([r.num_examples for _, r in results], dtype=float)
    arrays = [parameters_to_ndarrays(r.parameters) for _, r in results]
    for layer, got in enumerate(parameters_to_ndarrays(ours)):
        expected = sum(w * a[layer] for w, a in zip(n / n.sum(), arrays))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_reply_order_does_not_change_the_aggregate():
    rng = np.random.default_rng(1)
    nodes, m = fleet(rng, 10)
    results = fit_results(rng, nodes[:8], accuracies=[0.5] * 8)
    strategy = fedefc(fraction=1.0)
    strategy.configure_fit(1, PARAMS, m)
    first, _ = strategy.aggregate_fit(1, list(results), [])
    strategy = fedefc(fraction=1.0)
    strategy.configure_fit(1, PARAMS, m)
    shuffled = [results[i] for i in rng.permutation(len(results))]
    second, _ = strategy.aggregate_fit(1, shuffled, [])
    assert first.tensors == second.tensors


def test_accuracy_is_unweighted_mean():
    rng = np.random.default_rng(2)
    nodes, m = fleet(rng, 10)
    strategy = fedefc(fraction=1.0)
    strategy.configure_fit(1, PARAMS, m)
    strategy.aggregate_fit(1, fit_results(rng, nodes[:4], accuracies=[0.1, 0.2, 0.3, 1.0]), [])
    assert strategy.server.prestopper.history == [(1, pytest.approx(0.4))]
    assert strategy.fields()["A"] == pytest.approx(0.4)


def test_fedavg_asks_no_accuracy_and_sends_no_phase():
    """FedAvg's replies need no accuracy (nothing beyond the weights is asked of a
    client), and its round config is the round and the client's seed only."""
    rng = np.random.default_rng(4)
    nodes, m = fleet(rng, 4)
    strategy = make_driver(**{"method": "fedavg", "num-clients": 4, "fraction": 1.0})
    instructions = strategy.configure_fit(1, PARAMS, m)
    assert all(set(ins.config) == {"round", "seed"} for _, ins in instructions)
    params, _ = strategy.aggregate_fit(1, fit_results(rng, nodes), [])
    fields = strategy.fields()
    assert params is not None and fields["rejected"] == 0 and "A" not in fields
    assert strategy.server.state_fields(1) == {}


def test_no_round_state_carries_over_to_the_next_round():
    """Each round's record starts from its own plan: a refused reply of round 1 is not
    counted again in round 2, and a strategy answers for its own round only."""
    rng = np.random.default_rng(5)
    nodes, m = fleet(rng, 4)
    strategy = make_driver(**{"method": "fedavg", "num-clients": 4, "fraction": 1.0})
    strategy.configure_fit(1, PARAMS, m)
    round_1 = strategy.strategy
    bad = trained_reply(nodes[0], [np.zeros((2, 2), np.float32)])
    strategy.aggregate_fit(1, [bad, *fit_results(rng, nodes[1:])], [])
    assert strategy.fields()["rejected"] == 1
    strategy.configure_fit(2, PARAMS, m)
    assert set(strategy.fields()) == {"sampled"}  # the plan's fields only, so far
    strategy.aggregate_fit(2, fit_results(rng, nodes), [])
    assert strategy.fields()["rejected"] == 0 and strategy.strategy is not round_1
    assert round_1.outcome.record["rejected"] == 1


def test_after_the_switch_every_client_gets_phase_2():
    rng = np.random.default_rng(3)
    strategy = fedefc()
    nodes, m = fleet(rng, 10)
    params = PARAMS
    phases = []
    for rnd, acc in enumerate([0.5, 0.4, 0.9, 0.9], start=1):
        instructions = strategy.configure_fit(rnd, params, m)
        assert len(instructions) == 5
        phases.append({int(ins.config["phase"]) for _, ins in instructions})
        strategy.aggregate_fit(rnd, fit_results(rng, [p for p, _ in instructions],
                                                [acc] * 10), [])
    assert strategy.server.prestopper.t_e == 2
    assert phases == [{1}, {1}, {2}, {2}]


def test_each_client_gets_its_own_config_copy_and_seed():
    strategy = fedefc()
    instructions = strategy.configure_fit(1, PARAMS, partition_manager(10))
    configs = [ins.config for _, ins in instructions]
    assert len({id(c) for c in configs}) == len(configs)
    assert len({c["seed"] for c in configs}) == len(configs)
    assert {c["round"] for c in configs} == {1}


def test_sampling_is_by_partition_id_and_seeded():
    a = fedefc()
    b = fedefc()
    params = PARAMS
    for rnd in (1, 2, 3):
        # different node ids (as in two Flower runs), same partitions -> same sample
        pa = [p.partition_id for p, _ in a.configure_fit(rnd, params, partition_manager(10))]
        other = SimpleClientManager()
        for pid in range(10):
            other.register(FakeProxy(str(99 + 7 * (10 - pid)), pid))
        pb = [p.partition_id for p, _ in b.configure_fit(rnd, params, other)]
        assert pa == pb and len(set(pa)) == 5
    c = fedefc(seed=1)
    assert [p.partition_id for p, _ in c.configure_fit(1, params, partition_manager(10))] != \
        [p.partition_id for p, _ in a.configure_fit(1, params, partition_manager(10))]


class ArrivingManager(SimpleClientManager):
    """A client manager whose nodes arrive a few at a time: each look at ``all()``
    registers the next ``step`` of ``nodes`` (as Flower's update thread would)."""

    def __init__(self, nodes, step):
        super().__init__()
        self.pending, self.step, self.looks = list(nodes), step, 0

    def all(self):
        self.looks += 1
        for node in self.pending[:self.step]:
            self.register(node)
        self.pending = self.pending[self.step:]
        return super().all()


def test_a_run_waits_for_every_partition_before_its_first_round_resumed_or_not():
    """A run (resumed at round 6, or fresh) must not sample from the few nodes that
    happen to be connected already: it waits until every partition is served, once."""
    for first_round in (1, 6):
        manager = ArrivingManager([FakeProxy(str(5_000 + p), p) for p in range(10)], 4)
        strategy = fedefc()
        strategy.configure_fit(first_round, PARAMS, manager)
        assert manager.looks == 3 and not manager.pending  # 4, 8, then all 10 nodes
        assert len(strategy.fields()["sampled"]) == 5
        assert set(strategy.registry.declared) == set(range(10))
        strategy.configure_fit(first_round + 1, PARAMS, manager)
        assert manager.looks == 4  # a later round does not wait again


class Misconfigured(FakeProxy):
    """A node whose ClientApp refuses the run's config: it answers with an error."""

    def get_properties(self, ins, timeout, group_id):
        raise ValueError("num-partitions=3 differs from the run's num-clients=4")


def test_a_federation_that_never_forms_fails_the_run_naming_what_is_missing():
    """Three nodes, each refusing the run's config (started with another num-partitions),
    for four partitions: after wait-for-nodes the run fails with who is missing and the
    nodes' own errors."""
    nodes = [Misconfigured(str(6_000 + p), p) for p in range(3)]
    strategy = make_driver(**{"method": "fedavg", "num-clients": 4, "fraction": 1.0,
                              "wait-for-nodes": 2.0})
    with pytest.raises(RunFailed) as err:
        strategy.configure_fit(1, PARAMS, manager(nodes))
    text = str(err.value)
    assert "waited 2 s (wait-for-nodes) for a node of each of the run's 4 partitions" in text
    assert "0 of 4 partitions served by 3 connected nodes; missing partitions 0-3" in text
    assert "node 6000 failed to declare: num-partitions=3 differs" in text


def test_nodes_that_refuse_the_runs_config_fail_it_at_once_not_after_wait_for_nodes(
        monkeypatch):
    """Issue 30's trial: three real ClientApps started for 3 partitions, a run of
    num-clients=4. Every node refuses the config, and would for ever: the run fails once
    they have stood by it for SETTLE_S, naming the nodes and their reason, not after the
    300 s of wait-for-nodes."""
    monkeypatch.setattr(federation, "SETTLE_S", 1.0)
    flat = {"method": "fedavg", "num-clients": 4, "fraction": 1.0, "prestopping": False}
    grid = InProcessGrid(client_app, flat, 3)
    driver = make_driver(**flat)
    assert driver.pipeline.cfg.wait_for_nodes == 300.0
    start = time.monotonic()
    with pytest.raises(RunFailed) as err:
        driver.configure_fit(1, PARAMS, grid.manager())
    assert time.monotonic() - start < 30.0
    text = str(err.value)
    assert text.startswith("every node that connected refused the run for a reason that "
                           "waiting does not change")
    assert "0 of 4 partitions served by 3 connected nodes; missing partitions 0-3" in text
    for nid in (1000, 1001, 1002):
        assert (f"node {nid} failed to declare: error 2: ConfigError: node {nid}: "
                "num-partitions=3 differs from the run's num-clients=4") in text


class FakeClock:
    """The federation's clock: its sleeps pass at once, and it says how long they were."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("connected, settles", [(3, False), (2, True)],
                         ids=["whole-federation", "two-of-three"])
def test_the_whole_federation_refusing_the_runs_num_clients_fails_it_without_a_pause(
        monkeypatch, connected, settles):
    """Issue 49's trial: every node refused a num-clients mismatch, and the run still
    paused SETTLE_S (20 s) for nodes that might connect. When the nodes that refused are
    all the nodes they were started for (each says num-partitions=3, and 3 are
    connected), none is still to come: the run fails without the pause. Two of those
    three still wait for the third."""
    clock = FakeClock()
    monkeypatch.setattr(federation, "time", clock)
    flat = {"method": "fedavg", "num-clients": 4, "fraction": 1.0, "prestopping": False}
    grid = InProcessGrid(client_app, flat, connected,
                         {k: {"num-partitions": 3} for k in range(connected)})
    with pytest.raises(RunFailed) as err:
        make_driver(**flat).configure_fit(1, PARAMS, grid.manager())
    assert str(err.value).startswith("every node that connected refused the run")
    assert (clock.now >= federation.SETTLE_S) is settles, clock.now


def test_a_node_whose_policy_refuses_the_run_fails_it_at_once(monkeypatch, tmp_path):
    """The one node there refuses by its own policy (a lasting refusal, Flower's code 6)."""
    monkeypatch.setattr(federation, "SETTLE_S", 1.0)
    policy = tmp_path / "policy.toml"
    policy.write_text("min-dp-noise-multiplier = 0.5")
    policy.chmod(0o600)
    flat = {"method": "fedavg", "num-clients": 2, "fraction": 1.0, "prestopping": False}
    grid = InProcessGrid(client_app, {**flat}, 1, {0: {"policy-file": str(policy),
                                                      "num-partitions": 2}})
    start = time.monotonic()
    with pytest.raises(RunFailed, match="node 1000 failed to declare: error 6: this node's "
                                        "policy refuses the run: dp-noise-multiplier=0 "):
        make_driver(**flat).configure_fit(1, PARAMS, grid.manager())
    assert time.monotonic() - start < 30.0


@pytest.mark.parametrize("code, reason, lasting", [
    (6, "this node's policy refuses the run: ...", True),  # policy_mod
    (2, "ConfigError: node 4: num-partitions=3 differs ...", True),  # the node's config
    (2, "PolicyError: node policy ... is not valid TOML", True),  # its policy file
    (2, "RuntimeError: CUDA out of memory", False),  # may pass
    (2, "PrivateDataError: data-path ... does not exist", False),  # fixable while waiting
    (5, "Node Unavailable", False),  # Flower's: the node went away
])
def test_only_a_config_or_policy_refusal_is_lasting(code, reason, lasting):
    assert NodeRefused(code, reason).permanent is lasting


class Crashing(FakeProxy):
    """A node whose ClientApp crashes on the declaration: it may not next time."""

    def get_properties(self, ins, timeout, group_id):
        raise RuntimeError("the node ran out of memory")


def test_nodes_that_fail_for_a_passing_reason_are_waited_for():
    nodes = [Crashing(str(6_000 + p), p) for p in range(3)]
    driver = make_driver(**{"method": "fedavg", "num-clients": 4, "fraction": 1.0,
                            "wait-for-nodes": 2.0})
    with pytest.raises(RunFailed, match=r"waited 2 s \(wait-for-nodes\)"):
        driver.configure_fit(1, PARAMS, manager(nodes))


def test_when_every_node_has_answered_the_run_starts_without_the_missing_partition(
        monkeypatch):
    """Four nodes for four partitions, one of which refuses the run: once every node has
    answered there is nothing to wait for; the run starts with the three, and its first
    record and its notes name the partition it lacks and why (not after wait-for-nodes:
    the registry never even pauses to look again)."""
    def no_wait(seconds):
        pytest.fail(f"the run waited for the nodes ({seconds} s)")

    monkeypatch.setattr(federation, "time", SimpleNamespace(monotonic=time.monotonic,
                                                            sleep=no_wait))
    nodes = [FakeProxy(str(6_000 + p), p) for p in range(3)] + [Misconfigured("6099", 3)]
    strategy = make_driver(**{"method": "fedavg", "num-clients": 4, "fraction": 1.0})
    strategy.configure_fit(1, PARAMS, manager(nodes))
    assert strategy.fields()["sampled"] == [0, 1, 2]
    assert strategy.fields()["missing_partitions"] == [3]
    (note,) = strategy.pipeline.notes()
    assert note.startswith("the run started without partitions 3: 3 of 4 partitions")
    assert "node 6099 failed to declare: num-partitions=3 differs" in note


def test_a_run_whose_every_node_is_refused_fails_at_once():
    """Every node declares a size its partition does not have: none is admitted, so the
    run would train nothing; it fails as soon as all have answered."""
    nodes = partition_nodes(3, sizes=[11, 11, 11])
    strategy = make_driver(**{"method": "fedavg", "num-clients": 3, "fraction": 1.0})
    strategy.pipeline.registry.rule = SizeRule(3, [10, 10, 10], 4000)
    with pytest.raises(RunFailed, match="every node that connected was refused or failed"):
        strategy.configure_fit(1, PARAMS, manager(nodes))
