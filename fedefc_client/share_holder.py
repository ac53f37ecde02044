"""What a SecAgg+ node does with verifiable shares (:mod:`common.verifiable_shares`;
docs/THREAT-MODEL.md, "A lying dealer"): it deals them with commitments, and checks
the shares it is dealt before it masks anything.

As a dealer (the share-keys stage) the node tells :func:`common.verifiable_shares.
dealing` who its holders are, in the order Flower hands its shares out, and sends its
two commitments with its encrypted shares, each holder's signed with its SecAgg+ key
sk2 (:func:`signed_deal`; :mod:`common.share_evidence`). As a holder (the collect stage,
before it trains) it checks that each source signed the shares and commitments the
server relays, then opens the shares and checks them against the commitments
(:func:`dealt_share_complaints`). Shares or commitments their dealer did not sign were
changed on the way (the server checked every signature as they arrived): the node
refuses the message and gives nothing. A failing dealer makes it reply with complaints
instead of its masked vector, one per dealer, each proving the dealer's fault:

- the shares opened but fail (another commitment carried than the one the dealer
  signed, shares off the committed polynomial, another node named, a commitment of
  another degree or sealing another length): the complaint gives the channel's key, so
  the server opens the dealer's ciphertext and checks the shares itself;
- the signed ciphertext does not open: the complaint gives a proof of the channel's
  key (:func:`common.share_evidence.channel_proof`), so the server derives the key and
  sees that it does not open.

Either key opens this one channel only: the dealer's shares for the node, which fail or
do not open, and the node's shares for the dealer, which the dealer holds anyway. The
server names the dealer, or the node whose complaint does not hold; the round starts
again without it (nothing was unmasked).
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

from common.share_evidence import channel_proof, sign_deal, signed_by
from common.verifiable_shares import (
    COMMITMENTS,
    COMPLAINT_KEYS,
    COMPLAINT_PROOFS,
    COMPLAINT_REASONS,
    COMPLAINTS,
    SECRET_BYTES,
    SIGNATURES,
    ShareError,
    read_commitment,
    read_share,
    verify,
)


def holders_of(config: ConfigRecord) -> list[int]:
    """The node ids a share-keys request lists, in the order Flower's client deals its
    shares to them."""
    return [int(key) for key in config if key != Key.STAGE]


def signed_deal(record: ConfigRecord, commitments: list[bytes], ctxt: Context) -> None:
    """A dealer's share-keys reply ``record`` with its two ``commitments`` and its
    signature of each holder's ciphertext with them (:func:`common.share_evidence.
    sign_deal`, with its SecAgg+ key sk2)."""
    state = SecAggPlusState(**ctxt.state.config_records[RECORD_KEY_STATE])
    record[COMMITMENTS] = commitments
    record[SIGNATURES] = [sign_deal(state.sk2, state.nid, dst, text, commitments)
                          for dst, text in zip(record[Key.DESTINATION_LIST],
                                               record[Key.CIPHERTEXT_LIST], strict=True)]


Complaint = tuple[int, bytes, bytes, str]  # (dealer, channel key or b"", proof or b"", why)


def dealt_share_complaints(config: ConfigRecord, ctxt: Context) -> list[Complaint] | str:
    """A complaint for each source of a collect-stage request ``config`` whose dealt
    shares fail (module docstring); or why the request cannot be checked (no
    commitments or signatures relayed, a source this node shared no key with, shares
    their dealer did not sign)."""
    srcs, texts = config.get(Key.SOURCE_LIST, []), config.get(Key.CIPHERTEXT_LIST, [])
    relayed, signatures = config.get(COMMITMENTS), config.get(SIGNATURES)
    if (not isinstance(relayed, list) or len(relayed) != 2 * len(srcs)
            or not isinstance(signatures, list) or len(signatures) != len(srcs)):
        return ("the collect stage does not relay two commitments and a signature per "
                "source: this node masks nothing with shares it cannot check")
    state = SecAggPlusState(**ctxt.state.config_records[RECORD_KEY_STATE])
    complaints: list[Complaint] = []
    for i, (src, ciphertext) in enumerate(zip(srcs, texts, strict=True)):
        key, keys = state.ss2_dict.get(src), state.public_keys_dict.get(src)
        if key is None or keys is None:
            return f"the collect stage relays shares from node {src}, not a neighbour"
        commitments = relayed[2 * i:2 * i + 2]
        if not signed_by(keys[1], signatures[i], src, state.nid, ciphertext, commitments):
            return (f"the collect stage relays shares or commitments of node {src} that "
                    "node did not sign: this node masks nothing and proves nothing")
        try:
            plaintext = decrypt(key, ciphertext)
        except Exception:  # a signed ciphertext that does not open under the channel key
            complaints.append((src, b"", channel_proof(state.sk2, state.pk2, keys[1]),
                               "its encrypted shares do not open"))
            continue
        why = _check(plaintext, src, state.nid, state.threshold, commitments)
        if why is not None:
            complaints.append((src, key, b"", why))
    return complaints


def _check(plaintext: bytes, src: int, nid: int, threshold: int, commitments: list[bytes]
           ) -> str | None:
    """Why a source's opened shares fail, else None."""
    sender, receiver, *shares = share_keys_plaintext_separate(plaintext)
    if (sender, receiver) != (src, nid):
        return f"its shares are addressed from {sender} to {receiver}"
    for name, share, commitment, length in zip(("b", "sk1"), shares, commitments,
                                               SECRET_BYTES, strict=True):
        try:
            carried = read_share(share)[2]
            points, sealed = read_commitment(commitment)
        except ShareError as err:
            return f"its share of {name}: {err}"
        if carried != commitment:
            return f"its share of {name} carries another commitment than the one it signed"
        if len(points) != threshold or len(sealed) != length:
            return (f"its commitment to {name} has {len(points)} point(s) and seals "
                    f"{len(sealed)} bytes, not the threshold {threshold} and {length}")
        reason = verify(share, commitment, nid)
        if reason is not None:
            return f"its share of {name}: {reason}"
    return None


def complaint_reply(msg: Message, complaints: list[Complaint]) -> Message:
    """The collect-stage reply of a holder with ``complaints``: no masked vector."""
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        COMPLAINTS: [src for src, _, _, _ in complaints],
        COMPLAINT_KEYS: [key for _, key, _, _ in complaints],
        COMPLAINT_PROOFS: [proof for _, _, proof, _ in complaints],
        COMPLAINT_REASONS: [why for _, _, _, why in complaints]})}), reply_to=msg)
