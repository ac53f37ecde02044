"""A node's identity, read from its node config (docs/DEPLOYMENT.md, "Node data").

``partition-id`` (the node's identity: seeds, sampling, reply order) and
``num-partitions`` (= the run's ``num-clients``) are set when the SuperNode starts (or
by the simulation for each virtual node); the ClientApp and every mod read the
partition through :func:`partition_of`, which checks them against the run's
``num-clients``. :func:`identity_mod` makes that check one of the node's own first
mods (``fedefc_client/client_app.py: NODE_MODS``), before the run's training code
(torch, the data) is imported: a run that is not for this node is refused within the
ClientApp process's start (docs/RELIABILITY.md, "A run that trained nothing fails").
This module imports no torch (the run-config schema imports none either).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from common.errors import ConfigError
from common.methods import load_run_config


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


def identity_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Refuse (raise :class:`ConfigError`) every message of a run whose ``num-clients``
    does not fit this node's ``partition-id`` and ``num-partitions``
    (:func:`partition_of`), before the run's training code is imported."""
    partition_of(ctxt, load_run_config(ctxt.run_config).num_clients)
    return call_next(msg, ctxt)
