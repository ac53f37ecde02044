"""The ClientApp: one client of the run's method per message (:mod:`.run_client`).

A message meets the node's own checks first (:data:`NODE_MODS`), which import no torch
and nothing of the run's training: :func:`.error_reply.error_reply_mod` (a failure
leaves as an error reply naming no private path), :func:`.audit.audit_mod` (what
leaves the node, recorded), :func:`.policy.policy_mod` (a run against the node's policy
is refused) and :func:`.node.identity_mod` (a run whose ``num-clients`` does not fit
the node's ``partition-id`` and ``num-partitions`` is refused). Only a message that
passes them imports the run's mods and client (torch, the data; :mod:`.run_client`):
Flower starts a fresh ClientApp process for every message, so a federation that
refuses a run answers it within a process start, not a torch import
(docs/RELIABILITY.md, "A run that trained nothing fails").
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.client import Client
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from common.flower_log import timestamp_flower_lines

from .audit import audit_mod
from .error_reply import error_reply_mod
from .node import identity_mod
from .policy import policy_mod

# the node's own checks, outermost first (docs/PRIVACY.md §4-§6)
NODE_MODS = [error_reply_mod, audit_mod, policy_mod, identity_mod]


def run_mods(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """The run's mods (:func:`.run_client.run_mods`), imported here: after the node's
    checks."""
    from .run_client import run_mods as mods  # lazy: torch and the run's code, 1.6 s of CPU

    return mods(msg, ctxt, call_next)


def client_fn(context: Context) -> Client:
    """The run's client (:data:`.run_client.client_fn`), imported after the node's
    checks."""
    from .run_client import client_fn as make  # lazy: torch and the run's code, 1.6 s of CPU

    return make(context)


timestamp_flower_lines()
app = ClientApp(client_fn=client_fn, mods=[*NODE_MODS, run_mods])
