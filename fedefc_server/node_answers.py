"""Asking nodes for their declarations, and what each answered that made it no holder.

The nodes of a Flower grid are asked all at once: one batch of messages and one wait for
the replies (a node at a time cost ~42 ms per node). Round 1 then costs about what
Flower charges for one message per node, which its simulation engine makes quadratic in
the number of nodes (docs/BENCHMARKS.md, "Planning a round"). Other client proxies (the
tests' in-process stand-ins) are asked directly.

A node's answer is a declaration (:mod:`.declarations`, which the registry admits or
refuses: :mod:`.registry`) or a reason it has none: a silence, or an error reply, which
may be one that waiting does not change (:attr:`.failures.NodeRefused.permanent`: a
config mismatch, its policy). :class:`NodeAnswers` keeps those reasons: the registry
asks a node that failed again only after :data:`RETRY_S`, the wait for the federation
(:mod:`.federation`) ends when every node has answered for good, and the reports
(:mod:`.registry_report`) quote them.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from flwr.common import GetPropertiesIns, Message, MessageTypeLegacy
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy

from common.durations import duration_text

from .failures import NodeRefused

RETRY_S = 30.0  # a node whose declaration failed is asked again after this long


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
                answers[proxy.cid] = TimeoutError(f"no reply within {duration_text(timeout)}")
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


class NodeAnswers:
    """Why each node that answered holds no partition: its declaration refused, or no
    declaration (an error reply or a silence)."""

    def __init__(self) -> None:
        self.refused: dict[str, str] = {}  # node -> why its declaration was refused
        # node -> (its error, when, whether it answered: an error reply, not a silence)
        self.failed: dict[str, tuple[str, float, bool]] = {}
        self.lasting: set[str] = set()  # nodes whose error reply waiting does not change

    def fail(self, cid: str, err: Exception) -> None:
        """Node ``cid`` gave no declaration: ``err`` says why."""
        self.failed[cid] = (str(err), time.monotonic(), not isinstance(err, TimeoutError))
        if isinstance(err, NodeRefused) and err.permanent:
            self.lasting.add(cid)

    def declared(self, cid: str) -> None:
        """Node ``cid`` gave a declaration: its earlier failures no longer count."""
        self.failed.pop(cid, None)
        self.lasting.discard(cid)

    def may_ask(self, cid: str) -> bool:
        """Whether node ``cid`` is neither refused nor failed in the last RETRY_S s."""
        return (cid not in self.refused and
                time.monotonic() - self.failed.get(cid, ("", -RETRY_S, False))[1] >= RETRY_S)

    def replied(self, cid: str) -> bool:
        """Whether node ``cid`` was refused or replied with an error (not a silence)."""
        return cid in self.refused or self.failed.get(cid, ("", 0.0, False))[2]

    def refused_for_good(self, cid: str) -> bool:
        """Whether node ``cid`` refused in a way that waiting does not change: its
        declaration was refused, or it answered with a lasting refusal."""
        return cid in self.refused or cid in self.lasting

    def problems(self) -> list[str]:
        """Each refused or failed node with its reason, refusals first."""
        return ([f"node {cid} refused: {why}" for cid, why in self.refused.items()]
                + [f"node {cid} failed to declare: {why}"
                   for cid, (why, _, _) in self.failed.items()])
