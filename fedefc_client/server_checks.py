"""What a node checks of the server's messages: it trusts only what it signed for
(docs/THREAT-MODEL.md, "A dishonest server and the node").

The run config reaches a node with the app (signed by the coordinator in a deployment,
docs/DEPLOYMENT.md); a message's content is the ServerApp's, written at run time. So a
node takes every privacy parameter from the run config and its own policy, and refuses
a message that asks for something else (:func:`.mods.server_checks_mod`):

- a training message whose ``clipping_norm`` (Flower's DP key) is not the run's
  ``dp-clip``: the node clips with ``dp-clip`` whatever a message says, and a server
  that sends another bound deviates from the run;
- a SecAgg+ setup whose numbers are not the run's: fewer clients than
  ``min-secure-clients`` (or the policy's own ``min-secure-clients``) or more than the
  run's clients per round, a share count or threshold other than what ``num-shares``
  and ``reconstruction-threshold`` give for that many clients
  (:func:`common.config.secagg_shares`), a threshold that is no strict majority of the
  holders, another quantizer (clipping range, grid, modulus) than the run's, another
  ``max_weight`` than the run's M (:func:`common.data_plan.secure_weight`), or a field
  Flower's setup does not have. Only the round's sample size varies from round to
  round (a round starts again without the nodes it refused); every other field is a
  function of the run config. ``max_weight`` matters most: a server that sent 10^12 to
  every node but one had the others' weight factors round to 0, and the ordinary
  unmask stage gave it that node's update alone;
- a training message whose tail scale (:data:`common.secure_means.SCALE_KEY`) is not
  the one the run's clipping range and M give;
- a SecAgg+ unmask request that names one node both active and dropped: the node would
  send both the share of its mask seed and the share of its pairwise key, and a
  threshold of such replies rebuilds both secrets of that node (Flower's client sends
  both).

Each reason names the value the message carried, the run's (or the policy's) value and
what the server should have sent.
"""

from __future__ import annotations

from typing import Any

from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import SECAGG_MAX_CLIENTS, RunConfig, is_strict_majority, secagg_shares
from common.secure_means import SCALE_KEY, tail_scale

from .policy import NodePolicy

TARGET_RANGE = 2**22  # the quantization grid and modulus the project's server uses
MOD_RANGE = 2**32     # (Flower's SecAggPlusWorkflow defaults, kept by SecureRound)
SETUP_KEYS = frozenset({Key.STAGE, Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD,
                        Key.CLIPPING_RANGE, Key.TARGET_RANGE, Key.MOD_RANGE, Key.MAX_WEIGHT})


def bad_clipping_norm(config: dict[str, Any], cfg: RunConfig) -> str | None:
    """Why a training message's fit ``config`` asks for another DP clipping norm than
    the run's ``dp-clip``, or None (no ``clipping_norm``, or the run's)."""
    if KEY_CLIPPING_NORM not in config:
        return None
    sent = config[KEY_CLIPPING_NORM]
    if isinstance(sent, (int, float)) and not isinstance(sent, bool) and sent == cfg.dp_clip:
        return None
    return (f"the server sent {KEY_CLIPPING_NORM}={sent!r}, but the run's signed dp-clip is "
            f"{cfg.dp_clip:g}: this node clips with dp-clip only; a server that sends "
            f"another bound deviates from the run (it should send {cfg.dp_clip:g})")


def min_clients(cfg: RunConfig, policy: NodePolicy | None) -> tuple[int, str]:
    """The fewest clients a secure round of this node may sum, and the key that sets it
    (the run's ``min-secure-clients``, or the policy's when larger)."""
    if policy is not None and policy.min_secure_clients > cfg.min_secure_clients:
        return policy.min_secure_clients, "this node's policy's min-secure-clients"
    return cfg.min_secure_clients, "the run's min-secure-clients"


def bad_tail_scale(config: dict[str, Any], clipping_range: float, max_weight: int
                   ) -> str | None:
    """Why a secure training message's fit ``config`` carries another tail scale than
    the run's clipping range and M give, or None (no scale: not a secure round's)."""
    if SCALE_KEY not in config:
        return None
    want, sent = tail_scale(clipping_range, max_weight), config[SCALE_KEY]
    if isinstance(sent, float) and sent == want:
        return None
    return (f"the server sent {SCALE_KEY}={sent!r}, but the run's clipping range "
            f"{clipping_range:g} and max_weight {max_weight} give {want!r}")


def bad_setup(config: dict[str, Any], cfg: RunConfig, policy: NodePolicy | None,
              clipping_range: float, max_weight: int) -> str | None:
    """Why a SecAgg+ setup request ``config`` breaks the run or the node's policy, or
    None; ``clipping_range`` is the quantizer range the run gives its rounds,
    ``max_weight`` its M (:func:`common.data_plan.secure_weight`)."""
    unknown = sorted(set(config) - SETUP_KEYS)
    if unknown:
        return (f"the SecAgg+ setup carries field(s) {unknown[:3]} that Flower's setup does "
                f"not have; an honest server sends {sorted(SETUP_KEYS - {Key.STAGE})} only")
    try:
        clients, shares = int(config[Key.SAMPLE_NUMBER]), int(config[Key.SHARE_NUMBER])
        threshold = int(config[Key.THRESHOLD])
    except (KeyError, TypeError, ValueError):
        return "a SecAgg+ setup without its sample size, share count and threshold"
    fewest, key = min_clients(cfg, policy)
    if clients < fewest:
        return (f"the SecAgg+ setup sums {clients} client(s), below {key}={fewest}: a sum "
                f"of so few updates tells each of them to the server; a server must sample "
                f"at least {fewest}")
    if clients > min(cfg.clients_per_round, SECAGG_MAX_CLIENTS):
        return (f"the SecAgg+ setup sums {clients} clients, above the run's "
                f"{min(cfg.clients_per_round, SECAGG_MAX_CLIENTS)} clients per round "
                "(num-clients x fraction)")
    want = secagg_shares(cfg.num_shares, cfg.reconstruction_threshold, clients)
    if (shares, threshold) != want or not is_strict_majority(threshold, shares, clients):
        return (f"the SecAgg+ setup has {shares} share(s) and a threshold of {threshold} for "
                f"{clients} clients, but the run's num-shares={cfg.num_shares} and "
                f"reconstruction-threshold={cfg.reconstruction_threshold} give {want[0]} "
                f"shares and a threshold of {want[1]} (a strict majority of the holders: "
                "fewer would let a server rebuild both secrets of a client and unmask it)")
    quantizer = (config.get(Key.CLIPPING_RANGE), config.get(Key.TARGET_RANGE),
                 config.get(Key.MOD_RANGE))
    if quantizer != (clipping_range, TARGET_RANGE, MOD_RANGE):
        return (f"the SecAgg+ setup's quantizer (clipping range, grid, modulus) is "
                f"{quantizer}, not the run's ({clipping_range}, {TARGET_RANGE}, {MOD_RANGE})")
    sent = config.get(Key.MAX_WEIGHT)
    if not (isinstance(sent, float) and sent == float(max_weight)):
        return (f"the SecAgg+ setup's {Key.MAX_WEIGHT} is {sent!r}, but the run's is "
                f"{float(max_weight)!r} (max-client-samples, or the data plan's largest "
                "partition): every node of a sum must weigh its update by the same bound, "
                "or the others' weights can be made to vanish and one update unmasked alone")
    return None


def bad_unmask(config: dict[str, Any]) -> str | None:
    """Why a SecAgg+ unmask request asks for both secrets of one node, or None."""
    active = set(config.get(Key.ACTIVE_NODE_ID_LIST, []))
    both = sorted(active & set(config.get(Key.DEAD_NODE_ID_LIST, [])))
    if both:
        return (f"the SecAgg+ unmask request names node(s) {both[:3]} both active and "
                "dropped: this node would send the shares of both their secrets, which "
                "unmasks their updates; an honest server names each node once")
    return None


def bad_secagg_request(config: dict[str, Any], cfg: RunConfig, policy: NodePolicy | None,
                       clipping_range: float, max_weight: int) -> str | None:
    """Why a SecAgg+ request (its ``secaggplus_configs`` record) breaks the run or the
    node's policy, or None."""
    stage = config.get(Key.STAGE)
    if stage == Stage.SETUP:
        return bad_setup(config, cfg, policy, clipping_range, max_weight)
    if stage == Stage.UNMASK:
        return bad_unmask(config)
    return None
