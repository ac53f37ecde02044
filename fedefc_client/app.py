"""The ClientApp: one FedEFC client per message, its partition from the node config."""

from __future__ import annotations

from flwr.client import ClientApp
from flwr.common import Context

from common.config import ConfigError, load_run_config

from common.training import pick_device

from .client import FedEFCClient
from .local_data import partition_data


def partition_of(context: Context, num_clients: int) -> int:
    """The node's ``partition-id``, checked against ``num-partitions`` and ``num-clients``."""
    node = context.node_config
    if "partition-id" not in node:
        raise ConfigError(
            f"node {context.node_id}: node config has no 'partition-id'; start the SuperNode "
            "with --node-config 'partition-id=K num-partitions=N'"
        )
    pid = int(node["partition-id"])
    parts = int(node.get("num-partitions", num_clients))
    if parts != num_clients:
        raise ConfigError(
            f"node {context.node_id}: num-partitions={parts} differs from the run's "
            f"num-clients={num_clients}; make them equal (simulation: num-supernodes)"
        )
    if not 0 <= pid < num_clients:
        raise ConfigError(
            f"node {context.node_id}: partition-id={pid} is outside 0..{num_clients - 1}"
        )
    return pid


def client_fn(context: Context):
    cfg = load_run_config(context.run_config)
    pid = partition_of(context, cfg.num_clients)
    return FedEFCClient(cfg, pid, lambda: partition_data(cfg, pid, pick_device(cfg.device)),
                        context.state).to_client()


app = ClientApp(client_fn=client_fn)
