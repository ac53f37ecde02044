"""A node's identity, read once from its node config (docs/DEPLOYMENT.md, "Node data").

``partition-id`` (the node's identity: seeds, sampling, reply order) and
``num-partitions`` (= the run's ``num-clients``) are set when the SuperNode starts (or
by the simulation for each virtual node); the ClientApp and every mod read the
partition through :func:`partition_of`, which checks them against the run config.
"""

from __future__ import annotations

from flwr.common import Context

from common.config import ConfigError, RunConfig


def partition_of(context: Context, cfg: RunConfig) -> int:
    """The node's ``partition-id``, checked against ``num-partitions`` and ``num-clients``."""
    node = context.node_config
    if "partition-id" not in node:
        raise ConfigError(
            f"node {context.node_id}: node config has no 'partition-id'; start the SuperNode "
            "with --node-config 'partition-id=K num-partitions=N'"
        )
    pid = int(node["partition-id"])
    parts = int(node.get("num-partitions", cfg.num_clients))
    if parts != cfg.num_clients:
        raise ConfigError(
            f"node {context.node_id}: num-partitions={parts} differs from the run's "
            f"num-clients={cfg.num_clients}; make them equal (simulation: num-supernodes)"
        )
    if not 0 <= pid < cfg.num_clients:
        raise ConfigError(
            f"node {context.node_id}: partition-id={pid} is outside 0..{cfg.num_clients - 1}"
        )
    return pid
