"""Aggregating the clients' reported accuracies into A(t) (paper eq. (2) and robust variants).

The paper averages without weights (``mean``). A client's accuracy cannot be checked by
the server, and FedEFC's phase switch depends on it, so ``median`` and ``trimmed-mean``
bound the influence of clients that report false accuracies.
"""

from __future__ import annotations

import numpy as np

ACCURACY_AGGREGATIONS = ("mean", "median", "trimmed-mean")


def aggregate_accuracy(values: list[float], how: str = "mean", trim: float = 0.1) -> float | None:
    """A(t) from the clients' accuracies; None when there are none.

    ``trimmed-mean`` drops ``floor(trim * n)`` values at each end before averaging.
    """
    if not values:
        return None
    arr = np.sort(np.asarray(values, dtype=float))
    if how == "mean":
        return float(arr.mean())
    if how == "median":
        return float(np.median(arr))
    if how == "trimmed-mean":
        cut = int(np.floor(trim * len(arr)))
        return float(arr[cut:len(arr) - cut].mean())
    raise ValueError(f"accuracy-aggregation={how!r} is unknown; use one of {ACCURACY_AGGREGATIONS}")
