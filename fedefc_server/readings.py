"""What the server reads off a round's replies for FedEFC's rules: the clients' mean
accuracies, the sizes of the shares they read on, and the phase-2 guard's reading of the
model the run would deliver, with its standard error (docs/FEDEFC.md §3.1-§3.4, §3.8,
§3.9). Plain functions of the aggregated round; the server hooks call them."""

from __future__ import annotations

from common.config import RunConfig
from common.messages import FitReply
from common.sample_roles import share_count

from .accuracy import aggregate_accuracy
from .clean_set import CleanSet
from .evaluation import TestSetEvaluator
from .guard import Reading, clean_reading
from .method_server import Aggregated
from .prestopping import accuracy_standard_error


def client_mean(result: Aggregated, key: str, cfg: RunConfig
                ) -> tuple[list[float] | None, float | None]:
    """(each client's ``key``, their mean by ``accuracy-aggregation``, paper eq. (2));
    under secure aggregation only the mean reached the server (docs/PRIVACY.md)."""
    if result.secure:
        return None, result.secure_means.get(key)
    values = [float(res.metrics[key]) for _, res in result.replies]
    return values, aggregate_accuracy(values, cfg.accuracy_aggregation, cfg.trim_fraction)


def share_sizes(result: Aggregated, cfg: RunConfig, num_classes: int) -> list[int]:
    """The replying clients' validation shares, in samples, which their sample counts
    fix (:func:`common.sample_roles.share_count`)."""
    return [share_count(cfg, res.num_examples, num_classes)
            for _, res in result.replies if res.num_examples > 1]


def guard_reading(result: Aggregated, a_t: float, cfg: RunConfig, num_classes: int,
                  clean: tuple[TestSetEvaluator, CleanSet] | None) -> Reading:
    """The guard's reading of the model round ``result.round`` received, with its
    standard error: on the coordinator's clean set (the server's own evaluation), else
    the clients' mean reading of it on data it never trained on: the twin's guard slices
    where the run delivers a twin (half of each share), else A(t) on the shares."""
    if clean is not None and result.received is not None:
        return clean_reading(clean, result.received, cfg.twinned)
    shares = share_sizes(result, cfg, num_classes)
    if not cfg.twinned:
        return Reading(a_t, accuracy_standard_error(a_t, shares))
    reading = client_mean(result, FitReply.GUARD_ACCURACY, cfg)[1]
    reading = a_t if reading is None else reading
    return Reading(reading, accuracy_standard_error(reading, [(n + 1) // 2 for n in shares]))
