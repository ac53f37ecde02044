"""Client scalars inside SecAgg+'s weighted sum, read back as unweighted means
(docs/PRIVACY.md, "The accuracies inside the secure sum").

Under Flower's SecAgg+ every client k uploads its arrays x_k scaled by its weight
w_k = n_k / M (n_k its sample count, M the round's ``max_weight``), quantized and
masked; the server learns only ``S = sum_k w_k x_k / sum_k w_k``. FedEFC needs the
UNWEIGHTED mean of the clients' accuracies (paper eq. (2)), so each client appends one
array, its *tail*, with one entry per slot i (value v_i in [0, B_i]):

    t_i = (v_i / B_i) * s / n_k,   s = c * M / 2   (c: the clipping range)

Then w_k t_i = (v_i / B_i) * c / 2 does not depend on n_k, and slot 0 holds v = 1 for
every client, so ``B_i * S_i / S_0 = sum_k v_{k,i} / K``: the plain mean over the K
clients in the sum. ``c / 2`` keeps an honest value inside Flower's clipping range even
after its weight is rounded to the quantization grid (w_k is (n_k / M)(1 + d_k) with
|d_k| <= M / (2 n_k 2**22)); the same d_k then weights a client's slots alike, so the
mean is off by at most max |d_k| (relative). The quantizer's grid step, 2c / (2**22 - 1),
adds at most 4 B_i / (2**22 - 1) < 1e-6 B_i per client (docs/PRIVACY.md works both out).
"""

from __future__ import annotations

import numpy as np

from .messages import FitReply

# Slot 0 counts the clients; the others are the reply metrics the server learns only
# as a mean, with the bound B_i an honest client's value lies in; the last is the
# client's update norm over the round's bound (common/update_bound.py: round_bound),
# which the server checks the decoded mean update against (fedefc_server/secure_sum.py).
UPDATE_RATIO = "update-ratio"
SLOTS = (("count", 1.0), (FitReply.ACCURACY, 1.0), (FitReply.GUARD_ACCURACY, 1.0),
         (FitReply.TRAIN_LOSS, 20.0), (UPDATE_RATIO, 1.0))
SUMMED_KEYS = tuple(name for name, _ in SLOTS[1:])
SCALE_KEY = "secagg-scale"  # fit config: s = c * M / 2

# What a secure round's training reply keeps in the clear (docs/PRIVACY.md, "What leaves
# a node"), beyond its sample count: the partition id (the server binds it to the node)
# and the loss's name (fixed by the phase the server set); with ``diagnostics = true``
# also the simulation's diagnostics (known only where the simulator noised the labels).
# Every other metric a local update returns stays on the node.
CLEAR_KEYS = ("partition-id", "loss")
DIAGNOSTIC_KEYS = ("noise-rate", "q-cos", "q-l1")


def tail_scale(clipping_range: float, max_weight: float) -> float:
    """s = c * M / 2, sent to every client of a secure round."""
    return clipping_range * max_weight / 2


def encode_tail(metrics: dict, num_examples: int, scale: float) -> tuple[np.ndarray, dict]:
    """The tail of a reply with ``num_examples`` samples, and its metrics without the
    summed keys. A missing slot value (no accuracy in phase 2) is 0; a value outside
    [0, B_i] is clipped to it. A reply without samples gets a zero tail (its weight is 0)."""
    clear = {k: v for k, v in metrics.items() if k not in SUMMED_KEYS}
    if num_examples <= 0:
        return np.zeros(len(SLOTS)), clear
    values = [1.0] + [float(metrics.get(name, 0.0)) for name in SUMMED_KEYS]
    unit = scale / num_examples
    tail = np.array([min(max(v, 0.0), bound) / bound * unit
                     for v, (_, bound) in zip(values, SLOTS)], dtype=np.float64)
    return tail, clear


def clear_metrics(metrics: dict, diagnostics: bool) -> dict:
    """The metrics of a secure training reply that may travel in the clear."""
    allowed = CLEAR_KEYS + (DIAGNOSTIC_KEYS if diagnostics else ())
    return {k: v for k, v in metrics.items() if k in allowed}
def bad_means(means: dict[str, float], tolerance: float = 1e-5) -> str | None:
    """Why decoded means cannot come from honest tails, or None: every slot's mean
    lies in [0, B_i] (docs/PRIVACY.md, "The decoded sum, checked"), up to ``tolerance``
    x B_i for the quantization (an honest mean is off by less than 2e-6 B_i)."""
    for name, bound in SLOTS[1:]:
        value = means.get(name)
        if value is None or not -tolerance * bound <= value <= bound * (1 + tolerance):
            return (f"the clients' mean {name} {value} is outside [0, {bound:g}]: a tail "
                    "was not encoded honestly")
    return None


def decode_tail(tail: np.ndarray) -> dict[str, float]:
    """The unweighted means ``{key: mean}`` from the aggregated tail ({} when empty)."""
    if tail.shape != (len(SLOTS),) or not tail[0] > 0:
        return {}
    return {name: float(bound * tail[i] / tail[0])
            for i, (name, bound) in enumerate(SLOTS) if i > 0}
