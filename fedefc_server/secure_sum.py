"""The decoded sum of a secure round, checked before it is applied (docs/PRIVACY.md,
"The decoded sum, checked"; docs/THREAT-MODEL.md, "Steering the secure sum").

SecAgg+ hides each client's vector, so a client can put anything inside its mask: an
inflated weight factor, an accuracy outside [0, 1], random integers. What the server
can check is the sum. Flower's workflow hands the strategy the weighted mean
``Σ_k w_k x_k / Σ_k w_k`` of the K clients in the sum and reads the weight total
Q = Σ_k q_k from its weight factor slot, where an honest client's
q_k = round(n_k / M × 2^22) (n_k its clear sample count, M the round's ``max_weight``).
An honest sum satisfies, up to the quantization:

1. Q = Σ_k n_k / M × 2^22, within K/2 (each q_k is rounded once);
2. every value is finite and within ±K c 2^22 / Q (c the clipping range): the sum of K
   values each clipped to ±c, divided by the weight total;
3. the tail's count slot sums to the K clients (each contributes (q_k / 2^22)(c M / 2 n_k),
   about c/2; within K quantization steps 2c / 2^22);
4. every mean of the tail lies in its slot's bounds (:func:`common.secure_means.bad_means`);
5. where the round bounds an update (``dp-clip``, ``max-update-norm`` or, in a secure
   run without either, ``secure-update-bound`` times the initial model's norm:
   :func:`common.update_bound.round_bound`), the decoded mean update is no longer than
   that bound B, nor than the clients' own reported norms allow (:func:`bad_mean_update`):
   a weighted mean of updates each within B of the global model lies within B of it,
   whatever their weights, and within the weighted mean of their norms, which is at
   most K max_k n_k / sum_k n_k times the mean of the norms the clients report in the
   tail's last slot (each over B, in [0, 1]).

The clients send their updates (trained minus received arrays), not their weights, and
the quantizer's range c follows the run's bound (:func:`common.update_bound.
quantizer_range`), so check 2 bounds every coordinate by what a bounded update can hold
and check 5 bounds the whole: one client can move the model no further than a round of
bounded updates could, whatever it puts inside its mask (docs/PRIVACY.md, "One
client's pull on the secure sum").

A sum that breaks one is refused with the reason: the round keeps the global model,
and A(t) never reaches the prestopping rule. Who broke it one sum cannot tell (that is
what the masks hide); the next rounds' sums over smaller groups do
(:mod:`.culprit_search`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays

from common.config import RunConfig
from common.messages import FitReply
from common.secure_means import SUMMED_KEYS, UPDATE_RATIO, bad_means, decode_tail
from common.update_bound import rounding_slack, secure_range

from .plan import RoundPlan

TARGET_RANGE = 2**22  # Flower's quantization range (the default SecureRound keeps)


def weight_factor(num_examples: int, max_weight: float) -> int:
    """q_k: the weight factor Flower's SecAgg+ client puts into its masked vector."""
    return round(num_examples / max_weight * TARGET_RANGE)


def check_secure_sum(arrays: list[np.ndarray], weight_total: int | None, counts: list[int],
                     max_weight: float, clipping_range: float) -> str | None:
    """Why the decoded sum ``arrays`` (the weights, then the tail) of the clients with
    clear sample ``counts``, whose weight total was ``weight_total``, cannot be an
    honest one (module docstring), or None."""
    k, c = len(counts), clipping_range
    if weight_total is None:
        return "the sum's weight total was not read"
    expected = sum(n / max_weight * TARGET_RANGE for n in counts)
    if not abs(weight_total - expected) <= k / 2 + 1e-6:
        return (f"the sum's weights add up to {weight_total * max_weight / TARGET_RANGE:.6g} "
                f"samples, but its {k} clients declared {sum(counts)}: a weight was changed "
                "inside the mask, or a vector masked with another seed than its client "
                "shared")
    if not all(np.isfinite(a).all() for a in arrays):
        return "the decoded sum holds NaN or Inf"
    bound = k * c * TARGET_RANGE / weight_total
    for i, a in enumerate(arrays):
        top = float(np.max(np.abs(a))) if a.size else 0.0
        if top > bound * (1 + 1e-9):
            return (f"array {i} of the decoded sum holds {top:.6g}, beyond the ±{bound:.6g} "
                    f"that {k} clipped updates can add up to: a vector was not masked honestly")
    tail = arrays[-1]
    clients = float(tail[0]) * weight_total / TARGET_RANGE / (c / 2)
    honest = sum(weight_factor(n, max_weight) / TARGET_RANGE * max_weight / n for n in counts)
    if not abs(clients - honest) <= 4 * k / TARGET_RANGE + 1e-9 * k:
        return (f"the tail's count slot sums to {clients:.6g} clients, not the {honest:.6g} "
                f"of the {k} in the sum: a tail was not encoded honestly")
    return bad_means(decode_tail(tail))


def bad_mean_update(mean: list[np.ndarray], reference: list[np.ndarray], max_norm: float,
                    norm_key: str, clients: int, weight_total: int,
                    clipping_range: float, reported: float | None = None) -> str | None:
    """Why the decoded mean update ``mean`` (of the float arrays of the global model
    ``reference``) is longer than ``max_norm``, the bound ``norm_key`` sets for every
    update, or than ``reported``, the longest its clients' reported norms allow (module
    docstring, check 5), or None. Allowed for: the clients' float32 rounding (as a plain
    update's, :func:`common.update_bound.rounding_slack`, of the weights' norm) and the
    quantizer, whose stochastic rounding moves each of the ``clients`` weighted values by
    less than a step 2c / 2^22, so each coordinate of the mean by less than clients x 2c
    / weight_total, and the mean's norm by that times the square root of its size."""
    floats = [(m, r) for m, r in zip(mean, reference) if r.dtype.kind == "f"]
    norm = float(np.sqrt(sum(float(np.sum(m.astype(np.float64) ** 2)) for m, _ in floats)))
    size = float(np.sqrt(sum(float(np.sum(r.astype(np.float64) ** 2)) for _, r in floats)))
    coords = sum(m.size for m, _ in floats)
    quantizer = clients * 2 * clipping_range / weight_total * np.sqrt(coords)
    slack = rounding_slack(max_norm, size + max_norm) + quantizer
    if reported is not None and reported < max_norm and not norm <= reported + slack:
        return (f"the decoded mean update has norm {norm:.6g}, above {reported:.6g}, the "
                f"longest its {clients} clients' reported update norms allow (the bound "
                f"{max_norm:.6g} that {norm_key} sets): a client's update is longer than it "
                "reports, from inside its mask")
    if not norm <= max_norm + slack:  # also a norm that overflowed to inf
        return (f"the decoded mean update has norm {norm:.6g}, above {max_norm:.6g}, the "
                f"bound {norm_key} sets for every update: a client moved the model further "
                "than a bounded update can from inside its mask")
    return None


def group_accuracy(values: list[float], clients: list[int], aggregation: str) -> float:
    """A(t) from the groups' mean accuracies ``values`` (of ``clients`` clients each):
    their median with ``accuracy-aggregation = median``, else the mean over all the
    clients (each group's mean weighted by its clients: paper eq. (2))."""
    if aggregation == "median":
        return float(np.median(values))
    return float(np.average(values, weights=clients))


def pull_bound(values: list[float], clients: list[int], aggregation: str) -> float:
    """How far one client could move this round's A(t): a client controls its own
    group's mean accuracy anywhere in [0, 1] (the sum's checks bound nothing finer) and
    nothing of another group's, and A(t) does not decrease as one group's mean grows, so
    the bound is the largest, over the groups, of A(t) with that group's mean at 1
    minus A(t) with it at 0. One group (``secure-groups = 1``): 1; the mean of G groups:
    the largest group's share of the clients; their median: the spread between the
    other groups' means around the median."""
    def at(g: int, value: float) -> float:
        return group_accuracy([*values[:g], value, *values[g + 1:]], clients, aggregation)

    return max(at(g, 1.0) - at(g, 0.0) for g in range(len(values)))


def group_means(groups: list[tuple[dict[str, float], int]], aggregation: str,
                accuracy: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """(the means of the summed metrics over the groups ``(means, clients)`` whose sums
    were applied, the round record's fields). The accuracy is :func:`group_accuracy`,
    every other metric the mean over all the clients. Where the round's replies carry
    an accuracy (``accuracy``), the record has ``A_pull_bound`` (:func:`pull_bound`) and,
    with more than one group, each group's mean accuracy (``A_groups``): what the server
    learnt, and how far one client could have moved A(t)."""
    clients = [k for _, k in groups]
    means: dict[str, float] = {}
    for key in SUMMED_KEYS:
        values = [m[key] for m, _ in groups if key in m]
        if len(values) == len(groups):
            means[key] = (group_accuracy(values, clients, aggregation)
                          if key == FitReply.ACCURACY
                          else float(np.average(values, weights=clients)))
    fields: dict[str, Any] = {}
    if accuracy and FitReply.ACCURACY in means:
        values = [m[FitReply.ACCURACY] for m, _ in groups]
        if len(groups) > 1:
            fields["A_groups"] = values
        fields["A_pull_bound"] = pull_bound(values, clients, aggregation)
    return means, fields


# -- decoding a round's sums ----------------------------------------------------------------
@dataclass(frozen=True)
class SecureSum:
    """What Flower's SecAgg+ workflow decoded (docs/PRIVACY.md): its weighted mean
    ``parameters`` (the clients' updates, then the tail) and ``weight_total``, the sum's
    weight factor slot Q (None if it was not read), over the clients of
    ``partitions``."""

    parameters: Parameters
    weight_total: int | None
    partitions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decoded:
    """A secure round's sums decoded: the new parameters (None: refused), the means of the
    summed metrics, why every sum was refused (or None), the record's fields about the
    groups and A(t)'s pull bound, and the partitions whose sums were applied."""

    parameters: Parameters | None
    means: dict[str, float]
    refused: str | None
    fields: dict[str, Any]
    partitions: frozenset[int]


def decode_sum(summed: SecureSum, plan: RoundPlan, counts: list[int], cfg: RunConfig
               ) -> tuple[list[np.ndarray] | None, dict[str, float], str | None]:
    """(SecAgg+'s weighted mean of the clients' updates; the means of the summed metrics,
    :mod:`common.secure_means`; None) for a sum of clients with clear sample ``counts``
    that passes :func:`check_secure_sum` and, where the run bounds an update,
    :func:`bad_mean_update`; else (None, {}, the reason)."""
    arrays, c = parameters_to_ndarrays(summed.parameters), secure_range(cfg)
    reason = check_secure_sum(arrays, summed.weight_total, counts,
                              float(plan.weight_bound), c)
    *update, tail = arrays
    expected = plan.expected
    if reason is None and expected.max_norm is not None:
        ratio = decode_tail(tail)[UPDATE_RATIO]
        reported = expected.max_norm * ratio * len(counts) * max(counts) / sum(counts)
        reason = bad_mean_update(update, parameters_to_ndarrays(plan.sent),
                                 expected.max_norm, expected.norm_key, len(counts),
                                 summed.weight_total, c, reported)
    return (None, {}, reason) if reason else (update, decode_tail(tail), None)


def decode_sums(sums: list[SecureSum], plan: RoundPlan, accepted: list[tuple[Any, FitRes]],
                cfg: RunConfig, asks_accuracy: bool) -> Decoded:
    """The round's new weights: the global model the round sent plus the mean update of
    the groups whose sums pass their checks (:func:`decode_sum`), each weighted by its
    weight total (so one group gives SecAgg+'s weighted mean, and several give the mean
    over all their clients), in the global model's dtypes; A(t) and the other means from
    the groups' (:func:`group_means`; ``asks_accuracy``: the round's replies carry A_k)."""
    counts = {int(res.metrics[FitReply.PARTITION_ID]): int(res.num_examples)
              for _, res in accepted}
    kept, refused = [], []
    for summed in sums:
        update, means, reason = decode_sum(summed, plan,
                                           [counts[p] for p in summed.partitions], cfg)
        if reason:
            refused.append({"partitions": list(summed.partitions), "reason": reason})
        else:
            kept.append((summed, update, means))
    fields: dict[str, Any] = {"refused_groups": refused} if len(sums) > 1 else {}
    if not kept:
        return Decoded(None, {}, "; ".join(r["reason"] for r in refused), fields,
                       frozenset())
    total = sum(summed.weight_total for summed, _, _ in kept)
    mean = [sum(summed.weight_total * update[i] for summed, update, _ in kept) / total
            for i in range(len(kept[0][1]))]
    weights = [np.rint(g + u).astype(dt) if dt.kind in "iu" else (g + u).astype(dt)
               for g, u, dt in zip(parameters_to_ndarrays(plan.sent), mean,
                                   plan.expected.dtypes)]
    means, group_fields = group_means(
        [(m, len(summed.partitions)) for summed, _, m in kept], cfg.accuracy_aggregation,
        asks_accuracy)
    if plan.expected.max_norm is not None:  # the round's bound and its clients' norms
        fields.update(update_bound=plan.expected.max_norm,
                      update_ratio=means.get(UPDATE_RATIO))
    return Decoded(ndarrays_to_parameters(weights), means, None, {**fields, **group_fields},
                   frozenset(p for summed, _, _ in kept for p in summed.partitions))
