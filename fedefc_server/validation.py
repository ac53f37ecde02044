"""Server-side checks of each client reply before it is aggregated (the screen step).

A reply is rejected (with its reason logged and counted in the round's record) when its
partition id is missing, malformed, not the one its node registered with (whatever
the order of arrival), not one this round asked for, or repeated; its sample count
breaks the declared-size rule (:mod:`.declarations`); its arrays do not match the
global model (count, shapes, dtypes) or hold NaN or Inf; its update (its float arrays
minus the global model's) is longer than the round's norm bound
(:func:`common.update_bound.norm_bound`:
``dp-clip``, verified, and ``max-update-norm``); its accuracy (when the round
asks for one: FedEFC's phase 1, and phase 2 under the phase-2 guard,
:func:`common.messages.carries_accuracy`) is missing or not a number in [0, 1]; or a
metric the round's schema declares (the core's and the method's
:class:`common.messages.ReplyMetric` values) is there but is not a finite number (a
count: not an integer >= 0). bool, str and bytes are not numbers here:
``float()`` would take True or "0.9", or raise. A method's server adds checks of its own
metrics (``MethodServer.check_metrics``). The other replies aggregate normally.

Under secure aggregation the replies are screened before they are summed, with their
arrays masked: then the arrays must be int64 arrays of the masked vector's shapes with
values in [0, 2^32) (the NaN, norm and accuracy checks become the checks of the decoded
sum, :mod:`.secure_sum`; docs/PRIVACY.md).

An evaluation reply (federated evaluation, :func:`check_evaluate_reply`) is rejected
when its partition id is malformed, not its node's registered one, not one the round
asked or repeated, its sample count is not the held-out size its node declared, or,
when it holds samples, its loss is not a finite number >= 0 or its accuracies are not
numbers in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import EvaluateRes, FitRes, parameters_to_ndarrays
from flwr.common.logger import log

from common.messages import EvaluateReply, FitReply, ReplyMetric
from common.update_bound import float_norms, rounding_slack

from .declarations import bad_count

MOD_RANGE = 2**32  # SecAgg+'s modulus (Flower's default, the one SecureRound uses)


@dataclass(frozen=True)
class Expected:
    """What every reply of a round must look like: ``sizes`` holds the declared size of
    each partition asked to train (``subset``: a reply may count fewer samples);
    ``masked``: the arrays are a SecAgg+ masked vector (integers, no dtypes to match:
    ``dtypes`` are then the global model's, which the decoded sum takes); ``schema``:
    the metrics a reply may carry; ``max_norm`` (with the global model ``reference``):
    the longest update a plain reply may send (None: no bound), named by ``norm_key``."""

    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    sizes: dict[int, int]
    needs_accuracy: bool
    subset: bool = False
    masked: bool = False
    schema: tuple[ReplyMetric, ...] = ()
    max_norm: float | None = None
    reference: list[np.ndarray] | None = None
    norm_key: str = ""


def bad_update_norm(arrays: list[np.ndarray], expected: Expected) -> str | None:
    """Why the update of ``arrays`` (their float arrays minus the global model's, in
    float64) is longer than ``expected.max_norm``, or None. The float32 rounding of
    the client's clipped weights is allowed for (:func:`common.update_bound.rounding_slack`)."""
    norm, size = float_norms(arrays, expected.reference)
    if not norm <= expected.max_norm + rounding_slack(expected.max_norm, size):  # also inf
        return (f"update norm {norm:.6g} above {expected.max_norm:.6g}, the bound "
                f"{expected.norm_key} sets")
    return None


def bad_number(key: str, value: Any, low: float = -math.inf, high: float = math.inf,
               integer: bool = False) -> str | None:
    """Why metric ``key`` = ``value`` is not a finite number (an int when ``integer``)
    in [low, high], or None when it is."""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an integer" if integer else "a number"
        return f"{key} missing or not {what} ({value!r:.40})"
    if not (math.isfinite(value) and low <= value <= high):
        return f"{key} {value} outside [{low:g}, {high:g}]"
    return None


def bad_metrics(metrics: dict[str, Any], schema: tuple[ReplyMetric, ...]) -> str | None:
    """Why a metric of ``schema`` present in ``metrics`` is unusable, or None."""
    for metric in schema:
        if metric.key in metrics:
            value = metrics[metric.key]
            reason = (bad_number(metric.key, value, 0, integer=True) if metric.kind == "count"
                      else bad_number(metric.key, value))
            if reason:
                return reason
    return None


def check_reply(res: FitRes, expected: Expected, seen: set[int],
                node_partition: int | None) -> str | None:
    """The reason to reject ``res`` of a node registered with ``node_partition``, or None
    when it is acceptable (``seen`` is updated)."""
    pid = res.metrics.get(FitReply.PARTITION_ID)
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"malformed partition id {pid!r:.40}"
    if pid != node_partition:
        return f"partition id {pid} is not its node's registered partition {node_partition}"
    if pid not in expected.sizes:
        return f"partition id {pid} was not asked to train this round"
    if pid in seen:
        return f"partition id {pid} replied twice"
    seen.add(pid)
    reason = bad_count(res.num_examples, expected.sizes[pid], expected.subset)
    if reason:
        return reason
    if expected.needs_accuracy:
        reason = bad_number("accuracy", res.metrics.get(FitReply.ACCURACY), 0.0, 1.0)
        if reason:
            return reason
    reason = bad_metrics(res.metrics, expected.schema)
    if reason:
        return reason
    try:
        arrays = parameters_to_ndarrays(res.parameters)
    except Exception as err:  # undecodable bytes
        return f"undecodable parameters ({type(err).__name__})"
    if len(arrays) != len(expected.shapes):
        return f"{len(arrays)} arrays, expected {len(expected.shapes)}"
    for i, (arr, shape, dtype) in enumerate(zip(arrays, expected.shapes, expected.dtypes)):
        if arr.shape != shape:
            return f"array {i} has shape {arr.shape}, expected {shape}"
        if expected.masked:
            if arr.dtype != np.int64:
                return f"masked array {i} has dtype {arr.dtype}, expected int64"
            if arr.size and not (arr.min() >= 0 and arr.max() < MOD_RANGE):
                return f"masked array {i} holds values outside [0, 2^32)"
            continue
        if arr.dtype != dtype:
            return f"array {i} has dtype {arr.dtype}, expected {dtype}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"array {i} holds NaN or Inf"
    if expected.max_norm is not None and not expected.masked:
        return bad_update_norm(arrays, expected)
    return None


def check_evaluate_reply(res: EvaluateRes, partitions: frozenset[int], seen: set[int],
                         held_out: int | None, node_partition: int | None) -> str | None:
    """The reason to reject an evaluation reply of a node registered with
    ``node_partition``, which declared ``held_out`` held-out samples, or None (``seen``
    is updated)."""
    pid = res.metrics.get(EvaluateReply.PARTITION_ID)
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"malformed partition id {pid!r:.40}"
    if pid != node_partition:
        return f"partition id {pid} is not its node's registered partition {node_partition}"
    if pid not in partitions:
        return f"partition id {pid} was not asked to evaluate this round"
    if pid in seen:
        return f"partition id {pid} replied twice"
    seen.add(pid)
    n = res.num_examples
    if isinstance(n, bool) or not isinstance(n, int) or n != held_out:
        return (f"held-out sample count {n!r:.40} differs from the {held_out} held-out "
                "samples its node declared")
    if n == 0:
        return None
    reason = bad_number("held-out loss", res.loss, 0.0)
    for key in (EvaluateReply.ACCURACY, EvaluateReply.TRUE_ACCURACY):
        if reason is None and (key == EvaluateReply.ACCURACY or key in res.metrics):
            reason = bad_number(f"held-out {key}", res.metrics.get(key), 0.0, 1.0)
    return reason


def sort_replies(server_round: int, what: str, results: list[tuple[Any, Any]],
                 partition_of: Callable[[str], int | None],
                 check: Callable[[Any, int | None], str | None],
                 ) -> tuple[list[tuple[Any, Any]], list[dict[str, Any]]]:
    """(accepted replies, rejections {node, partition, reason}) of ``results`` (node proxy,
    reply) pairs: ``check`` gives a reply's reason to reject it, given the partition its
    node registered (``partition_of``); each rejection is logged."""
    accepted, rejected = [], []
    for proxy, res in results:
        node_pid = partition_of(proxy.cid)
        reason = check(res, node_pid)
        if reason is None:
            accepted.append((proxy, res))
        else:
            rejected.append({"node": proxy.cid, "partition": node_pid, "reason": reason})
            log(WARNING, "round %d: rejected %s of node %s (partition %s): %s",
                server_round, what, proxy.cid, node_pid, reason)
    return accepted, rejected
