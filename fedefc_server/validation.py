"""Server-side checks of each client reply before it is aggregated.

A reply is rejected (with its reason logged and counted in the round's record) when its
arrays do not match the global model (count, shapes, dtypes), hold NaN or Inf, its
sample count is <= 0 or above ``max_samples``, its partition id is missing, malformed,
not one this round asked for, or repeated, or (phase 1) its accuracy is missing or
outside [0, 1]. The other replies aggregate normally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flwr.common import FitRes, parameters_to_ndarrays


@dataclass(frozen=True)
class Expected:
    """What every reply of a round must look like."""

    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    partitions: frozenset[int]
    phase: int
    max_samples: int


def check_reply(res: FitRes, expected: Expected, seen: set[int]) -> str | None:
    """The reason to reject ``res``, or None when it is acceptable (``seen`` is updated)."""
    pid = res.metrics.get("partition-id")
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"malformed partition id {pid!r}"
    if pid not in expected.partitions:
        return f"partition id {pid} was not asked to train this round"
    if pid in seen:
        return f"partition id {pid} replied twice"
    seen.add(pid)
    if not 0 < res.num_examples <= expected.max_samples:
        return f"sample count {res.num_examples} outside 1..{expected.max_samples}"
    if expected.phase == 1:
        acc = res.metrics.get("accuracy")
        if isinstance(acc, bool) or not isinstance(acc, (int, float)):
            return f"phase-1 accuracy missing or not a number ({acc!r})"
        if not (math.isfinite(acc) and 0.0 <= acc <= 1.0):
            return f"phase-1 accuracy {acc} outside [0, 1]"
    try:
        arrays = parameters_to_ndarrays(res.parameters)
    except Exception as err:  # undecodable bytes
        return f"undecodable parameters ({type(err).__name__})"
    if len(arrays) != len(expected.shapes):
        return f"{len(arrays)} arrays, expected {len(expected.shapes)}"
    for i, (arr, shape, dtype) in enumerate(zip(arrays, expected.shapes, expected.dtypes)):
        if arr.shape != shape:
            return f"array {i} has shape {arr.shape}, expected {shape}"
        if arr.dtype != dtype:
            return f"array {i} has dtype {arr.dtype}, expected {dtype}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"array {i} holds NaN or Inf"
    return None
