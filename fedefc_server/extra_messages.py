"""Extra messages outside a training round, to chosen clients (legacy ClientProxy API).

FedCorr's label corrections and FedNoRo's one-off detection need clients that the
round did not sample. The strategy sends them a legacy ``fit`` message (through the
partition registry's proxies, as the registry's own ``get_properties`` queries) whose
config carries a task key; the client's method runs the task instead of training and
replies with 0 examples, its unchanged weights and the task's metrics. Works the same
in simulation and deployment. Every task is listed in docs/BASELINE-METHODS.md. A client that
fails or does not answer within the run's ``client-timeout`` misses the task.
"""

from __future__ import annotations

import concurrent.futures
import math
from logging import WARNING

from flwr.common import Code, FitIns, FitRes, Parameters, Scalar
from flwr.common.logger import log
from flwr.server.client_proxy import ClientProxy

from common.durations import duration_text


def send_tasks(proxies: dict[int, ClientProxy], parameters: Parameters,
               configs: dict[int, dict[str, Scalar]], server_round: int,
               timeout: float | None = None, max_workers: int = 16) -> dict[int, FitRes]:
    """Send partition ``pid`` the global ``parameters`` with ``configs[pid]``; return the
    successful replies by partition id, in id order (a failed one is logged and left out).

    ``timeout`` (seconds, None = wait for ever) bounds each call, as the run's
    ``client-timeout`` bounds a round's calls; the whole exchange waits at most
    ``timeout`` per wave of ``max_workers`` calls, so a client whose call ignores its
    timeout is left out instead of hanging the server."""
    targets = sorted(pid for pid in configs if pid in proxies)
    if not targets:
        return {}
    workers = min(max_workers, len(targets))
    deadline = None if timeout is None else timeout * math.ceil(len(targets) / workers)
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    futures = {pool.submit(proxies[pid].fit, FitIns(parameters, configs[pid]), timeout,
                           server_round): pid for pid in targets}
    done, late = concurrent.futures.wait(futures, timeout=deadline)
    pool.shutdown(wait=False, cancel_futures=True)  # a hung call must not block the server
    for pid in sorted(futures[fut] for fut in late):
        log(WARNING, "partition %d: no reply to the extra message within %s", pid,
            duration_text(deadline))
    replies = {}
    for fut in done:
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
