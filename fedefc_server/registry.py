"""Which Flower node serves which partition, and how many samples it declared.

Flower gives nodes random ids (in simulation too), so sampling nodes with a seeded
RNG would pick different partitions in every run. The registry asks every new node
once for its declaration (partition id, data size, data kind; a legacy
``get_properties`` message, :mod:`.declarations`; asked in one batch per grid,
:mod:`.node_answers`), then the method samples partition ids with its own seeded
generator (:func:`.plan.sample_round`).

In Flower's simulation the registry asks only the nodes a round needs. Flower 1.42's
simulation engine registers node i for partition i in order (``vce_api._register_nodes``)
and its link state keeps that order, so the registry reads which node serves which
partition from the state (:func:`simulation_order`) and asks a node for its declaration
the first time it is sampled, sent a task or asked to evaluate
(:meth:`PartitionRegistry.declare`): round 1 costs 10 messages, not one per node
(docs/BENCHMARKS.md, "Planning a round"). A node whose declaration names another
partition than the one the engine gave it is refused, as any second claimant is; when no
node of a batch declares its own partition, the run fails (the engine's order is not what
this assumes). A deployment (and a simulation with an allowlist) asks every node first.

The first declaration of a partition id fixes its sizes for the run: a later node that
declares the same partition with other sizes is refused with the reason (and never
sampled), and every reply of the partition is bounded by them. Each declaration is
vetted by the run's :class:`.declarations.SizeRule` before it is accepted.

One node serves a partition at a time (docs/THREAT-MODEL.md, "Identity and
partitions"). With the operator's allowlist (:mod:`.allowlist`) a node is admitted only
if its public key (``Grid.get_nodes()``) is listed, and only for its entry's partition.
Without one (simulation, try-outs) the first node to declare a partition holds it: a
second node that declares the same partition is refused while the holder is
connected, and takes over (with the same sizes) once the holder has left, as a
restarted node does.

Elsewhere: the wait for every partition to be served before the first round
(:mod:`.federation`), and why a partition is not served, in words
(:mod:`.registry_report`).
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from common.messages import Declaration as Keys

from .allowlist import Allowlist, fingerprint
from .declarations import SizeRule, class_map_refusal, read_declaration
from .failures import RunFailed
from .node_answers import NodeAnswers, ask_declarations, public_keys


def simulation_order(proxies: list[ClientProxy]) -> list[str] | None:
    """The ids of Flower's simulated nodes in the order its engine registered them (node i
    serves partition i), or None unless every proxy is a node of one simulation."""
    grids = {id(p.grid): p.grid for p in proxies if isinstance(p, GridClientProxy)}
    if len(grids) != 1 or len(proxies) != sum(isinstance(p, GridClientProxy) for p in proxies):
        return None
    [grid] = grids.values()
    state = getattr(grid, "state", None)
    if not isinstance(grid, InMemoryGrid) or not isinstance(state, InMemoryLinkState):
        return None
    return [str(node.node_id) for node in state.get_node_info()]


class PartitionRegistry:
    """Maps partition ids to the client proxies that currently serve them, and keeps the
    data size each partition declared (fixed for the run)."""

    def __init__(self, rule: SizeRule, timeout: float | None = 120.0,
                 allowlist: Allowlist | None = None, wait_for_nodes: float = 300.0):
        """``timeout``: how long a node has to declare; ``wait_for_nodes``: how long the
        run waits for its federation (:mod:`.federation`), which is also how long a
        simulated node asked for the first time has to answer (:meth:`declare`)."""
        self.rule = rule
        self.timeout = timeout
        self.allowlist = allowlist
        self.wait_for_nodes = wait_for_nodes
        self.declared: dict[int, int] = {}  # partition id -> its size, fixed for the run
        self.held_out: dict[int, int] = {}  # partition id -> its held-out size, fixed too
        # the federation's class map: the first declared (its fingerprint, the partition)
        self.class_map: tuple[str, int] | None = None
        self.answers = NodeAnswers()  # the nodes that answered but hold no partition
        self.waiting: dict[str, int] = {}  # node -> the partition another node holds
        self.claims: dict[int, tuple[str, str]] = {}  # partition -> a refused claimant, why
        self.news: dict[str, Any] = {}  # declarations and refusals since the last take
        self.formed = False  # whether this process waited for its federation to form
        self._pid_of_cid: dict[str, int] = {}  # the node holding each partition
        self._holder: dict[int, str] = {}  # partition id -> the node holding it
        # in a simulation: partition id -> the node Flower's engine gave it, asked lazily
        self._assumed: dict[int, str] | None = None
        self._proxies: dict[str, ClientProxy] = {}  # the connected nodes, last seen
        self._misplaced: set[str] = set()  # simulated nodes that declared another partition
        # nodes left out for breaking the secure protocol: kept by checkpoints, so that a
        # resumed run does not take them back (node -> (the partition it held, why))
        self._excluded: dict[str, tuple[int | None, str]] = {}

    def partition_of(self, cid: str) -> int | None:
        """The partition id node ``cid`` holds, if it does."""
        return self._pid_of_cid.get(cid)

    def node_for(self, pid: int) -> str | None:
        """The node that holds partition ``pid`` or, in a simulation, that Flower's engine
        gave it (whether or not it has declared yet)."""
        return self._holder.get(pid) or (self._assumed or {}).get(pid)

    def is_connected(self, cid: str) -> bool:
        """Whether node ``cid`` was connected when the registry last looked."""
        return cid in self._proxies

    def admit(self, cid: str, props: dict[str, Any], public_key: bytes | None = None,
              connected: frozenset[str] = frozenset()) -> str | None:
        """Register node ``cid`` (known by ``public_key``) from its declaration; the
        reason it is refused, or None. A partition whose holder is among ``connected``
        is not taken over: the node waits (:meth:`refresh` admits it once the holder has
        left) and the reason says so. In a simulation the node must declare the
        partition the engine gave it. The first class map declared is the federation's;
        a node declaring another is refused (docs/OWN-DATA.md, "Preparing a folder of
        images")."""
        decl = read_declaration(props)
        if isinstance(decl, str):
            return f"malformed declaration: {decl}"
        if self._assumed is not None and self._assumed.get(decl.partition) != cid:
            own = next((p for p, c in self._assumed.items() if c == cid), None)
            self._misplaced.add(cid)
            return (f"partition {decl.partition} is served by node "
                    f"{self._assumed.get(decl.partition)} in this simulation; this node "
                    f"serves partition {own}")
        allowed = None
        if self.allowlist is not None:
            allowed = self.allowlist.entry(public_key)
            if allowed is None:
                return (f"its public key ({fingerprint(public_key or b'')}) is not on the "
                        "allowlist")
        reason = self.rule.vet(decl, allowed)
        size, held = self.declared.get(decl.partition), self.held_out.get(decl.partition)
        if reason is None and (size not in (None, decl.num_examples)
                               or held not in (None, decl.held_out)):
            reason = (f"declares {decl.num_examples} samples ({decl.held_out} held out) for "
                      f"partition {decl.partition}, which was declared with {size} "
                      f"({held} held out); a declaration is fixed for the run")
        if reason is None and self.class_map is not None:
            reason = class_map_refusal(decl, self.class_map)
        if reason is not None:
            return reason
        if decl.class_map is not None and self.class_map is None:
            self.class_map = (decl.class_map, decl.partition)
        if size is None:
            self.declared[decl.partition] = decl.num_examples
            self.news.setdefault("declared", {})[decl.partition] = decl.num_examples
        self.held_out.setdefault(decl.partition, decl.held_out)
        holder = self._holder.get(decl.partition)
        if holder is not None and holder != cid and holder in connected:
            self.waiting[cid] = decl.partition
            return (f"partition {decl.partition} is served by node {holder}; a second node "
                    "may take it only once that one has left")
        self._hold(cid, decl.partition)
        return None

    def exclude(self, cid: str, reason: str) -> None:
        """Leave node ``cid`` out of the run's later rounds (a node that broke the secure
        protocol: :mod:`.secure_round`): it is refused with ``reason``, its partition
        no longer served by it (``refused_nodes`` in the next round's record; its
        partition's absence says why)."""
        pid = self._pid_of_cid.pop(cid, None)
        if pid is not None and self._holder.get(pid) == cid:
            del self._holder[pid]
            self.claims[pid] = (cid, reason)
        self.answers.refused[cid] = reason
        self._excluded[cid] = (pid, reason)
        self.news.setdefault("refused_nodes", []).append(
            {"node": cid, "partition": pid, "reason": reason})
        log(WARNING, "node %s refused: %s", cid, reason)

    def _hold(self, cid: str, pid: int) -> None:
        """Make node ``cid`` the one holder of partition ``pid``."""
        previous = self._holder.get(pid)
        if previous is not None and previous != cid:
            del self._pid_of_cid[previous]
            self.news.setdefault("reassigned", {})[pid] = cid
            log(INFO, "partition %d: node %s takes over from node %s, which left", pid, cid,
                previous)
        self.waiting.pop(cid, None)
        self._holder[pid] = cid
        self._pid_of_cid[cid] = pid

    def refresh(self, client_manager: ClientManager, server_round: int,
                timeout: float | None = None) -> dict[int, ClientProxy]:
        """Ask the nodes not seen yet for their declaration (each may take ``timeout``
        seconds, by default the registry's), let a waiting node take over a partition
        whose holder has left; return {partition id: proxy}. Until the federation has
        formed, nodes that are all Flower's simulated ones put the registry in its lazy
        mode (the module docstring)."""
        proxies = client_manager.all()
        self._proxies = dict(proxies)
        connected = frozenset(proxies)
        if not self.formed and self._assumed is None and self.allowlist is None:
            order = simulation_order(list(proxies.values()))
            if order is not None and len(order) >= self.rule.num_clients:
                self._assumed = dict(enumerate(order[:self.rule.num_clients]))
        if self._assumed is not None:
            return {pid: proxies[cid] for pid, cid in self._assumed.items()
                    if cid in connected and self._may_ask(cid)}
        unknown = [proxies[cid] for cid in proxies
                   if cid not in self._pid_of_cid and self._may_ask(cid)]
        if unknown:
            self._ask(unknown, timeout or self.timeout, server_round, connected)
        for cid, pid in list(self.waiting.items()):
            if cid in connected and self._holder.get(pid) not in connected:
                self._hold(cid, pid)
        return {pid: proxies[cid] for pid, cid in sorted(self._holder.items())
                if cid in connected}

    def _may_ask(self, cid: str) -> bool:
        """Whether node ``cid`` is neither waiting, refused nor failed lately."""
        return cid not in self.waiting and self.answers.may_ask(cid)

    def _ask(self, nodes: list[ClientProxy], timeout: float | None, server_round: int,
             connected: frozenset[str]) -> None:
        """Ask ``nodes`` for their declarations (one batch) and admit or refuse each."""
        answers = ask_declarations(nodes, timeout, server_round)
        keys = public_keys(nodes) if self.allowlist is not None else {}
        for cid, props in answers.items():
            if isinstance(props, Exception):  # a node that cannot answer (or whose own
                # policy refuses the run) is not sampled; the record says why
                self.answers.fail(cid, props)
                self.news.setdefault("unanswered_nodes", []).append(
                    {"node": cid, "reason": str(props)})
                log(WARNING, "node %s did not report its partition id: %s", cid, props)
                continue
            self.answers.declared(cid)
            reason = self.admit(cid, props, keys.get(cid), connected)
            if reason is not None:
                if cid not in self.waiting:
                    self.answers.refused[cid] = reason
                    claimed = props.get(Keys.PARTITION_ID)
                    if isinstance(claimed, int) and not isinstance(claimed, bool):
                        self.claims.setdefault(claimed, (cid, reason))
                self.news.setdefault("refused_nodes", []).append(
                    {"node": cid, "partition": props.get(Keys.PARTITION_ID),
                     "reason": reason})
                log(WARNING, "node %s refused: %s", cid, reason)
        log(INFO, "partition registry: %d nodes known", len(self._pid_of_cid))

    def declare(self, pids: list[int], server_round: int) -> list[int]:
        """The partitions of ``pids`` whose nodes have declared, sorted. In a simulation
        (the registry's lazy mode) the nodes of ``pids`` not asked yet are asked now, in
        one batch; RunFailed when two or more of them answer and none declares the
        partition the engine gave it. Elsewhere every node declared before it served."""
        if self._assumed is not None:
            ask = [self._proxies[cid] for p in sorted(set(pids))
                   if (cid := self._assumed.get(p)) is not None and cid in self._proxies
                   and cid not in self._pid_of_cid and self._may_ask(cid)]
            if ask:
                # a node's first message starts its ClientApp cold (imports, data), which a
                # busy machine makes slow: it has wait-for-nodes to answer, as the nodes of
                # a deployment have before the first round, not the usual per-message limit
                self._ask(ask, max(self.timeout or 0.0, self.wait_for_nodes), server_round,
                          frozenset(self._proxies))
                answered = [p.cid for p in ask if p.cid not in self.answers.failed]
                if len(answered) >= 2 and set(answered) <= self._misplaced:
                    raise RunFailed(
                        f"none of the {len(answered)} simulated nodes asked in round "
                        f"{server_round} declared the partition Flower's simulation engine "
                        "gave it (node i serves partition i, in the order the engine "
                        "registered them, as Flower 1.42 does); the registry cannot tell "
                        f"who serves what: {'; '.join(self.answers.problems()[:5])}")
        return sorted(p for p in set(pids) if (cid := self._holder.get(p)) is not None
                      and self._pid_of_cid.get(cid) == p)

    def take_news(self) -> dict[str, Any]:
        """Declarations accepted and nodes refused since the last call (for the round
        record: ``declared`` {partition: size}, ``refused_nodes`` with reasons)."""
        news, self.news = self.news, {}
        return news

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the partitions' declared sizes and the federation's
        class map, fixed for the run, and the nodes :meth:`exclude` left out, which stay
        out of a resumed run (Flower keeps a node's id while it stays connected to its
        SuperLink)."""
        return {"declared_sizes": {str(p): n for p, n in self.declared.items()},
                "declared_held_out": {str(p): n for p, n in self.held_out.items()},
                "excluded_nodes": {c: list(held) for c, held in self._excluded.items()},
                **({} if self.class_map is None else {"class_map": list(self.class_map)})}

    def load_state(self, state: dict[str, Any]) -> None:
        self.declared = {int(p): int(n) for p, n in state.get("declared_sizes", {}).items()}
        self.held_out = {int(p): int(n) for p, n in state.get("declared_held_out", {}).items()}
        if state.get("class_map"):
            fingerprint, pid = state["class_map"]
            self.class_map = (str(fingerprint), int(pid))
        for cid, (pid, why) in state.get("excluded_nodes", {}).items():
            self._excluded[cid] = (pid, why)
            self.answers.refused[cid] = why
            if pid is not None:
                self.claims[int(pid)] = (cid, why)
            log(WARNING, "node %s stays refused in this resumed run: %s", cid, why)
