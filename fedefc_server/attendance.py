"""Which partitions took part in each round, which did not and why, and when a run that
lost a site ends ``degraded`` (docs/RELIABILITY.md, "A missing site is named").

A partition **misses a training round** when no node serves it as the round is planned
(its node left, was refused, or never came), or when it was sampled and no reply of it
reached the aggregate: the reply failed (an error reply, a timeout, a node that went
away mid-round), the screen step refused it, or its secure group's sum was refused. A
partition that a round did not sample (``fraction`` < 1) misses nothing. Likewise a
partition misses a **federated evaluation** when no node serves it or its evaluation
failed or was refused.

Each round's record lists them (``missing``, ``federated_missing``: {partition, node,
reason}); the summary gathers per partition the rounds it missed
(:func:`missed_by_partition`), and a run in which one partition missed more than
``max-missed-share`` of the run's training rounds ends ``degraded`` (:func:`degradation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Absence = dict[str, Any]  # {"partition": int, "node": str | None, "reason": str}


def absence(partition: int, node: str | None, reason: str) -> Absence:
    return {"partition": int(partition), "node": node, "reason": reason}


def absent_among(expected: Iterable[int], took_part: Iterable[int],
                 known: Iterable[Absence], node_of: dict[int, str],
                 fallback: str) -> list[Absence]:
    """The partitions of ``expected`` that did not take part, sorted: each with the first
    reason ``known`` gives for it, else ``fallback``; ``node_of`` names the node asked."""
    reasons: dict[int, Absence] = {}
    for entry in known:
        if entry.get("partition") is not None:
            reasons.setdefault(int(entry["partition"]), entry)
    done = set(took_part)
    out = []
    for pid in sorted(set(expected) - done):
        entry = reasons.get(pid)
        if entry is None:
            out.append(absence(pid, node_of.get(pid), fallback))
        else:
            out.append(absence(pid, entry.get("node") or node_of.get(pid), entry["reason"]))
    return out


def missed_training(record: dict[str, Any], sampled: list[int],
                    node_of: dict[int, str]) -> list[Absence]:
    """A round's ``missing``: the partitions no node served (``unserved``, from the plan
    step) and the ``sampled`` ones (sent to ``node_of``) with no reply in the aggregate
    (``partition_ids``), each with its reason from the record: a failure, a refusal, a
    refused secure group, the culprit search (:mod:`.culprit_search`), else what stopped
    the round."""
    known = [*record.get("failed_partitions", []),
             *({"partition": r.get("partition"), "node": r.get("node"),
                "reason": f"reply refused: {r['reason']}"}
               for r in record.get("rejected_reasons") or [] if isinstance(r, dict))]
    known += [{"partition": p, "reason": "left out of this round by the search for the "
                                         "client that broke a secure sum"}
              for p in (record.get("culprit_search") or {}).get("left_out", [])]
    for group in record.get("refused_groups") or []:
        known += [{"partition": p, "reason": f"its secure group's sum was refused: "
                                             f"{group['reason']}"}
                  for p in group.get("partitions", [])]
    fallback = "no reply reached the aggregate"
    if record.get("secure_refused"):
        fallback = f"the secure round was refused: {record['secure_refused']}"
    elif record.get("secure_aggregation_halted"):
        fallback = "secure aggregation halted (too few clients answered a stage)"
    elif record.get("failure_reasons"):
        fallback = "failed (the round's failure_reasons give the errors of its nodes)"
    drawn = [p for p in record.get("sampled") or [] if p not in sampled]
    undeclared = [absence(p, node_of.get(p), "its node has not declared its data")
                  for p in drawn]
    trained = absent_among(sampled, record.get("partition_ids") or [], known, node_of,
                           fallback)
    return sorted([*record.get("unserved", []), *undeclared, *trained],
                  key=lambda a: a["partition"])


def missed_by_partition(records: list[dict[str, Any]], field: str = "missing"
                        ) -> dict[str, list[int]]:
    """{partition: the rounds it missed} over ``records`` (partitions that missed none are
    left out; keys are strings, as JSON has them)."""
    out: dict[int, list[int]] = {}
    for record in records:
        for entry in record.get(field) or []:
            out.setdefault(int(entry["partition"]), []).append(int(record["round"]))
    return {str(pid): rounds for pid, rounds in sorted(out.items())}


def allowed_misses(share: float, rounds_run: int) -> int:
    """How many training rounds a partition may miss in a run of ``rounds_run``: the
    floor of ``share`` x rounds_run (a share of 1 allows every round)."""
    return int(share * rounds_run + 1e-9)


def degradation(missed: dict[str, list[int]], rounds_run: int, share: float,
                reasons: dict[int, str] | None = None) -> str | None:
    """Why a run that completed is ``degraded``: the partitions that missed more training
    rounds than ``max-missed-share`` allows (:func:`allowed_misses`), each with its count
    and, from ``reasons``, why it missed its last one; None when none did."""
    allowed = allowed_misses(share, rounds_run)
    over = {pid: rounds for pid, rounds in missed.items() if len(rounds) > allowed}
    if not over:
        return None
    parts = []
    for pid, rounds in over.items():
        why = (reasons or {}).get(int(pid))
        parts.append(f"partition {pid} missed {len(rounds)} of {rounds_run} rounds "
                     f"(rounds {spans(rounds)}{f'; last: {why}' if why else ''})")
    return (f"{'; '.join(parts)}: more than max-missed-share={share:g} allows ({allowed} of "
            f"{rounds_run}); its results come from fewer sites than the federation has")


def spans(rounds: list[int]) -> str:
    """Sorted round numbers as spans: [1, 2, 3, 5] -> "1-3, 5"."""
    out: list[list[int]] = []
    for r in sorted(rounds):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def last_reasons(records: list[dict[str, Any]], field: str = "missing") -> dict[int, str]:
    """{partition: the reason of the last round it missed}."""
    out: dict[int, str] = {}
    for record in records:
        for entry in record.get(field) or []:
            node = f"node {entry['node']}: " if entry.get("node") else ""
            out[int(entry["partition"])] = f"{node}{entry['reason']}"
    return out


def ranges(ids: list[int], limit: int = 12) -> str:
    """Sorted ids as ranges ("0-3, 7"), at most ``limit`` ranges then a count."""
    parts: list[str] = []
    for pid in sorted(ids):
        if parts and parts[-1].split("-")[-1] == str(pid - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{pid}"
        else:
            parts.append(str(pid))
    more = f" and {len(parts) - limit} more ranges" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def describe(absences: list[Absence], limit: int = 6) -> str:
    """One log line's worth: ``partition 2 (node 123): its node left; ...``."""
    parts = [f"partition {a['partition']}"
             + (f" (node {a['node']})" if a.get("node") else "") + f": {a['reason']}"
             for a in absences[:limit]]
    more = f"; and {len(absences) - limit} more" if len(absences) > limit else ""
    return "; ".join(parts) + more
