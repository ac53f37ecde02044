"""Which Flower node serves which partition, and how many samples it declared.

Flower gives nodes random ids (in simulation too), so sampling nodes with a seeded
RNG would pick different partitions in every run. The registry asks every new node
once for its declaration (partition id, data size, data kind; a legacy
``get_properties`` message, :mod:`.declarations`), then the method samples partition
ids with its own seeded generator (:func:`.plan.sample_round`).

The nodes of a Flower grid are asked all at once: one batch of messages and one wait for
the replies (docs/BENCHMARKS.md, "Planning a round": a node at a time cost ~42 ms per
node, 420 s for 10,000 simulated nodes). Other client proxies (the tests' in-process
stand-ins) are asked directly.

Before its first round a run waits until every partition 0..num-clients-1 is served
(:meth:`PartitionRegistry.serving`), logging at a steady interval how many are and which
are missing, with the errors and refusals of the nodes that answered; when
``wait-for-nodes`` seconds pass first, the run fails with that report (a federation
whose nodes never formed is a failed run, not an empty one: docs/RELIABILITY.md). A node
whose own policy refuses the run ends the wait at once: it will not serve it.

The first declaration of a partition id fixes its size for the run: a later node that
declares the same partition with another size is refused with the reason (and never
sampled), and every reply of the partition is bounded by it. Each declaration is vetted
by the run's :class:`.declarations.SizeRule` before it is accepted.
"""

from __future__ import annotations

import concurrent.futures
import time
from logging import INFO, WARNING
from typing import Any

from flwr.common import GetPropertiesIns, Message, MessageTypeLegacy
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy

from common.messages import Declaration as Keys

from .declarations import SizeRule, read_declaration
from .failures import RunFailed

# a node's error replies that refuse the run for good: its own policy (a mod's failed
# precondition, fedefc_client/policy.py) or its trust settings (an app it will not run)
REFUSING_CODES = frozenset({ErrorCode.MOD_FAILED_PRECONDITION, ErrorCode.INVALID_FAB})
POLL_S = 1.0  # how often the wait for the nodes looks again
REPORT_S = 15.0  # how often it logs who is missing
RETRY_S = 30.0  # a node whose declaration failed is asked again after this long


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


class NodeRefusal(RuntimeError):
    """A node's answer that refuses this run for good (:data:`REFUSING_CODES`)."""


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
                kind = NodeRefusal if reply.error.code in REFUSING_CODES else RuntimeError
                answers[proxy.cid] = kind(f"error {reply.error.code}: {reply.error.reason}")
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


class PartitionRegistry:
    """Maps partition ids to the client proxies that currently serve them, and keeps the
    data size each partition declared (fixed for the run)."""

    def __init__(self, rule: SizeRule, timeout: float | None = 120.0,
                 wait_for_nodes: float = 300.0):
        self.rule = rule
        self.timeout = timeout
        self.wait_for_nodes = wait_for_nodes
        self.declared: dict[int, int] = {}  # partition id -> its size, fixed for the run
        self._pid_of_cid: dict[str, int] = {}
        self._refused: dict[str, str] = {}  # node -> why its declaration was refused
        self._failed: dict[str, tuple[str, float]] = {}  # node -> (its error, when)
        self._refusals: dict[str, str] = {}  # node -> why it refuses this run for good
        self._news: dict[str, Any] = {}  # declarations and refusals since the last take
        self._waited = False  # whether this process waited for the nodes to connect

    def partition_of(self, cid: str) -> int | None:
        """The partition id node ``cid`` registered with, if it did."""
        return self._pid_of_cid.get(cid)

    def admit(self, cid: str, props: dict[str, Any]) -> str | None:
        """Register node ``cid`` from its declaration; the reason it is refused, or None."""
        decl = read_declaration(props)
        if isinstance(decl, str):
            return f"malformed declaration: {decl}"
        reason = self.rule.vet(decl)
        fixed = self.declared.get(decl.partition)
        if reason is None and fixed is not None and fixed != decl.num_examples:
            reason = (f"declares {decl.num_examples} samples for partition {decl.partition}, "
                      f"which was declared with {fixed}; a declaration is fixed for the run")
        if reason is not None:
            return reason
        if fixed is None:
            self.declared[decl.partition] = decl.num_examples
            self._news.setdefault("declared", {})[decl.partition] = decl.num_examples
        self._pid_of_cid[cid] = decl.partition
        return None

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
        while True:
            # a node's first message may start its ClientApp cold (imports, data): it has
            # the rest of the wait to answer, not just the usual per-message timeout
            remaining = max(self.wait_for_nodes - (time.monotonic() - start), 1.0)
            serving = self.refresh(client_manager, server_round, remaining)
            missing = sorted(set(range(self.rule.num_clients)) - set(serving))
            if missing and self._refusals:  # a node that refuses the run will not serve it
                raise RunFailed("; ".join(f"node {cid} refuses the run: {why}"
                                          for cid, why in self._refusals.items())
                                + f"; {self.report(len(client_manager.all()), missing)}")
            if not missing:
                log(INFO, "all %d partitions are served (after %.0f s)", self.rule.num_clients,
                    time.monotonic() - start)
                return serving
            now = time.monotonic()
            if now - start >= self.wait_for_nodes:
                raise RunFailed(f"waited {self.wait_for_nodes:.0f} s (wait-for-nodes) for a "
                                f"node of each of the run's {self.rule.num_clients} partitions "
                                f"(num-clients); {self.report(len(client_manager.all()), missing)}")
            if now >= next_report:
                log(INFO, "waiting for nodes: %s", self.report(len(client_manager.all()),
                                                               missing))
                next_report = now + REPORT_S
            time.sleep(POLL_S)

    def report(self, connected: int, missing: list[int]) -> str:
        """Who is there and who is not, with the nodes' own reasons."""
        served = self.rule.num_clients - len(missing)
        text = (f"{served} of {self.rule.num_clients} partitions served by {connected} "
                f"connected nodes; missing partitions {ranges(missing)}")
        problems = [f"node {cid} refused: {why}" for cid, why in self._refused.items()]
        problems += [f"node {cid} failed to declare: {why}"
                     for cid, (why, _) in self._failed.items()]
        if problems:
            text += "; " + "; ".join(problems[:5])
            text += f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return text

    def refresh(self, client_manager: ClientManager, server_round: int,
                timeout: float | None = None) -> dict[int, ClientProxy]:
        """Ask the nodes not seen yet for their declaration (each may take ``timeout``
        seconds, by default the registry's); return {partition id: proxy}."""
        proxies = client_manager.all()
        now = time.monotonic()
        unknown = [proxies[cid] for cid in proxies
                   if cid not in self._pid_of_cid and cid not in self._refused
                   and now - self._failed.get(cid, ("", -RETRY_S))[1] >= RETRY_S]
        if unknown:
            answers = ask_declarations(unknown, timeout or self.timeout, server_round)
            for cid, props in answers.items():
                if isinstance(props, Exception):  # a node that cannot answer (or whose own
                    # policy refuses the run) is not sampled; the record says why
                    self._failed[cid] = (str(props), time.monotonic())
                    if isinstance(props, NodeRefusal):
                        self._refusals[cid] = str(props)
                    self._news.setdefault("unanswered_nodes", []).append(
                        {"node": cid, "reason": str(props)})
                    log(WARNING, "node %s did not report its partition id: %s", cid, props)
                    continue
                self._failed.pop(cid, None)
                reason = self.admit(cid, props)
                if reason is not None:
                    self._refused[cid] = reason
                    self._news.setdefault("refused_nodes", []).append(
                        {"node": cid, "partition": props.get(Keys.PARTITION_ID),
                         "reason": reason})
                    log(WARNING, "node %s refused: %s", cid, reason)
            log(INFO, "partition registry: %d nodes known", len(self._pid_of_cid))
        serving: dict[int, ClientProxy] = {}
        order = {cid: i for i, cid in enumerate(self._pid_of_cid)}
        for cid in sorted((c for c in proxies if c in order), key=order.__getitem__):
            pid = self._pid_of_cid[cid]
            if pid in serving:
                log(WARNING, "partition %d is claimed by nodes %s and %s; using the newer",
                    pid, serving[pid].cid, cid)
            serving[pid] = proxies[cid]  # a node that came back replaces its old entry
        return serving

    def take_news(self) -> dict[str, Any]:
        """Declarations accepted and nodes refused since the last call (for the round
        record: ``declared`` {partition: size}, ``refused_nodes`` with reasons)."""
        news, self._news = self._news, {}
        return news

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the partitions' declared sizes, fixed for the run."""
        return {"declared_sizes": {str(p): n for p, n in self.declared.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.declared = {int(p): int(n) for p, n in state.get("declared_sizes", {}).items()}
