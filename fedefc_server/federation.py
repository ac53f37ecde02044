"""Waiting for the federation to form before a run's first round (docs/RELIABILITY.md,
"A run that trained nothing fails").

Before its first round (round 0's federated evaluation, round 1, or the first round of a
resumed run) a run waits until every partition 0..num-clients-1 is served
(:meth:`Federation.serving`), so that the first sample is not drawn from the few nodes
that happen to be connected already, logging at a steady interval how many are and
which are missing, with the errors and refusals of the nodes that answered
(:func:`.registry_report.report`); when ``wait-for-nodes`` seconds pass first, the run
fails with that report (a federation whose nodes never formed is a failed run, not an
empty one).

The wait ends early once at least num-clients nodes are connected and every one of them
has answered for good (admitted; refused; or an error reply, such as a node whose own
policy refuses the run): the run then starts without the partitions nobody serves, says
so in its log, its first record and its summary's notes, or, when no partition is
served, fails at once. It also fails at once (after :data:`SETTLE_S`, so that nodes
connecting together are all asked) when every node that connected refused for a reason
that waiting does not change: its declaration refused, or an error reply that is a
config mismatch or its policy's refusal (:attr:`.failures.NodeRefused.permanent`).
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from .attendance import ranges
from .failures import RunFailed
from .registry import PartitionRegistry
from .registry_report import report

POLL_S = 1.0  # how often the wait for the nodes looks again
REPORT_S = 15.0  # how often it logs who is missing
SETTLE_S = 20.0  # how long every node must stand by a lasting refusal before the run fails


class Federation:
    """The nodes serving the run's partitions, as the rounds ask for them: the first
    call of a process waits for the federation to form (module docstring)."""

    def __init__(self, registry: PartitionRegistry):
        """``registry``: who serves which partition; its ``wait_for_nodes`` bounds the
        wait."""
        self.registry = registry
        self.wait_for_nodes = registry.wait_for_nodes
        self.missing_at_start: str | None = None  # the partitions the run started without

    def serving(self, client_manager: ClientManager, server_round: int
                ) -> dict[int, ClientProxy]:
        """{partition id: node} of the registered nodes; the first call waits until
        every partition is served, RunFailed when ``wait-for-nodes`` seconds pass first."""
        if self.registry.formed:
            return self.registry.refresh(client_manager, server_round)
        serving = self._wait(client_manager, server_round)
        self.registry.formed = True
        return serving

    def answered(self, cid: str) -> bool:
        """Whether node ``cid`` has answered for good: it holds or waits for a partition,
        was refused, or replied with an error (a node that did not answer may still)."""
        registry = self.registry
        return (registry.partition_of(cid) is not None or cid in registry.waiting
                or registry.answers.replied(cid))

    def _wait(self, client_manager: ClientManager, server_round: int
              ) -> dict[int, ClientProxy]:
        registry, total = self.registry, self.registry.rule.num_clients
        start = time.monotonic()
        next_report = start
        refused_since: tuple[frozenset[str], float] | None = None  # nodes, since when
        while True:
            # a node's first message may start its ClientApp cold (imports, data): it has
            # the rest of the wait to answer, not just the usual per-message timeout
            remaining = max(self.wait_for_nodes - (time.monotonic() - start), 1.0)
            serving = registry.refresh(client_manager, server_round, remaining)
            missing = sorted(set(range(total)) - set(serving))
            if not missing:
                log(INFO, "all %d partitions are served (after %.0f s)", total,
                    time.monotonic() - start)
                return serving
            nodes = client_manager.all()
            connected = len(nodes)
            if connected >= total and all(map(self.answered, nodes)):
                if not serving:
                    raise RunFailed("every node that connected was refused or failed, so the "
                                    "run would train nothing; "
                                    f"{report(registry, connected, missing)}")
                self.missing_at_start = (f"the run started without partitions "
                                         f"{ranges(missing)}: "
                                         f"{report(registry, connected, missing)}")
                log(WARNING, "%s", self.missing_at_start)
                registry.news["missing_partitions"] = missing
                return serving
            now = time.monotonic()
            if not serving and nodes and all(map(registry.answers.refused_for_good, nodes)):
                if refused_since is None or refused_since[0] != frozenset(nodes):
                    refused_since = (frozenset(nodes), now)
                elif now - refused_since[1] >= min(SETTLE_S, self.wait_for_nodes / 2):
                    raise RunFailed(
                        f"every node that connected refused the run for a reason that "
                        f"waiting does not change (its config or its policy), so the run "
                        f"would train nothing; {report(registry, connected, missing)}. Fix "
                        "the run config or the nodes, then submit again")
            else:
                refused_since = None
            if now - start >= self.wait_for_nodes:
                raise RunFailed(f"waited {self.wait_for_nodes:.0f} s (wait-for-nodes) for a "
                                f"node of each of the run's {total} partitions "
                                f"(num-clients); {report(registry, connected, missing)}")
            if now >= next_report:
                log(INFO, "waiting for nodes: %s", report(registry, connected, missing))
                next_report = now + REPORT_S
            time.sleep(POLL_S)

    def notes(self) -> list[str]:
        """What a reader of the run's summary must know about its nodes."""
        return [self.missing_at_start] if self.missing_at_start else []
