"""Which Flower node holds which partition, and how many samples it declared.

Flower gives nodes random ids (in simulation too), so sampling nodes with a seeded
RNG would pick different partitions in every run. The registry asks every new node
once for its ``partition-id`` and its data size (a legacy ``get_properties`` message;
docs/PRIVACY.md, "Weights bound to facts"), then the strategy samples partition ids
with its own seeded generator.

A node's declaration is ``{partition-id, num-examples, data}`` (``data``: ``partition``
for a partition of the run's dataset, ``private`` for the node's own data). The first
declaration of a partition id fixes its size for the run: a later node that declares
the same partition with another size is refused with the reason (and never sampled),
and every reply of the partition is bounded by it. The strategy vets each
declaration before it is accepted (``vet``: a partition's size must be the data
plan's, a private size at most ``max-client-samples``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.common import GetPropertiesIns
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

DATA_KINDS = ("partition", "private")


@dataclass(frozen=True)
class Declaration:
    """What a node says about itself when it is first seen."""

    partition: int
    num_examples: int
    data: str  # "partition" | "private"


def read_declaration(props: dict[str, Any]) -> Declaration | str:
    """The declaration in a ``get_properties`` reply, or why it is unusable."""
    pid, n, data = (props.get(k) for k in ("partition-id", "num-examples", "data"))
    for key, value in (("partition-id", pid), ("num-examples", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key} missing or not an integer >= 0 ({value!r:.40})"
    if data not in DATA_KINDS:
        return f"data {data!r:.40} is not one of {', '.join(DATA_KINDS)}"
    return Declaration(pid, n, data)


class PartitionRegistry:
    """Maps partition ids to the client proxies that currently serve them, and keeps the
    data size each partition declared (fixed for the run)."""

    def __init__(self, timeout: float | None = 120.0, max_workers: int = 16,
                 vet: Callable[[Declaration], str | None] | None = None):
        self.timeout = timeout
        self.max_workers = max_workers
        self.vet = vet or (lambda decl: None)
        self.declared: dict[int, int] = {}  # partition id -> its size, fixed for the run
        self._pid_of_cid: dict[str, int] = {}
        self._refused: dict[str, str] = {}  # node -> why its declaration was refused
        self._news: dict[str, Any] = {}  # declarations and refusals since the last take

    def partition_of(self, cid: str) -> int | None:
        """The partition id node ``cid`` registered with, if it did."""
        return self._pid_of_cid.get(cid)

    def admit(self, cid: str, props: dict[str, Any]) -> str | None:
        """Register node ``cid`` from its declaration; the reason it is refused, or None."""
        decl = read_declaration(props)
        if isinstance(decl, str):
            return f"malformed declaration: {decl}"
        reason = self.vet(decl)
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

    def refresh(self, client_manager: ClientManager, server_round: int) -> dict[int, ClientProxy]:
        """Query unknown nodes for their declaration; return {partition id: proxy}."""
        proxies = client_manager.all()
        unknown = [cid for cid in proxies
                   if cid not in self._pid_of_cid and cid not in self._refused]
        if unknown:
            with concurrent.futures.ThreadPoolExecutor(min(self.max_workers, len(unknown))) as ex:
                futures = {ex.submit(proxies[cid].get_properties, GetPropertiesIns({}),
                                     self.timeout, server_round): cid for cid in unknown}
                for fut in concurrent.futures.as_completed(futures):
                    cid = futures[fut]
                    try:
                        props = fut.result().properties
                    except Exception as err:  # a node that cannot answer (or whose own
                        # policy refuses the run) is not sampled; the record says why
                        log(WARNING, "node %s did not report its partition id: %s", cid, err)
                        self._news.setdefault("unanswered_nodes", []).append(
                            {"node": cid, "reason": str(err)})
                        continue
                    reason = self.admit(cid, props)
                    if reason is not None:
                        self._refused[cid] = reason
                        self._news.setdefault("refused_nodes", []).append(
                            {"node": cid, "partition": props.get("partition-id"),
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
