"""What the registry's state says in words: why no node serves a partition (each round's
record, :mod:`.attendance`), and who is there and who is not (the wait for the
federation's log and its failures, :mod:`.federation`)."""

from __future__ import annotations

from typing import Any

from .attendance import ranges
from .registry import PartitionRegistry


def absence(registry: PartitionRegistry, pid: int) -> dict[str, Any]:
    """Why no connected node serves partition ``pid``, as {partition, node, reason}:
    its node left, was refused or failed to declare, or none has claimed it."""
    cid = registry.node_for(pid)
    claim = registry.claims.get(pid)
    if cid is None and claim is not None:
        return {"partition": pid, "node": claim[0],
                "reason": f"its node was refused: {claim[1]}"}
    if cid is None:
        return {"partition": pid, "node": None,
                "reason": "no node has declared it (none connected, or each that did "
                          "failed before declaring; the log's registry lines say)"}
    answers = registry.answers
    if cid in answers.refused:
        reason = f"its node was refused: {answers.refused[cid]}"
    elif cid in answers.failed:
        reason = f"its node failed to declare: {answers.failed[cid][0]}"
    elif not registry.is_connected(cid):
        reason = "its node is no longer connected"
    else:
        reason = "its node is waiting to be asked again"
    return {"partition": pid, "node": cid, "reason": reason}


def absences(registry: PartitionRegistry, served) -> list[dict[str, Any]]:
    """The run's partitions not among ``served``, each with why no node serves it
    (:func:`absence`), in partition order."""
    return [absence(registry, pid) for pid in range(registry.rule.num_clients)
            if pid not in served]


def report(registry: PartitionRegistry, connected: int, missing: list[int]) -> str:
    """Who is there and who is not, with the nodes' own reasons."""
    total = registry.rule.num_clients
    text = (f"{total - len(missing)} of {total} partitions served by {connected} "
            f"connected nodes; missing partitions {ranges(missing)}")
    problems = registry.answers.problems()
    if problems:
        text += "; " + "; ".join(problems[:5])
        text += f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return text
