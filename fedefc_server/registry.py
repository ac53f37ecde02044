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
        for cid in sorted(proxies, key=lambda c: (self._pid_of_cid.get(c, -1), c)):
            pid = self._pid_of_cid.get(cid)
            if pid is None:
                continue
            if pid in serving:
                log(WARNING, "partition %d is claimed by two nodes; keeping one", pid)
                continue
            serving[pid] = proxies[cid]
        return serving
