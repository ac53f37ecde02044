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
  ``min-secure-clients`` (or the policy's own ``min-secure-clients``), a share count or
  threshold other than what ``num-shares`` and ``reconstruction-threshold`` give for
  that many clients (:func:`common.config.secagg_shares`), a threshold that is no strict
  majority of the holders, or another quantizer (clipping range, grid, modulus) than the
  run's;
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

from .policy import NodePolicy

TARGET_RANGE = 2**22  # the quantization grid and modulus the project's server uses
MOD_RANGE = 2**32     # (Flower's SecAggPlusWorkflow defaults, kept by SecureRound)


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


def bad_setup(config: dict[str, Any], cfg: RunConfig, policy: NodePolicy | None,
              clipping_range: float) -> str | None:
    """Why a SecAgg+ setup request ``config`` breaks the run or the node's policy, or
    None; ``clipping_range`` is the quantizer range the run gives its rounds."""
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
    if clients > SECAGG_MAX_CLIENTS:
        return (f"the SecAgg+ setup sums {clients} clients, above {SECAGG_MAX_CLIENTS}: the "
                "quantized sum would overflow")
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
                       clipping_range: float) -> str | None:
    """Why a SecAgg+ request (its ``secaggplus_configs`` record) breaks the run or the
    node's policy, or None."""
    stage = config.get(Key.STAGE)
    if stage == Stage.SETUP:
        return bad_setup(config, cfg, policy, clipping_range)
    if stage == Stage.UNMASK:
        return bad_unmask(config)
    return None
