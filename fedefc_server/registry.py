"""Which Flower node holds which partition, so clients are sampled by partition id.

Flower gives nodes random ids (in simulation too), so sampling nodes with a seeded
RNG would pick different partitions in every run. The registry asks every new node
once for its ``partition-id`` (a legacy ``get_properties`` message; cheap, no data
is loaded), then the strategy samples partition ids with its own seeded generator.
"""

from __future__ import annotations

import concurrent.futures
from logging import INFO, WARNING

from flwr.common import GetPropertiesIns
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy


class PartitionRegistry:
    """Maps partition ids to the client proxies that currently serve them."""

    def __init__(self, timeout: float | None = 120.0, max_workers: int = 16):
        self.timeout = timeout
        self.max_workers = max_workers
        self._pid_of_cid: dict[str, int] = {}

    def partition_of(self, cid: str) -> int | None:
        """The partition id node ``cid`` reported, if it did."""
        return self._pid_of_cid.get(cid)

    def refresh(self, client_manager: ClientManager, server_round: int) -> dict[int, ClientProxy]:
        """Query unknown nodes for their partition id; return {partition id: proxy}."""
        proxies = client_manager.all()
        unknown = [cid for cid in proxies if cid not in self._pid_of_cid]
        if unknown:
            with concurrent.futures.ThreadPoolExecutor(min(self.max_workers, len(unknown))) as ex:
                futures = {ex.submit(proxies[cid].get_properties, GetPropertiesIns({}),
                                     self.timeout, server_round): cid for cid in unknown}
                for fut in concurrent.futures.as_completed(futures):
                    cid = futures[fut]
                    try:
                        props = fut.result().properties
                        self._pid_of_cid[cid] = int(props["partition-id"])
                    except Exception as err:  # a node that cannot answer is not sampled
                        log(WARNING, "node %s did not report its partition id: %s", cid, err)
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
