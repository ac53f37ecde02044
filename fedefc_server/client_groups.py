"""A simulation's sampled clients sent in groups (``stacked-clients = G``): one message
per group of G partitions, whose local updates the node steps together
(:mod:`fedefc_client.client_group`, :mod:`common.stacked_training`; docs/BENCHMARKS.md,
"Several clients stepped together").

Send (:func:`group_instructions`): the plan's instructions, one per partition in
partition order, are cut into as few groups of at most G as hold them, their sizes
differing by at most one (10 clients at G = 4: 4, 3 and 3, three workers training at
once, where 4, 4 and 2 would keep two waiting on the third; G = 10: one message); a
group becomes one instruction to its first member's node, carrying the global model
once, its first member's round config, and every member's partition id and round config
as JSON under ``FitConfig.GROUP``.

Receive (:func:`ungroup`): a group's reply holds its members' weights one after another
and their counts and metrics as JSON under ``FitReply.GROUP``; it is cut back into one
reply per member, as if the member's own node had answered, so that the round's screen
and aggregation see what they see without groups. A group that fails, or whose reply
does not hold exactly its members, fails each of its members, named.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.common import FitIns, FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from common.messages import FitConfig, FitReply, group_dumps, group_loads

from .failures import NodeFailed


@dataclass(frozen=True)
class Member:
    """A partition of a group and the proxy of the node that serves it."""

    partition: int
    proxy: ClientProxy


def group_instructions(instructions: list[tuple[ClientProxy, FitIns]], size: int,
                       partition_of) -> tuple[list[tuple[ClientProxy, FitIns]],
                                              dict[str, list[Member]]]:
    """(the instructions to send, the members of each group by its lead node's id); a
    group of one is sent as it was."""
    sent, groups = [], {}
    count = -(-len(instructions) // size)  # the fewest messages of at most ``size``
    stop = 0
    for k in range(count):  # the first len % count groups one larger
        start, stop = stop, stop + len(instructions) // count + (k < len(instructions) % count)
        chunk = instructions[start:stop]
        if len(chunk) == 1:
            sent.extend(chunk)
            continue
        members = [Member(partition_of(proxy.cid), proxy) for proxy, _ in chunk]
        lead, ins = chunk[0]
        listed = [[m.partition, dict(i.config)] for m, (_, i) in zip(members, chunk)]
        sent.append((lead, FitIns(ins.parameters,
                                  {**ins.config, FitConfig.GROUP: group_dumps(listed)})))
        groups[lead.cid] = members
    return sent, groups


def _split(res: FitRes, members: list[Member]) -> list[FitRes]:
    """A group's reply as its members' replies; ValueError when it does not hold
    exactly the group's members."""
    listed = group_loads(str(res.metrics.get(FitReply.GROUP, "null")))
    pids = [int(m[0]) for m in listed] if isinstance(listed, list) else None
    if pids != [m.partition for m in members]:
        raise ValueError(f"the group's reply lists partitions {pids}, not its members "
                         f"{[m.partition for m in members]}")
    arrays = parameters_to_ndarrays(res.parameters)
    per, rest = divmod(len(arrays), len(members))
    if rest or not per:
        raise ValueError(f"the group's reply holds {len(arrays)} arrays for "
                         f"{len(members)} members")
    return [FitRes(res.status, ndarrays_to_parameters(arrays[k * per:(k + 1) * per]),
                   int(count), dict(metrics))
            for k, (_, count, metrics) in enumerate(listed)]


def ungroup(results: list[tuple[ClientProxy, FitRes]], failures: list,
            groups: dict[str, list[Member]]) -> tuple[list[tuple[ClientProxy, FitRes]], list]:
    """Flower's results and failures of a round sent by :func:`group_instructions`, one
    per member."""
    out, failed = [], []
    for proxy, res in results:
        members = groups.get(proxy.cid)
        if members is None:
            out.append((proxy, res))
            continue
        try:
            out.extend((m.proxy, r) for m, r in zip(members, _split(res, members)))
        except (ValueError, TypeError, KeyError, IndexError) as err:
            failed.extend(NodeFailed(m.proxy.cid, m.partition, err) for m in members)
    for failure in failures:
        if isinstance(failure, NodeFailed) and failure.node in groups:
            failed.extend(NodeFailed(m.proxy.cid, m.partition, failure.cause)
                          for m in groups[failure.node])
        elif isinstance(failure, tuple) and failure[0].cid in groups:
            failed.extend((m.proxy, failure[1]) for m in groups[failure[0].cid])
        else:
            failed.append(failure)
    return out, failed
