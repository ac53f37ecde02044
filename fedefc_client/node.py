"""A node's identity, read from its node config (docs/DEPLOYMENT.md, "Node data").

``partition-id`` (the node's identity: seeds, sampling, reply order) and
``num-partitions`` (= the run's ``num-clients``) are set when the SuperNode starts (or
by the simulation for each virtual node); the ClientApp and every mod read the
partition through :func:`partition_of`, which checks them against the run's
``num-clients``. :func:`identity_mod` makes that check the first thing a message meets,
before the run's code (torch, the data) is imported: a run that is not for this node
is refused within the ClientApp process's start (docs/RELIABILITY.md, "A run that
trained nothing fails"). This module imports neither torch nor the run-config schema.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from common.errors import ConfigError


def partition_of(context: Context, num_clients: int) -> int:
    """The node's ``partition-id``, checked against ``num-partitions`` and the run's
    ``num_clients``."""
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


def declared_clients(run_config: Mapping) -> int | None:
    """The run config's ``num-clients`` as sent, if it is an integer (None: the run
    config's own validation names the problem)."""
    value = run_config.get("num-clients")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def identity_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Refuse (raise :class:`ConfigError`) every message of a run whose ``num-clients``
    does not fit this node's ``partition-id`` and ``num-partitions``
    (:func:`partition_of`), before anything of the run is imported or read."""
    num_clients = declared_clients(ctxt.run_config)
    if num_clients is not None:
        partition_of(ctxt, num_clients)
    return call_next(msg, ctxt)
