"""A simulation's clients sent in groups and stepped together (``stacked-clients``):
the server's cut and reassembly (fedefc_server/client_groups.py), a node serving a
group (fedefc_client/client_group.py) against each member's own message, what is
refused, and a real simulation against the same run without groups.

Equality: a member's update is its lone one up to float32 rounding carried through
its steps (tests/test_stacked_training.py). On the embedded data that rounding now and
then tips a ReLU or a max-pool choice, after which the difference grows: most members
end within 1e-6 of their lone update's change, a tipped one up to 4 % away (confident
learning, partition 2 beside 0 and 3; its lone update started from weights perturbed
by 1e-7 lands as far, 3.9 %, in one draw of five). The bound: every member of a group
of three within 10 % of the change, all but one within 1e-3. A wrong batch order moves
every member by 7 % (forward correction from the untrained model, whose updates barely
depend on the order) to about all of the change.
"""

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from common.config import ConfigError
from common.messages import FitConfig, FitReply, group_dumps, group_loads
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from fedefc_client.client import MethodClient
from fedefc_client.run_client import method_client
from fedefc_client.local_data import partition_data
from fedefc_server import server_app
from fedefc_server.client_groups import group_instructions, ungroup
from fedefc_server.failures import Attributed, NodeFailed
from fedefc_server.plan import round_config
from tests.helpers import FakeProxy, records, small_job

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
OK = Status(Code.OK, "")


def distance(have: list[np.ndarray], want: list[np.ndarray], start: list[np.ndarray]) -> float:
    """||have - want|| / ||want - start|| over all arrays."""
    def flat(a, b):
        return np.concatenate([(x - y).ravel() for x, y in zip(a, b)])
    return float(np.linalg.norm(flat(have, want)) / np.linalg.norm(flat(want, start)))


STEPPED = [("fedavg", None), ("fedefc", 1), ("fedefc", 2), ("forward-correction", 2),
           ("confident-learning", 2)]
IN_TURN = [("fedprox", None), ("fednoro", None), ("rofl", None)]


@pytest.mark.parametrize(("method", "phase"), STEPPED + IN_TURN)
def test_a_node_trains_a_group_as_each_member_alone(method, phase):
    """Three partitions in one message against each in its own: counts, metrics and
    weights per member, for every method a group may hold. Each member steps with its
    own loss (FedEFC's and forward correction's Q, confident learning's kept samples);
    FedProx's proximal term and FedNoRo's and RoFL's batch losses are not stepped
    together, so those members train in turn, each exactly as alone."""
    cfg = load_run_config({"method": method, "num-clients": 4, "fraction": 0.5,
                           "local-epochs": 1})
    data = {p: partition_data(cfg, p, CPU) for p in range(4)}
    weights = get_weights(initial_model(cfg, data[0].data.task))

    def client(p: int) -> MethodClient:
        return MethodClient(cfg, p, lambda: data[p], RecordDict())

    def config(p: int) -> dict:
        return {**round_config(cfg, p, 2), **({} if phase is None else {"phase": phase})}

    pids = [0, 2, 3]
    alone = {p: client(p).fit(weights, config(p)) for p in pids}
    lead = client(0)
    lead.member = client
    arrays, count, metrics = lead.fit(weights, {
        **config(0), FitConfig.GROUP: group_dumps([[p, config(p)] for p in pids])})
    members = group_loads(metrics[FitReply.GROUP])
    assert [m[0] for m in members] == pids
    assert count == sum(alone[p][1] for p in pids)
    per = len(weights)
    assert len(arrays) == per * len(pids)
    distances = []
    for k, (pid, n, got) in enumerate(members):
        want_weights, want_n, want = alone[pid]
        assert n == want_n
        assert set(got) == set(want)
        for key in set(want) - {FitReply.FIT_S, FitReply.TRAIN_LOSS}:
            assert got[key] == want[key], key
        assert got[FitReply.TRAIN_LOSS] == pytest.approx(want[FitReply.TRAIN_LOSS], rel=1e-2)
        have = arrays[k * per:(k + 1) * per]
        if (method, phase) in IN_TURN:
            assert all(np.array_equal(a, b) for a, b in zip(have, want_weights))
        else:
            distances.append(distance(have, want_weights, weights))
    if distances:  # at most one member tipped, none far (module docstring)
        assert max(distances) < 0.1 and sorted(distances)[-2] < 1e-3, distances


def test_a_node_with_its_own_data_refuses_a_group():
    cfg = load_run_config({"num-clients": 4, "fraction": 0.5})
    client = MethodClient(cfg, 0, lambda: partition_data(cfg, 0, CPU), RecordDict(),
                          private_data=True)
    client.member = lambda p: client
    with pytest.raises(ConfigError, match="stacked-clients=0"):
        client.fit([], {**round_config(cfg, 0, 1), FitConfig.GROUP: "[[0, {}], [1, {}]]"})


def test_only_a_simulated_node_serves_a_group(tmp_path):
    """A node whose config holds only its partition (Flower's simulated nodes) serves a
    group; an operator's node (here with a cache-dir) refuses one, whatever the server
    sends."""
    run_config = load_run_config({"num-clients": 4, "fraction": 0.5}).to_flat()
    ids = {"partition-id": 0, "num-partitions": 4}
    simulated = method_client(Context(1, 5, ids, RecordDict(), run_config))
    assert simulated.member is not None and simulated.member(2).partition_id == 2
    operator = method_client(Context(1, 5, {**ids, "cache-dir": str(tmp_path)}, RecordDict(),
                                     run_config))
    cfg = load_run_config(run_config)
    group = group_dumps([[0, round_config(cfg, 0, 1)], [1, round_config(cfg, 1, 1)]])
    with pytest.raises(ConfigError, match="only a simulation's nodes serve"):
        operator.fit([], {**round_config(cfg, 0, 1), FitConfig.GROUP: group})


def fit_ins(pid: int) -> FitIns:
    return FitIns(ndarrays_to_parameters([np.zeros(2)]), {"round": 1, "seed": 10 + pid})


def test_the_server_cuts_a_round_into_groups_and_puts_their_replies_back():
    """Five partitions in groups of 2: two group messages and one lone one (ten in
    groups of at most 4: three messages of 4, 3 and 3, not 4, 4 and 2); a group's
    reply comes back as its members' replies, each under its own node; a reply that
    holds other partitions, and a group that failed, fail each member by name."""
    nodes = [Attributed(FakeProxy(f"node-{p}", p), p) for p in range(5)]
    sent, groups = group_instructions([(n, fit_ins(n.partition)) for n in nodes], 2,
                                      lambda cid: int(cid.split("-")[1]))
    assert [proxy.cid for proxy, _ in sent] == ["node-0", "node-2", "node-4"]
    ten = [(FakeProxy(f"node-{p}", p), fit_ins(p)) for p in range(10)]
    for size, cut in ((4, [4, 3, 3]), (3, [3, 3, 2, 2]), (5, [5, 5]), (10, [10])):
        _, by_lead = group_instructions(ten, size, lambda cid: int(cid.split("-")[1]))
        assert [len(m) for m in by_lead.values()] == cut, size  # the fewest, even messages
    assert json.loads(sent[1][1].config[FitConfig.GROUP]) == [
        [2, {"round": 1, "seed": 12}], [3, {"round": 1, "seed": 13}]]
    assert FitConfig.GROUP not in sent[2][1].config  # a group of one goes as it was
    assert sent[0][1].config["seed"] == 10  # the lead's own config for the mods

    def reply(pids, counts):
        arrays = [np.full(2, float(p)) for p in pids]
        members = [[p, n, {"partition-id": p}] for p, n in zip(pids, counts)]
        return FitRes(OK, ndarrays_to_parameters(arrays), sum(counts),
                      {FitReply.GROUP: json.dumps(members)})

    lone = FitRes(OK, ndarrays_to_parameters([np.full(2, 4.0)]), 9, {"partition-id": 4})
    results, failures = ungroup(
        [(sent[0][0], reply([0, 1], [5, 6])), (sent[1][0], reply([3, 2], [7, 8])),
         (sent[2][0], lone)], [], groups)
    assert [(proxy.cid, res.num_examples, res.metrics["partition-id"],
             parameters_to_ndarrays(res.parameters)[0][0]) for proxy, res in results] == [
        ("node-0", 5, 0, 0.0), ("node-1", 6, 1, 1.0), ("node-4", 9, 4, 4.0)]
    assert [(f.node, f.partition) for f in failures] == [("node-2", 2), ("node-3", 3)]
    assert "lists partitions [3, 2], not its members [2, 3]" in str(failures[0].cause)

    crash = NodeFailed("node-0", 0, RuntimeError("actor died"))
    _, failures = ungroup([], [crash], groups)
    assert [(f.node, f.partition, str(f.cause)) for f in failures] == [
        ("node-0", 0, "actor died"), ("node-1", 1, "actor died")]


@pytest.mark.parametrize(("keys", "names"), [
    ({"stacked-clients": 1}, "groups nothing"),
    ({"stacked-clients": 2, "method": "fedditto"}, "keeps each client's own state"),
    ({"stacked-clients": 2, "num-clients": 4, "fraction": 1.0}, "pooled counts"),
    ({"stacked-clients": 2, "secure-aggregation": True}, "secure aggregation"),
    ({"stacked-clients": 2, "step-capture": "cuda-graph"}, "step-capture"),
])
def test_what_a_group_cannot_hold_is_refused(keys, names):
    with pytest.raises(ConfigError, match=names):
        load_run_config(keys)


def gpu_table(heading: str) -> dict[int, float]:
    """{stacked-clients: s per round} of the table under ``heading`` in
    docs/BENCHMARKS.md."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    lines = text[text.index(heading):].splitlines()
    first = next(k for k, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    columns = rows[0]
    key, secs = columns.index("`stacked-clients`"), columns.index("s per round")
    return {int(row[key]): float(row[secs]) for row in rows[2:]}


def test_the_default_is_the_path_a_gpu_measured_fastest():
    """``stacked-clients``'s default is the row of docs/BENCHMARKS.md's GPU table with
    the fewest seconds per round: a path measured slower (groups of 5 on an H200,
    2026-12-04), or one not measured, cannot be the default."""
    table = gpu_table("### The default of `stacked-clients`, from a GPU's numbers")
    assert len(table) >= 2 and 0 in table
    fastest = min(table, key=table.get)
    assert load_run_config({}).stacked_clients == fastest
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert declared["tool"]["flwr"]["app"]["config"]["stacked-clients"] == fastest


@pytest.mark.parametrize("bad", [1.5, -1, 2000, "five", True, "auto"])
def test_a_group_size_that_is_not_a_count_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match=r"'stacked-clients' = .*give 0"):
        load_run_config({"stacked-clients": bad})


def test_a_deployment_refuses_groups(micro_mnist_dir, tmp_path):
    flat = load_run_config({"dataset": "mnist", "data-dir": str(micro_mnist_dir),
                            "model": "lenet", "num-clients": 4, "out-dir": str(tmp_path),
                            "stacked-clients": 2, "open-deployment": True}).to_flat()
    with pytest.raises(ConfigError, match="in a deployment each node holds its own data"):
        server_app.build(Context(1, 0, {}, RecordDict(), flat), None)


@pytest.fixture(scope="module")
def grouped_runs(tiny_mnist_dir, tmp_path_factory) -> dict[int, Path]:
    """3 rounds of the small job's clients, 3 of 4 in each round (prestopping off: the
    phases' local updates are compared node by node above), with one message per client
    and with groups of 2: a group and a lone client per round."""
    from fedefc_cli.simulation import run_simulation_job
    out = {}
    for size in (0, 2):
        folder = tmp_path_factory.mktemp(f"stacked-{size}")
        run_simulation_job(small_job(tiny_mnist_dir, folder, rounds=3, fraction=0.75,
                                     prestopping="false", **{"stacked-clients": size}))
        out[size] = folder
    return out


@pytest.mark.flower
def test_a_grouped_simulation_trains_what_the_ungrouped_one_does(grouped_runs):
    """Every round the same partitions and counts, no failure, and the test accuracy and
    the final model as without groups, to the rounding the module docstring bounds."""
    plain, grouped = (records(grouped_runs[k]) for k in (0, 2))
    assert len(plain) == len(grouped) == 4
    for a, b in zip(plain[1:], grouped[1:]):
        assert (a["partition_ids"], a["num_examples"]) == (b["partition_ids"], b["num_examples"])
        assert b["failures"] == 0 and b["n_clients"] == 3
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=0.02)
    models = [torch.load(grouped_runs[k] / "model.pt") for k in (0, 2)]
    want, have = ([m[k].numpy() for k in models[0]] for m in models)
    gap = np.linalg.norm(np.concatenate([(h - w).ravel() for h, w in zip(have, want)]))
    assert gap / np.linalg.norm(np.concatenate([w.ravel() for w in want])) < 1e-2
    for record in grouped[1:]:  # the first two sampled partitions shared a message
        assert record["groups"] == [record["partition_ids"][:2]]
    assert all("groups" not in record for record in plain)
