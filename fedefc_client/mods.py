"""The ClientApp's mods of the run: the server's requests checked, secure aggregation and
differential privacy (docs/PRIVACY.md); the node's own checks before them (the error
reply, the audit, the policy, the node's identity) are :data:`.client_app.NODE_MODS`.
Flower fixes a ClientApp's mods when the app is built, so each mod reads the run config
(and the node config) and steps aside when its key is off.

Order (outermost first; a reply passes them from the inside out): the node's own
checks (:data:`.client_app.NODE_MODS`), which import no torch and nothing of the
run's training,

1. :func:`.error_reply.error_reply_mod`: an exception becomes an error reply whose text
   is scrubbed of paths and node-config values (:mod:`.scrub`);
2. :func:`.audit.audit_mod`: records what leaves the client (``audit = true``, or the
   node policy's ``audit-dir``);
3. :func:`.policy.policy_mod`: refuses a run that breaks the node's policy;
4. :func:`.node.identity_mod`: refuses a run whose ``num-clients`` does not fit the
   node's ``partition-id`` and ``num-partitions``;

then the run's mods, :data:`MODS`:

5. :func:`server_checks_mod`: refuses a message that asks for other privacy parameters
   than the run's and the policy's (:mod:`.server_checks`);
6. :func:`secure_aggregation_mod`: Flower's ``secaggplus_mod`` (``secure-aggregation``),
   its masks drawn from :mod:`common.secure_prf`, its shares verifiable
   (:mod:`common.verifiable_shares`, :mod:`.share_holder`);
7. :func:`secure_tail_mod`: moves the summed metrics into the arrays and keeps only
   :func:`common.secure_means.clear_metrics` in the clear (secure rounds);
8. :func:`noise_mod`: Gaussian noise on the clipped weights (``dp-noise-multiplier``),
   counted in the node's privacy ledger (:class:`.audit.DpLedger`);
9. :func:`clipping_mod`: client-side fixed clipping to the run's ``dp-clip``, as
   Flower's ``fixedclipping_mod``.

So the update is clipped, then noised, then (with its tail) quantized and masked, and
the audit sees the message as the server will.
"""

from __future__ import annotations

import math
from logging import WARNING

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import compute_clip_model_update, get_norm

from common import secure_prf, verifiable_shares
from common.config import RunConfig
from common.data_plan import data_plan, secure_weight
from common.messages import FitConfig
from common.methods import load_run_config
from common.secure_means import SCALE_KEY, UPDATE_RATIO, clear_metrics, encode_tail
from common.seeds import derive_seed
from common.update_bound import (
    BOUND_KEY,
    RELATIVE_KEY,
    float_norms,
    round_bound,
    rounding_slack,
    secure_range,
)
from common.verifiable_shares import COMMITMENTS, dealing

from .audit import DpLedger
from .node import partition_of
from .policy import node_policy, refuse
from .server_checks import bad_clipping_norm, bad_secagg_request, bad_tail_scale
from .share_holder import complaint_reply, dealt_share_complaints, holders_of, signed_deal

secure_prf.install()  # SecAgg+'s masks from a full-entropy PRF (flwr#7522)
verifiable_shares.install()  # SecAgg+'s shares with Feldman's commitments


class UnmaskableUpdate(ValueError):
    """A trained update a secure round cannot mask: the project's own error, so its text
    reaches the server as written (fedefc_client/scrub.py)."""


def _config(ctxt: Context) -> RunConfig:
    """The run config, validated once per process and run (:func:`load_run_config`)."""
    return load_run_config(ctxt.run_config)


def server_checks_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Refuse a training message that asks for other privacy parameters than the run's
    and the node policy's (:mod:`.server_checks`): a DP clipping norm other than
    ``dp-clip``, a SecAgg+ setup other than the run config's (below the policy's
    minimum, or with another M: :func:`run_secure_weight`) or a tail scale other than
    the run's, an unmask request for both secrets of a node. The reply is an error
    naming the value, the run's value and what an honest server sends; nothing of the
    message is run."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    cfg, records = _config(ctxt), msg.content.config_records
    reason = None
    if "fitins.config" in records:
        reason = bad_clipping_norm(dict(records["fitins.config"]), cfg)
    if reason is None and cfg.secure_aggregation and RECORD_KEY_CONFIGS in records:
        try:
            weight = run_secure_weight(cfg)
        except Exception as err:  # the run's data plan cannot be built on this node
            reason = (f"this node cannot derive the run's secure weight bound M "
                      f"({type(err).__name__}: the data plan's largest partition); the run "
                      "must set max-client-samples")
        else:
            fit = dict(records.get("fitins.config", {}))
            reason = (bad_secagg_request(dict(records[RECORD_KEY_CONFIGS]), cfg,
                                         node_policy(ctxt), secure_range(cfg), weight)
                      or bad_tail_scale(fit, secure_range(cfg), weight))
    if reason is None:
        return call_next(msg, ctxt)
    return refuse(msg, ctxt, "this node refuses the message: " + reason)


def run_secure_weight(cfg: RunConfig) -> int | None:
    """M of the run (:func:`common.data_plan.secure_weight`), as this node derives it
    from the run config: ``max-client-samples``, else the data plan's largest partition
    (the plan every node of the run's dataset builds anyway, cached per process)."""
    return secure_weight(cfg, None if cfg.max_client_samples else data_plan(cfg))


def secure_aggregation_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ client (``secaggplus_mod``) when ``secure-aggregation = true``,
    with verifiable shares (:mod:`.share_holder`): in the share-keys stage its shares
    are dealt to the request's nodes with commitments, sent with them and signed; in the collect
    stage the shares it was dealt are checked against the relayed commitments first,
    and a failing dealer answered with complaints instead of a masked vector."""
    if not _config(ctxt).secure_aggregation or msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    config = msg.content.config_records.get(RECORD_KEY_CONFIGS, ConfigRecord())
    stage = config.get(Key.STAGE)
    if stage == Stage.SHARE_KEYS:
        with dealing(holders_of(config)) as commitments:
            out = secaggplus_mod(msg, ctxt, call_next)
        if not out.has_error():
            signed_deal(out.content.config_records[RECORD_KEY_CONFIGS], commitments, ctxt)
        return out
    if stage == Stage.COLLECT_MASKED_VECTORS:
        complaints = dealt_share_complaints(config, ctxt)
        if isinstance(complaints, str):
            return refuse(msg, ctxt, "this node refuses the message: " + complaints)
        if complaints:
            log(WARNING, "run %s: dealt SecAgg+ shares fail their commitments: %s",
                ctxt.run_id, "; ".join(f"node {src}: {why}" for src, _, _, why in complaints))
            return complaint_reply(msg, complaints)
        del config[COMMITMENTS]
    return secaggplus_mod(msg, ctxt, call_next)


def secure_tail_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """In a secure round's training message: replace the reply's arrays by the update
    (trained minus received, in float64: what SecAgg+ sums, in the quantizer range the
    run's update bound sets, :func:`common.update_bound.quantizer_range`), append the
    tail of the summed metrics, and keep in its clear metrics only what
    :func:`common.secure_means.clear_metrics` allows (the partition id, the loss's name;
    the simulation's diagnostics when the run asks for them): no other per-client value
    leaves the node in the clear (docs/PRIVACY.md, "What leaves a node"). The tail also
    holds the update's norm over the round's bound B
    (:func:`update_bound`), which the server checks the decoded mean update against.
    Under the default bound (``secure-update-bound`` times the initial model's norm, sent
    by the server) a longer update is clipped to B; an update longer than a bound the run
    declares (an honest client's can be, with ``max-update-norm`` alone) is not sent:
    the client fails, a dropout, as a plain round would refuse it.

    Flower's quantizer rounds stochastically with NumPy's global generator; it is seeded
    here, right before it runs, from (seed, partition, round), so a secure run stays a
    pure function of its config (the rounding hides nothing; the masks do)."""
    cfg = _config(ctxt)
    if not cfg.secure_aggregation or msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = fitins.config
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    fitres = compat.recorddict_to_fitres(out.content, keep_input=True)
    arrays = parameters_to_ndarrays(fitres.parameters)
    received = parameters_to_ndarrays(fitins.parameters)
    if not all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f"):
        raise UnmaskableUpdate("the trained weights hold NaN or Inf; a masked vector cannot "
                               "carry them (the server could not detect them in the sum)")
    matches = [a.shape for a in arrays] == [r.shape for r in received]
    max_norm, key = update_bound(cfg, fitins)
    norm, size = float_norms(arrays, received) if matches else (0.0, 0.0)
    update = ([a.astype(np.float64) - r for a, r in zip(arrays, received)] if matches
              else arrays)  # not the model's arrays: the server's screen refuses them
    if key == RELATIVE_KEY and norm > max_norm:  # the default bound: clipped to it
        update = [u * (max_norm / norm) if r.dtype.kind == "f" else u
                  for u, r in zip(update, received)]
        norm = max_norm
    elif max_norm is not None and not norm <= max_norm + rounding_slack(max_norm, size):
        raise ValueError(f"the update's norm {norm:.6g} is above {max_norm:.6g}, the bound "
                         f"{key} sets: the server refuses such an update in a plain round, "
                         "and a masked one would break the round's bound check")
    scale, pid = float(config[SCALE_KEY]), partition_of(ctxt, cfg.num_clients)
    rnd = int(config[FitConfig.ROUND])
    ratio = min(norm / max_norm, 1.0) if max_norm else 0.0
    tail, clear = encode_tail({**fitres.metrics, UPDATE_RATIO: ratio}, fitres.num_examples,
                              scale)
    fitres.metrics = clear_metrics(clear, cfg.diagnostics)
    fitres.parameters = ndarrays_to_parameters([*update, tail])
    out.content = compat.fitres_to_recorddict(fitres, keep_input=True)
    np.random.seed(derive_seed(cfg.seed, "secagg-rounding", pid, rnd) % 2**32)
    return out


def update_bound(cfg: RunConfig, fitins) -> tuple[float | None, str]:
    """(B, the key that sets it): the bound of one update in the round of the training
    message ``fitins`` (:func:`common.update_bound.round_bound`). A secure run's default
    bound scales the initial model's norm, which the server measured and sends
    (:data:`common.update_bound.BOUND_KEY`; none without it, as for an initial model of
    norm 0); a bound the run's keys set is the node's own computation."""
    bound, key = round_bound(cfg, parameters_to_ndarrays(fitins.parameters), 1.0)
    sent = fitins.config.get(BOUND_KEY)
    if key != RELATIVE_KEY or sent is None:  # none: an initial model of norm 0 has none
        return (bound, key) if key != RELATIVE_KEY else (None, "")
    if isinstance(sent, bool) or not isinstance(sent, (int, float)) or not 0 < sent < math.inf:
        raise ValueError(f"the server sent {BOUND_KEY}={sent!r}: a secure round under "
                         f"{RELATIVE_KEY} needs the run's bound, a positive number")
    return float(sent), key


def clipping_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Client-side fixed clipping when ``dp-clip > 0``: the update (trained minus received
    float weights) is scaled to L2 norm at most the run's ``dp-clip``, never a norm a
    message carries (Flower's DifferentialPrivacyClientSideFixedClipping sends one as
    ``clipping_norm``; :func:`server_checks_mod` refuses a message whose value is not the
    run's). The clipping function is Flower's ``fixedclipping_mod``'s. Integer arrays
    (BatchNorm's batch counters) are left as they are: Flower's mod scales them in place
    and fails."""
    norm = _config(ctxt).dp_clip
    if norm <= 0 or msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    fitres = compat.recorddict_to_fitres(out.content, keep_input=True)
    trained = parameters_to_ndarrays(fitres.parameters)
    floats = [i for i, a in enumerate(trained) if a.dtype.kind == "f"]
    received = parameters_to_ndarrays(fitins.parameters)
    clipped = [trained[i] for i in floats]
    update = [trained[i] - received[i] for i in floats]
    if get_norm(update) == 0.0:  # nothing to clip (a model that did not move, e.g. dead
        return out               # ReLUs); Flower's clipping divides by the norm
    compute_clip_model_update(clipped, [received[i] for i in floats], norm)
    for i, array in zip(floats, clipped):
        trained[i] = array
    fitres.parameters = ndarrays_to_parameters(trained)
    out.content = compat.fitres_to_recorddict(fitres, keep_input=True)
    return out


def noise_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Add N(0, (z C)^2) to every float weight of a training reply, z =
    ``dp-noise-multiplier``, C = ``dp-clip`` (docs/PRIVACY.md, "Differential privacy"),
    and count the release in the node's :class:`DpLedger`. With a node policy's
    ``max-epsilon`` the node refuses a training message whose release would take the
    ledger's epsilon above it: the bound holds over the releases the node actually made,
    at the noise it actually applied, however many training messages a server sends.

    The noise comes from the operating system's entropy, not from the run's seed: noise
    that the server could regenerate from the seed would protect nothing. A run with
    noise is therefore not bit-reproducible."""
    cfg = _config(ctxt)
    if cfg.dp_noise_multiplier <= 0 or msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    policy = node_policy(ctxt)
    clip, std = cfg.dp_clip, cfg.dp_noise_multiplier * cfg.dp_clip
    delta = policy.dp_delta if policy is not None else cfg.dp_delta
    ledger = DpLedger.of(ctxt)
    after = ledger.released(clip, std, delta)
    if policy is not None and policy.max_epsilon and after.epsilon > policy.max_epsilon:
        return refuse(msg, ctxt, (
            f"this node refuses the message: it has released {ledger.releases} noised "
            f"update(s) in this run (noise multiplier {std / clip:g}); one more gives "
            f"epsilon={after.epsilon:.4g} at delta={delta:g}, above this node's max-epsilon "
            f"{policy.max_epsilon:g}"))
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    fitres = compat.recorddict_to_fitres(out.content, keep_input=True)
    rng = np.random.default_rng()
    fitres.parameters = ndarrays_to_parameters([
        a + rng.normal(0.0, std, a.shape).astype(a.dtype) if a.dtype.kind == "f" else a
        for a in parameters_to_ndarrays(fitres.parameters)])
    out.content = compat.fitres_to_recorddict(fitres, keep_input=True)
    after.save(ctxt)
    return out


MODS = [server_checks_mod, secure_aggregation_mod, secure_tail_mod, noise_mod, clipping_mod]
