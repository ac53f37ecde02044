"""The bound a run declares on one client's update, and the quantizer range of its
secure rounds (docs/PRIVACY.md, "Weights bound to facts" and "One client's pull on the
secure sum").

An update is a reply's float arrays minus the global model's. ``dp-clip`` C makes every
honest client clip it to L2 norm C; ``dp-noise-multiplier`` z then adds N(0, (zC)^2) to
each of its d float weights; ``max-update-norm`` B bounds it whatever the client does.
:func:`norm_bound` is the L2 norm no honest update exceeds (the server refuses a longer
plain update, and a secure round whose decoded mean update is longer);
:func:`quantizer_range` the largest value one coordinate of an honest weighted update can
take, which is the range SecAgg+'s quantizer clips every coordinate to.

A secure run that sets neither key is bounded all the same (docs/PRIVACY.md, "One
client's pull on the secure sum"): :func:`round_bound` is then ``secure-update-bound``
rho times the norm of the INITIAL model's float weights, fixed for the run (a bound
computed from the model the round sends grew with every pull it let through: issue
58). The server sends it in every secure training message (:data:`BOUND_KEY`); every
client clips its update to it, and the server checks the decoded mean update against
it and the clients' own reported norms (``fedefc_server/secure_sum.py``). A client that
lengthens its update inside its mask without saying so is refused outright.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a type only: common.faults, which common.config imports, uses this
    from .config import RunConfig

NOISE_TAIL = 8.0  # chi_d exceeds sqrt(d) + 8 with probability below exp(-32) (< 1e-13)
COORD_TAIL = 10.0  # |N(0, 1)| exceeds 10 with probability 1.5e-23: below 1e-12 for any
#                    model of fewer than 10^10 weights


def norm_bound(dp_clip: float, dp_noise_multiplier: float, max_update_norm: float,
               float_weights: int) -> tuple[float | None, str]:
    """(the L2 bound of an update's float arrays, the keys that set it); None when
    neither key is set. ``dp-clip`` C: the client clips to C (docs/PRIVACY.md,
    "Differential privacy"); with noise of multiplier z on d weights the reply is the
    clipped update plus N(0, (zC)^2 I), whose norm is below zC (sqrt(d) + 8) but for a
    probability under 1e-13, so the bound is C (1 + z (sqrt(d) + 8)).
    ``max-update-norm`` B bounds it too (the smaller bound holds)."""
    bounds = []
    if dp_clip > 0:
        bounds.append((dp_clip * (1 + dp_noise_multiplier * (math.sqrt(float_weights)
                                                             + NOISE_TAIL)),
                       "dp-clip" if dp_noise_multiplier == 0 else
                       "dp-clip with dp-noise-multiplier"))
    if max_update_norm > 0:
        bounds.append((max_update_norm, "max-update-norm"))
    return min(bounds) if bounds else (None, "")


RELATIVE_KEY = "secure-update-bound"
BOUND_KEY = "update-bound"  # fit config of a secure round: the relative bound B


def float_size(arrays: list[np.ndarray]) -> float:
    """The L2 norm of ``arrays``' float arrays, in float64."""
    return math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays
                         if a.dtype.kind == "f"))


def round_bound(cfg: RunConfig, sent: list[np.ndarray], initial_size: float
                ) -> tuple[float | None, str]:
    """(the L2 bound of one update in a round that sends the arrays ``sent``, the key
    that sets it): :func:`norm_bound`'s where the run sets ``dp-clip`` or
    ``max-update-norm``; else, in a secure run, ``secure-update-bound`` rho times
    ``initial_size``, the norm of the initial model's float arrays (none where rho is 0
    or that model is all zeros); else None."""
    bound, key = norm_bound(cfg.dp_clip, cfg.dp_noise_multiplier, cfg.max_update_norm,
                            sum(a.size for a in sent if a.dtype.kind == "f"))
    if bound is not None or not cfg.secure_aggregation or cfg.secure_update_bound <= 0:
        return bound, key
    return ((cfg.secure_update_bound * initial_size, RELATIVE_KEY) if initial_size > 0
            else (None, ""))


def bound_text(cfg: RunConfig) -> str:
    """Which bound a run's updates have, in words (the run's summary): the keys the run
    sets (the smaller bound holds in each round, :func:`norm_bound`), else a secure run's
    default (:func:`round_bound`), else none."""
    keys = []
    if cfg.dp_clip > 0:
        keys.append(f"dp-clip = {cfg.dp_clip:g}" + (
            f" with dp-noise-multiplier = {cfg.dp_noise_multiplier:g}"
            if cfg.dp_noise_multiplier > 0 else ""))
    if cfg.max_update_norm > 0:
        keys.append(f"max-update-norm = {cfg.max_update_norm:g}")
    if keys:
        return " and ".join(keys)
    if cfg.secure_aggregation and cfg.secure_update_bound > 0:
        return (f"{RELATIVE_KEY} = {cfg.secure_update_bound:g}: each update at most "
                f"{cfg.secure_update_bound:g} x the initial model's norm, the decoded mean no "
                "longer than its clients' reported norms allow")
    return "none (secure-update-bound = 0)" if cfg.secure_aggregation else "none"


def quantizer_range(clipping_range: float, dp_clip: float, dp_noise_multiplier: float,
                    max_update_norm: float) -> float:
    """c, the range SecAgg+'s quantizer clips each coordinate of a weighted update to
    (a weight is at most 1): ``clipping-range``, or less where the run bounds an update.
    A coordinate of an update is at most its L2 norm, so ``max-update-norm`` B bounds it;
    a clipped update's coordinate is at most C, and its noise N(0, (zC)^2) exceeds
    10 zC with a probability of 1.5e-23 (:data:`COORD_TAIL`), so C (1 + 10 z) bounds it.
    The smallest of these holds."""
    bounds = [clipping_range]
    if dp_clip > 0:
        bounds.append(dp_clip * (1 + COORD_TAIL * dp_noise_multiplier))
    if max_update_norm > 0:
        bounds.append(max_update_norm)
    return min(bounds)


def float_norms(arrays: list[np.ndarray], reference: list[np.ndarray]) -> tuple[float, float]:
    """(the L2 norm of ``arrays`` minus ``reference`` over the float arrays, in float64;
    the L2 norm of ``arrays``' float arrays)."""
    pairs = [(a, r) for a, r in zip(arrays, reference) if r.dtype.kind == "f"]
    norm = math.sqrt(sum(float(np.sum((a.astype(np.float64) - r) ** 2)) for a, r in pairs))
    size = math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a, _ in pairs))
    return norm, size


def rounding_slack(max_norm: float, weights_norm: float) -> float:
    """What float32 rounding may add to a clipped update's norm: at most 2^-24 of each
    weight, so 2^-22 of the weights' norm, plus 1e-5 of the bound."""
    return 1e-5 * max_norm + 2.0**-22 * weights_norm


def secure_range(cfg: RunConfig) -> float:
    """:func:`quantizer_range` of a run: the clipping range its secure rounds use."""
    return quantizer_range(cfg.clipping_range, cfg.dp_clip, cfg.dp_noise_multiplier,
                           cfg.max_update_norm)
