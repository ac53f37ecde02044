"""What a SecAgg+ node does with verifiable shares (:mod:`common.verifiable_shares`;
docs/THREAT-MODEL.md, "A lying dealer"): it deals them with commitments, and checks
the shares it is dealt before it masks anything.

As a dealer (the share-keys stage) the node tells :func:`common.verifiable_shares.
dealing` who its holders are, in the order Flower hands its shares out, and sends its
two commitments with its encrypted shares (:func:`share_keys`). As a holder (the
collect stage, before it trains) it opens each source's encrypted shares and checks
them against the source's commitments, which the server relays to every holder
(:func:`dealt_share_complaints`). A failing dealer makes it reply with complaints
instead of its masked vector, one per dealer:

- *provable*: the shares opened (the channel key is the dealer's and the node's only,
  and Fernet authenticates them), carry the commitment the server relayed, and fail it
  (or name another node). The complaint gives the server that channel's key, so it can
  open the dealer's ciphertext it relayed and check the shares itself: a dealer whose
  shares fail is named, a node whose complaint does not hold is. The key opens shares
  that fail the dealer's own commitment only, which are not shares of its secrets.
- *unprovable*: the shares do not open, or carry another commitment than the one
  relayed. Either the dealer or the server (which relays both) did it, and a key given
  here could open valid shares, which a server that forged the relayed commitment
  for many holders could combine: the complaint gives no key.

The round then starts again (nothing was unmasked) without the dealer named, or, for
an unprovable complaint, without the dealer and the complaining node.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
)
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from common.verifiable_shares import (
    COMMITMENTS,
    COMPLAINT_KEYS,
    COMPLAINT_REASONS,
    COMPLAINTS,
    ShareError,
    commitment_degree,
    read_share,
    verify,
)


def holders_of(config: ConfigRecord) -> list[int]:
    """The node ids a share-keys request lists, in the order Flower's client deals its
    shares to them."""
    return [int(key) for key in config if key != Key.STAGE]


def dealt_share_complaints(config: ConfigRecord, ctxt: Context
                           ) -> list[tuple[int, bytes, str]] | str:
    """(dealer, the channel key or b"", why) for each source of a collect-stage request
    ``config`` whose dealt shares fail (module docstring); or why the request cannot be
    checked (no commitments relayed, a source this node shared no key with)."""
    srcs, texts = config.get(Key.SOURCE_LIST, []), config.get(Key.CIPHERTEXT_LIST, [])
    relayed = config.get(COMMITMENTS)
    if not isinstance(relayed, list) or len(relayed) != 2 * len(srcs):
        return ("the collect stage does not relay two commitments per source: this node "
                "masks nothing with shares it cannot check")
    state = SecAggPlusState(**ctxt.state.config_records[RECORD_KEY_STATE])
    complaints = []
    for i, (src, ciphertext) in enumerate(zip(srcs, texts, strict=True)):
        key = state.ss2_dict.get(src)
        if key is None:
            return f"the collect stage relays shares from node {src}, not a neighbour"
        try:
            plaintext = decrypt(key, ciphertext)
        except Exception:  # a ciphertext that does not open under the channel key
            complaints.append((src, b"", "its encrypted shares do not open"))
            continue
        complaint = _check(plaintext, src, state.nid, state.threshold, relayed[2 * i:2 * i + 2])
        if complaint is not None:
            complaints.append((src, key if complaint[0] else b"", complaint[1]))
    return complaints


def _check(plaintext: bytes, src: int, nid: int, threshold: int, commitments: list[bytes]
           ) -> tuple[bool, str] | None:
    """(provable, why) when a source's opened shares fail, else None."""
    sender, receiver, *shares = share_keys_plaintext_separate(plaintext)
    if (sender, receiver) != (src, nid):
        return True, f"its shares are addressed from {sender} to {receiver}"
    for name, share, commitment in zip(("b", "sk1"), shares, commitments, strict=True):
        try:
            carried = read_share(share)[2]
        except ShareError as err:
            return True, f"its share of {name}: {err}"
        if carried != commitment:
            return False, f"its share of {name} carries another commitment than the one relayed"
        try:
            degree = commitment_degree(commitment)
        except ShareError as err:
            return True, f"its commitment to {name}: {err}"
        if degree != threshold:
            return True, (f"its commitment to {name} has {degree} point(s), not the "
                          f"threshold {threshold}")
        reason = verify(share, commitment, nid)
        if reason is not None:
            return True, f"its share of {name}: {reason}"
    return None


def complaint_reply(msg: Message, complaints: list[tuple[int, bytes, str]]) -> Message:
    """The collect-stage reply of a holder with ``complaints``: no masked vector."""
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        COMPLAINTS: [src for src, _, _ in complaints],
        COMPLAINT_KEYS: [key for _, key, _ in complaints],
        COMPLAINT_REASONS: [why for _, _, why in complaints]})}), reply_to=msg)
