"""The partition registry in Flower's simulation: it reads which node serves which
partition from the engine's own registration and asks only the nodes a round needs
(fedefc_server/registry.py; docs/BENCHMARKS.md, "Planning a round").

The nodes are registered by Flower's own simulation engine function
(``vce_api._register_nodes``), whose node -> partition mapping is the truth the registry
must match; the grid is Flower's ``InMemoryGrid`` over that state, answering the
declaration messages from a table instead of running ClientApps.
"""

from __future__ import annotations

import pytest
from flwr.app import Message
from flwr.common import GetPropertiesRes
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.linkstate_factory import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedefc_server.declarations import SizeRule
from fedefc_server.failures import RunFailed
from fedefc_server.federation import Federation
from fedefc_server.node_answers import ask_declarations
from fedefc_server.registry import PartitionRegistry, simulation_order
from tests.helpers import OK, FakeProxy


class AnsweringGrid(InMemoryGrid):
    """Flower's in-memory grid whose nodes answer a declaration from ``claims`` (node id ->
    the partition it declares; its engine partition when absent) and log what they got."""

    def __init__(self, factory, claims=None):
        super().__init__(factory)
        self.claims = claims or {}
        self.asked: list[int] = []
        self.partition_of: dict[int, int] = {}
        self.waits: list[float | None] = []  # each batch's timeout
        self.ttls: list[float] = []  # each message's time to live

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        self.waits.append(timeout)
        for msg in messages:
            self.ttls.append(msg.metadata.ttl)
            node = msg.metadata.dst_node_id
            self.asked.append(node)
            pid = self.claims.get(node, self.partition_of[node])
            props = {"partition-id": pid, "num-examples": 10 + pid, "held-out": 0,
                     "data": "partition"}
            replies.append(Message(compat.getpropertiesres_to_recorddict(
                GetPropertiesRes(OK, props)), reply_to=msg))
        return replies


def simulation(num_nodes: int, claims=None):
    """(grid, client manager, Flower's own node id -> partition id) of ``num_nodes``
    simulated nodes, registered in the client manager in node-id order (not Flower's)."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    mapping = _register_nodes(num_nodes, factory)
    grid = AnsweringGrid(factory, claims)
    grid.partition_of = mapping
    manager = SimpleClientManager()
    for node_id in sorted(mapping):
        manager.register(GridClientProxy(node_id, grid, run_id=1))
    return grid, manager, mapping


def test_a_nodes_first_declaration_may_take_the_whole_wait_for_nodes():
    """The first message to a simulated node starts its ClientApp cold (imports, data),
    which a busy machine makes slow: the node has wait-for-nodes to answer, as the nodes
    of a deployment have before the first round, not the registry's usual limit per
    message (issue 32: round 1 took 43-49 s at load 14 on 2 cores, nearly all of it
    these cold starts; a node past the limit was left out of the round, and a round
    whose every node was, failed the run)."""
    grid, manager, _ = simulation(4)
    registry = PartitionRegistry(SizeRule(4, None, 10**8), timeout=120.0,
                                 wait_for_nodes=900.0)
    Federation(registry).serving(manager, 1)
    assert registry.declare([0, 1, 2, 3], 1) == [0, 1, 2, 3]
    assert grid.waits == [900.0] and grid.ttls == [900.0] * 4


def test_the_registry_reads_flowers_node_order_and_asks_only_the_sampled_nodes():
    grid, manager, mapping = simulation(40)
    assert sorted(mapping.values()) == list(range(40))
    assert simulation_order(list(manager.all().values())) == [str(n) for n in mapping]
    registry = PartitionRegistry(SizeRule(40, None, 10**8))
    serving = Federation(registry).serving(manager, 1)
    assert grid.asked == []  # the plan learns the partitions without a message
    assert {pid: mapping[p.node_id] for pid, p in serving.items()} == {p: p for p in range(40)}
    assert registry.declare([7, 3, 30], 1) == [3, 7, 30]
    assert sorted(mapping[n] for n in grid.asked) == [3, 7, 30]
    assert registry.declared == {3: 13, 7: 17, 30: 40}
    assert registry.take_news() == {"declared": {3: 13, 7: 17, 30: 40}}
    registry.declare([3, 7], 2)  # a declared node is not asked again
    assert len(grid.asked) == 3
    assert registry.partition_of(str(serving[30].node_id)) == 30


def test_a_simulated_node_that_claims_another_partition_is_refused_and_never_sampled():
    grid, manager, mapping = simulation(6)
    node_of = {pid: node for node, pid in mapping.items()}
    grid.claims = {node_of[4]: 1}
    registry = PartitionRegistry(SizeRule(6, None, 10**8))
    federation = Federation(registry)
    federation.serving(manager, 1)
    assert registry.declare([1, 4], 1) == [1]
    [refused] = registry.take_news()["refused_nodes"]
    assert refused == {"node": str(node_of[4]), "partition": 1, "reason": (
        f"partition 1 is served by node {node_of[1]} in this simulation; this node serves "
        "partition 4")}
    assert sorted(federation.serving(manager, 2)) == [0, 1, 2, 3, 5]


def test_a_simulation_whose_node_order_is_not_flowers_fails_the_run():
    grid, manager, mapping = simulation(6)
    grid.claims = {node: (pid + 1) % 6 for node, pid in mapping.items()}
    registry = PartitionRegistry(SizeRule(6, None, 10**8))
    Federation(registry).serving(manager, 1)
    with pytest.raises(RunFailed, match="none of the 3 simulated nodes asked in round 1 "
                                        "declared the partition"):
        registry.declare([0, 2, 4], 1)


def test_nodes_outside_a_simulation_are_all_asked_before_the_first_round():
    grid, manager, mapping = simulation(5)
    manager.register(FakeProxy("outsider", 5))  # a node of no simulation: no engine order
    assert simulation_order(list(manager.all().values())) is None
    registry = PartitionRegistry(SizeRule(5, None, 10**8))
    serving = Federation(registry).serving(manager, 1)
    assert sorted(grid.asked) == sorted(mapping) and sorted(serving) == list(range(5))
    assert registry.declared == {p: 10 + p for p in range(5)}


def test_a_silent_nodes_timeout_is_told_in_words():
    """Issue 49 (5): a node that never answered was told "no reply within
    299.99999873800016 s" (the rest of a 300 s wait, as the clock measured it)."""
    class SilentGrid:  # a grid whose node never answers
        def send_and_receive(self, messages, *, timeout=None):
            return []

    silent = GridClientProxy(7, SilentGrid(), run_id=1)
    [answer] = ask_declarations([silent], 299.99999873800016, 1).values()
    assert isinstance(answer, TimeoutError)
    assert str(answer) == "no reply within 5 min 00 s"
