"""Per-client vectors kept across rounds in the node's ``context.state`` (a RecordDict).

Flower keeps ``context.state`` per node and run, in simulation and deployment, and
re-sends it with every message, so only small vectors live there (one entry per local
sample: FedCorr's corrected labels and last per-sample losses; FedEFC's pooled K x K
counts), never images.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

VALUES = "values"


def load_vector(state, key: str, length: int) -> np.ndarray | None:
    """The vector stored under ``key``, or None; a stored vector of another length
    (the node's data changed within the run) is an error naming the fix."""
    if state is None or key not in state:
        return None
    vec = state[key][VALUES].numpy()
    if len(vec) != length:
        raise ValueError(
            f"context.state[{key!r}] holds {len(vec)} values where the client expects "
            f"{length}: the node's data changed within the run; restart the run"
        )
    return vec


def save_vector(state, key: str, vector: np.ndarray) -> None:
    """Store ``vector`` under ``key`` (replacing what was there)."""
    if state is None:
        raise ValueError(f"cannot keep {key!r}: the client was built without context.state")
    state[key] = ArrayRecord(array_dict={VALUES: Array(np.ascontiguousarray(vector))})
