"""Extra messages outside a training round, to chosen clients (legacy ClientProxy API).

FedCorr's label corrections and FedNoRo's one-off detection need clients that the
round did not sample. The strategy sends them a legacy ``fit`` message (through the
partition registry's proxies, as the registry's own ``get_properties`` queries) whose
config carries a task key; the client's method runs the task instead of training and
replies with 0 examples, its unchanged weights and the task's metrics. Works the same
in simulation and deployment. Every task is listed in docs/BASELINES.md.
"""

from __future__ import annotations

import concurrent.futures
from logging import WARNING

from flwr.common import Code, FitIns, FitRes, Parameters, Scalar
from flwr.common.logger import log
from flwr.server.client_proxy import ClientProxy


def send_tasks(proxies: dict[int, ClientProxy], parameters: Parameters,
               configs: dict[int, dict[str, Scalar]], server_round: int,
               timeout: float | None = None, max_workers: int = 16) -> dict[int, FitRes]:
    """Send partition ``pid`` the global ``parameters`` with ``configs[pid]``; return the
    successful replies by partition id, in id order (a failed one is logged and left out)."""
    targets = sorted(pid for pid in configs if pid in proxies)
    replies: dict[int, FitRes] = {}
    if not targets:
        return replies
    with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(targets))) as pool:
        futures = {pool.submit(proxies[pid].fit, FitIns(parameters, configs[pid]), timeout,
                               server_round): pid for pid in targets}
        for fut in concurrent.futures.as_completed(futures):
            pid = futures[fut]
            try:
                res = fut.result()
            except Exception as err:  # a client that cannot answer misses this task
                log(WARNING, "partition %d: extra message failed: %s", pid, err)
                continue
            if res.status.code != Code.OK:
                log(WARNING, "partition %d: extra message failed: %s", pid, res.status.message)
                continue
            replies[pid] = res
    return dict(sorted(replies.items()))
