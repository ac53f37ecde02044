"""Which Flower node serves which partition, and how many samples it declared.

Flower gives nodes random ids (in simulation too), so sampling nodes with a seeded
RNG would pick different partitions in every run. The registry asks every new node
once for its declaration (partition id, data size, data kind; a legacy
``get_properties`` message, :mod:`.declarations`), then the method samples partition
ids with its own seeded generator (:func:`.plan.sample_round`).

The nodes of a Flower grid are asked all at once: one batch of messages and one wait for
the replies (a node at a time cost ~42 ms per node). Round 1 then costs about what
Flower charges for one message per node, which its simulation engine makes quadratic in
the number of nodes (docs/BENCHMARKS.md, "Planning a round"). Other client proxies (the
tests' in-process stand-ins) are asked directly.

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

Before its first round a run waits until every partition 0..num-clients-1 is served
(:meth:`PartitionRegistry.serving`), logging at a steady interval how many are and which
are missing, with the errors and refusals of the nodes that answered; when
``wait-for-nodes`` seconds pass first, the run fails with that report (a federation
whose nodes never formed is a failed run, not an empty one: docs/RELIABILITY.md). The
wait ends early once at least num-clients nodes are connected and every one of them has
answered for good (admitted; refused; or an error reply, such as a node whose own policy
refuses the run): the run then starts without the partitions nobody serves, says so in
its log, its first record and its summary's notes, or, when no partition is served,
fails at once. It also fails at once (after :data:`SETTLE_S`, so that nodes connecting
together are all asked) when every node that connected refused for a reason that
waiting does not change: its declaration refused here, or an error reply that is a
config mismatch or its policy's refusal (:attr:`.failures.NodeRefused.permanent`);
without that pause when those nodes are the whole federation they were started for
(each refused the run's num-clients for the same ``num-partitions`` N, and N of them are
connected: no node is still to come; :meth:`PartitionRegistry.whole_federation_refused`).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from logging import INFO, WARNING
from typing import Any

from flwr.common import GetPropertiesIns, Message, MessageTypeLegacy
from flwr.common.logger import log
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from common.messages import Declaration as Keys

from .allowlist import Allowlist, fingerprint
from .declarations import SizeRule, read_declaration
from .failures import NodeRefused, RunFailed

POLL_S = 1.0  # how often the wait for the nodes looks again
REPORT_S = 15.0  # how often it logs who is missing
RETRY_S = 30.0  # a node whose declaration failed is asked again after this long
SETTLE_S = 20.0  # how long every node must stand by a lasting refusal before the run fails
# a node's refusal of the run's num-clients (fedefc_client/node.py: partition_of)
NUM_PARTITIONS_REFUSED = re.compile(r"num-partitions=(\d+) differs from the run's num-clients")


def ranges(ids: list[int], limit: int = 12) -> str:
    """Sorted ids as ranges ("0-3, 7"), at most ``limit`` ranges then a count."""
    parts: list[str] = []
    for pid in sorted(ids):
        if parts and parts[-1].split("-")[-1] == str(pid - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{pid}"
        else:
            parts.append(str(pid))
    more = f" and {len(parts) - limit} more ranges" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def ask_declarations(proxies: list[ClientProxy], timeout: float | None, group_id: int,
                     max_workers: int = 16) -> dict[str, dict[str, Any] | Exception]:
    """{node id: its ``get_properties`` answer, or why it has none}. Nodes of a Flower
    grid get one batch of messages (one push, one wait); any other proxy is called."""
    answers: dict[str, dict[str, Any] | Exception] = {}
    by_grid: dict[int, list[GridClientProxy]] = {}
    direct = []
    for proxy in proxies:
        if isinstance(proxy, GridClientProxy):
            by_grid.setdefault(id(proxy.grid), []).append(proxy)
        else:
            direct.append(proxy)
    content = compat.getpropertiesins_to_recorddict(GetPropertiesIns({}))
    for group in by_grid.values():
        messages = [Message(content=content, dst_node_id=p.node_id,
                            message_type=MessageTypeLegacy.GET_PROPERTIES,
                            group_id=str(group_id), ttl=timeout) for p in group]
        replies = {m.metadata.src_node_id: m
                   for m in group[0].grid.send_and_receive(messages, timeout=timeout)}
        for proxy in group:
            reply = replies.get(proxy.node_id)
            if reply is None:
                answers[proxy.cid] = TimeoutError(f"no reply within {timeout} s")
            elif reply.has_error():
                answers[proxy.cid] = NodeRefused(int(reply.error.code), reply.error.reason)
            else:
                answers[proxy.cid] = compat.recorddict_to_getpropertiesres(
                    reply.content).properties
    if direct:
        with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(direct))) as ex:
            futures = {ex.submit(p.get_properties, GetPropertiesIns({}), timeout, group_id):
                       p.cid for p in direct}
            for fut in concurrent.futures.as_completed(futures):
                try:
                    answers[futures[fut]] = fut.result().properties
                except Exception as err:  # a node that cannot answer is not sampled
                    answers[futures[fut]] = err
    return answers


def public_keys(proxies: list[ClientProxy]) -> dict[str, bytes | None]:
    """{node id: the public key the SuperLink knows it by}: one ``Grid.get_nodes()``
    per grid (Flower 1.42's ``NodeInfo.public_key``: with node authentication, the key
    the node authenticates with); another proxy's ``public_key`` attribute, if any."""
    keys: dict[str, bytes | None] = {}
    by_grid: dict[int, tuple[object, list[GridClientProxy]]] = {}
    for proxy in proxies:
        if isinstance(proxy, GridClientProxy):
            by_grid.setdefault(id(proxy.grid), (proxy.grid, []))[1].append(proxy)
        else:
            keys[proxy.cid] = getattr(proxy, "public_key", None)
    for grid, group in by_grid.values():
        known = {node.node_id: bytes(node.public_key) for node in grid.get_nodes()}
        keys.update({p.cid: known.get(p.node_id) for p in group})
    return keys


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
        self.rule = rule
        self.timeout = timeout
        self.allowlist = allowlist
        self.wait_for_nodes = wait_for_nodes
        self.declared: dict[int, int] = {}  # partition id -> its size, fixed for the run
        self.held_out: dict[int, int] = {}  # partition id -> its held-out size, fixed too
        self._pid_of_cid: dict[str, int] = {}  # the node holding each partition
        self._holder: dict[int, str] = {}  # partition id -> the node holding it
        self._refused: dict[str, str] = {}  # node -> why its declaration was refused
        self._waiting: dict[str, int] = {}  # node -> the partition another node holds
        # node -> (its error, when, whether it answered: an error reply, not a silence)
        self._failed: dict[str, tuple[str, float, bool]] = {}
        self._lasting: set[str] = set()  # nodes whose error reply waiting does not change
        self.missing_at_start: str | None = None  # the partitions the run started without
        self._news: dict[str, Any] = {}  # declarations and refusals since the last take
        self._waited = False  # whether this process waited for the nodes to connect
        # in a simulation: partition id -> the node Flower's engine gave it, asked lazily
        self._assumed: dict[int, str] | None = None
        self._proxies: dict[str, ClientProxy] = {}  # the connected nodes, last seen
        self._misplaced: set[str] = set()  # simulated nodes that declared another partition
        self._claims: dict[int, tuple[str, str]] = {}  # partition -> a refused claimant, why
        # nodes left out for breaking the secure protocol: kept by checkpoints, so that a
        # resumed run does not take them back (node -> (the partition it held, why))
        self._excluded: dict[str, tuple[int | None, str]] = {}

    def partition_of(self, cid: str) -> int | None:
        """The partition id node ``cid`` holds, if it does."""
        return self._pid_of_cid.get(cid)

    def admit(self, cid: str, props: dict[str, Any], public_key: bytes | None = None,
              connected: frozenset[str] = frozenset()) -> str | None:
        """Register node ``cid`` (known by ``public_key``) from its declaration; the
        reason it is refused, or None. A partition whose holder is among ``connected``
        is not taken over: the node waits (:meth:`refresh` admits it once the holder has
        left) and the reason says so. In a simulation the node must declare the
        partition the engine gave it."""
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
        if reason is not None:
            return reason
        if size is None:
            self.declared[decl.partition] = decl.num_examples
            self._news.setdefault("declared", {})[decl.partition] = decl.num_examples
        self.held_out.setdefault(decl.partition, decl.held_out)
        holder = self._holder.get(decl.partition)
        if holder is not None and holder != cid and holder in connected:
            self._waiting[cid] = decl.partition
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
            self._claims[pid] = (cid, reason)
        self._refused[cid] = reason
        self._excluded[cid] = (pid, reason)
        self._news.setdefault("refused_nodes", []).append(
            {"node": cid, "partition": pid, "reason": reason})
        log(WARNING, "node %s refused: %s", cid, reason)

    def _hold(self, cid: str, pid: int) -> None:
        """Make node ``cid`` the one holder of partition ``pid``."""
        previous = self._holder.get(pid)
        if previous is not None and previous != cid:
            del self._pid_of_cid[previous]
            self._news.setdefault("reassigned", {})[pid] = cid
            log(INFO, "partition %d: node %s takes over from node %s, which left", pid, cid,
                previous)
        self._waiting.pop(cid, None)
        self._holder[pid] = cid
        self._pid_of_cid[cid] = pid

    def serving(self, client_manager: ClientManager, server_round: int
                ) -> dict[int, ClientProxy]:
        """{partition id: node} of the registered nodes. The first call of a process
        waits until every partition is served (round 0's federated evaluation, round 1,
        or the first round of a resumed run), so that the first sample is not drawn
        from the few nodes that happen to be connected already; RunFailed when
        ``wait-for-nodes`` seconds pass first."""
        if self._waited:
            return self.refresh(client_manager, server_round)
        serving = self._wait_for_federation(client_manager, server_round)
        self._waited = True
        return serving

    def _wait_for_federation(self, client_manager: ClientManager, server_round: int
                             ) -> dict[int, ClientProxy]:
        start = time.monotonic()
        next_report = start
        refused_since: tuple[frozenset[str], float] | None = None  # nodes, since when
        while True:
            # a node's first message may start its ClientApp cold (imports, data): it has
            # the rest of the wait to answer, not just the usual per-message timeout
            remaining = max(self.wait_for_nodes - (time.monotonic() - start), 1.0)
            serving = self.refresh(client_manager, server_round, remaining)
            missing = sorted(set(range(self.rule.num_clients)) - set(serving))
            if not missing:
                log(INFO, "all %d partitions are served (after %.0f s)", self.rule.num_clients,
                    time.monotonic() - start)
                return serving
            nodes = client_manager.all()
            connected = len(nodes)
            if connected >= self.rule.num_clients and all(map(self.answered, nodes)):
                if not serving:
                    raise RunFailed("every node that connected was refused or failed, so the "
                                    f"run would train nothing; {self.report(connected, missing)}")
                self.missing_at_start = (f"the run started without partitions "
                                         f"{ranges(missing)}: "
                                         f"{self.report(connected, missing)}")
                log(WARNING, "%s", self.missing_at_start)
                self._news["missing_partitions"] = missing
                return serving
            now = time.monotonic()
            if not serving and nodes and all(map(self.refused_for_good, nodes)):
                if refused_since is None or refused_since[0] != frozenset(nodes):
                    refused_since = (frozenset(nodes), now)
                elif (now - refused_since[1] >= min(SETTLE_S, self.wait_for_nodes / 2)
                      or self.whole_federation_refused(nodes)):
                    raise RunFailed(
                        f"every node that connected refused the run for a reason that "
                        f"waiting does not change (its config or its policy), so the run "
                        f"would train nothing; {self.report(connected, missing)}. Fix the "
                        "run config or the nodes, then submit again")
            else:
                refused_since = None
            if now - start >= self.wait_for_nodes:
                raise RunFailed(f"waited {self.wait_for_nodes:.0f} s (wait-for-nodes) for a "
                                f"node of each of the run's {self.rule.num_clients} partitions "
                                f"(num-clients); {self.report(connected, missing)}")
            if now >= next_report:
                log(INFO, "waiting for nodes: %s", self.report(connected, missing))
                next_report = now + REPORT_S
            time.sleep(POLL_S)

    def answered(self, cid: str) -> bool:
        """Whether node ``cid`` has answered for good: it holds or waits for a partition,
        was refused, or replied with an error (a node that did not answer may still)."""
        return (cid in self._pid_of_cid or cid in self._refused or cid in self._waiting
                or self._failed.get(cid, ("", 0.0, False))[2])

    def whole_federation_refused(self, nodes) -> bool:
        """Whether ``nodes`` (every one refused for good) are the whole federation they
        were started for: each refused the run's num-clients naming the same
        num-partitions N, and N of them are connected, so no node is still to come and the
        pause of :data:`SETTLE_S` would change nothing."""
        counts = {int(m.group(1)) if (m := NUM_PARTITIONS_REFUSED.search(
            self._failed.get(cid, ("",))[0])) else None for cid in nodes}
        return len(counts) == 1 and None not in counts and len(nodes) >= counts.pop()

    def absences(self, served) -> list[dict[str, Any]]:
        """The run's partitions not among ``served``, each with why no node serves it
        (:meth:`absence`), in partition order."""
        return [self.absence(pid) for pid in range(self.rule.num_clients) if pid not in served]

    def refused_for_good(self, cid: str) -> bool:
        """Whether node ``cid`` refused in a way that waiting does not change: this
        registry refused its declaration, or it answered with a lasting refusal
        (:attr:`.failures.NodeRefused.permanent`: a config mismatch, its policy)."""
        return cid in self._refused or cid in self._lasting

    def absence(self, pid: int) -> dict[str, Any]:
        """Why no connected node serves partition ``pid``, as {partition, node, reason}:
        its node left, was refused or failed to declare, or none has claimed it."""
        cid = self._holder.get(pid) or (self._assumed or {}).get(pid)
        if cid is None and pid in self._claims:
            cid, why = self._claims[pid]
            return {"partition": pid, "node": cid, "reason": f"its node was refused: {why}"}
        if cid is None:
            return {"partition": pid, "node": None,
                    "reason": "no node has declared it (none connected, or each that did "
                              "failed before declaring; the log's registry lines say)"}
        if cid in self._refused:
            reason = f"its node was refused: {self._refused[cid]}"
        elif cid in self._failed:
            reason = f"its node failed to declare: {self._failed[cid][0]}"
        elif cid not in self._proxies:
            reason = "its node is no longer connected"
        else:
            reason = "its node is waiting to be asked again"
        return {"partition": pid, "node": cid, "reason": reason}

    def notes(self) -> list[str]:
        """What a reader of the run's summary must know about its nodes."""
        return [self.missing_at_start] if self.missing_at_start else []

    def report(self, connected: int, missing: list[int]) -> str:
        """Who is there and who is not, with the nodes' own reasons."""
        served = self.rule.num_clients - len(missing)
        text = (f"{served} of {self.rule.num_clients} partitions served by {connected} "
                f"connected nodes; missing partitions {ranges(missing)}")
        problems = [f"node {cid} refused: {why}" for cid, why in self._refused.items()]
        problems += [f"node {cid} failed to declare: {why}"
                     for cid, (why, _, _) in self._failed.items()]
        if problems:
            text += "; " + "; ".join(problems[:5])
            text += f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return text

    def refresh(self, client_manager: ClientManager, server_round: int,
                timeout: float | None = None) -> dict[int, ClientProxy]:
        """Ask the nodes not seen yet for their declaration (each may take ``timeout``
        seconds, by default the registry's), let a waiting node take over a partition
        whose holder has left; return {partition id: proxy}."""
        proxies = client_manager.all()
        self._proxies = dict(proxies)
        connected = frozenset(proxies)
        if not self._waited and self._assumed is None and self.allowlist is None:
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
        for cid, pid in list(self._waiting.items()):
            if cid in connected and self._holder.get(pid) not in connected:
                self._hold(cid, pid)
        return {pid: proxies[cid] for pid, cid in sorted(self._holder.items())
                if cid in connected}

    def _may_ask(self, cid: str) -> bool:
        """Whether node ``cid`` is neither refused, waiting nor failed in the last
        RETRY_S seconds."""
        return (cid not in self._refused and cid not in self._waiting and
                time.monotonic() - self._failed.get(cid, ("", -RETRY_S, False))[1] >= RETRY_S)

    def _ask(self, nodes: list[ClientProxy], timeout: float | None, server_round: int,
             connected: frozenset[str]) -> None:
        """Ask ``nodes`` for their declarations (one batch) and admit or refuse each."""
        answers = ask_declarations(nodes, timeout, server_round)
        keys = public_keys(nodes) if self.allowlist is not None else {}
        for cid, props in answers.items():
            if isinstance(props, Exception):  # a node that cannot answer (or whose own
                # policy refuses the run) is not sampled; the record says why
                self._failed[cid] = (str(props), time.monotonic(),
                                     not isinstance(props, TimeoutError))
                if isinstance(props, NodeRefused) and props.permanent:
                    self._lasting.add(cid)
                self._news.setdefault("unanswered_nodes", []).append(
                    {"node": cid, "reason": str(props)})
                log(WARNING, "node %s did not report its partition id: %s", cid, props)
                continue
            self._failed.pop(cid, None)
            self._lasting.discard(cid)
            reason = self.admit(cid, props, keys.get(cid), connected)
            if reason is not None:
                if cid not in self._waiting:
                    self._refused[cid] = reason
                    claimed = props.get(Keys.PARTITION_ID)
                    if isinstance(claimed, int) and not isinstance(claimed, bool):
                        self._claims.setdefault(claimed, (cid, reason))
                self._news.setdefault("refused_nodes", []).append(
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
                answered = [p.cid for p in ask if p.cid not in self._failed]
                if len(answered) >= 2 and set(answered) <= self._misplaced:
                    raise RunFailed(
                        f"none of the {len(answered)} simulated nodes asked in round "
                        f"{server_round} declared the partition Flower's simulation engine "
                        "gave it (node i serves partition i, in the order the engine "
                        "registered them, as Flower 1.42 does); the registry cannot tell "
                        f"who serves what: {self.report(len(self._proxies), [])}")
        return sorted(p for p in set(pids) if (cid := self._holder.get(p)) is not None
                      and self._pid_of_cid.get(cid) == p)

    def take_news(self) -> dict[str, Any]:
        """Declarations accepted and nodes refused since the last call (for the round
        record: ``declared`` {partition: size}, ``refused_nodes`` with reasons)."""
        news, self._news = self._news, {}
        return news

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the partitions' declared sizes, fixed for the run, and
        the nodes :meth:`exclude` left out, which stay out of a resumed run (Flower keeps
        a node's id while it stays connected to its SuperLink)."""
        return {"declared_sizes": {str(p): n for p, n in self.declared.items()},
                "declared_held_out": {str(p): n for p, n in self.held_out.items()},
                "excluded_nodes": {c: list(held) for c, held in self._excluded.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.declared = {int(p): int(n) for p, n in state.get("declared_sizes", {}).items()}
        self.held_out = {int(p): int(n) for p, n in state.get("declared_held_out", {}).items()}
        for cid, (pid, why) in state.get("excluded_nodes", {}).items():
            self._excluded[cid] = (pid, why)
            self._refused[cid] = why
            if pid is not None:
                self._claims[int(pid)] = (cid, why)
            log(WARNING, "node %s stays refused in this resumed run: %s", cid, why)
