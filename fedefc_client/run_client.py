"""The run's part of the ClientApp (:mod:`.client_app`): one client of the run's method
per message, its data chosen by the node config, behind the privacy and audit mods.
Imported by the ClientApp once a message has passed the node's own checks; it brings
torch and the run's code.

Node config keys (docs/DEPLOYMENT.md, "Node data"): ``partition-id`` (the node's
identity: seeds, sampling, reply order) and ``num-partitions`` (= the run's
num-clients) always; ``data-path`` for the node's own private data instead of
partition ``partition-id`` of the run's dataset; ``cache-dir`` to keep the prepared
data on disk across the per-message ClientApp processes of a SuperNode;
``policy-file`` for the node's own policy (:mod:`.policy`, docs/PRIVACY.md §5).

Every message passes the privacy and audit mods (:mod:`.mods`, docs/PRIVACY.md). With
``faults`` the attacker of :mod:`.attacker` wraps the client and Flower's SecAgg+ client
(docs/THREAT-MODEL.md); the honest client and mods hold no fault code.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.client.mod.utils import make_ffn
from flwr.clientapp.typing import ClientAppCallable

from common.methods import load_run_config
from common.training import pick_device

from .attacker import lying, with_attacker
from .client import MethodClient
from .local_data import DATA_PATH_KEY, check_node_config, node_data
from .mods import MODS
from .node import partition_of

def method_client(context: Context) -> MethodClient:
    """The run's honest client for this node."""
    cfg = load_run_config(context.run_config)
    pid = partition_of(context, cfg.num_clients)
    node = f"node {context.node_id} (partition-id {pid})"
    node_config = dict(context.node_config)
    check_node_config(node_config, node)
    return MethodClient(
        cfg, pid, lambda: node_data(cfg, pid, node_config, node, pick_device(cfg.device)),
        context.state, private_data=DATA_PATH_KEY in node_config)


# the attacker modes of ``faults`` beside the honest client and mods (.attacker): they
# step aside without faults
client_fn = lying(method_client)
RUN_MODS = with_attacker(MODS)


def run_mods(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """:data:`RUN_MODS` around ``call_next``, as Flower wraps a ClientApp's mods."""
    return make_ffn(call_next, RUN_MODS)(msg, ctxt)
