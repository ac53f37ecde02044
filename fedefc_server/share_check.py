"""Who lied about SecAgg+'s verifiable shares (:mod:`common.verifiable_shares`;
docs/THREAT-MODEL.md, "A lying dealer" and "Malformed secure replies").

Every dealer sends the server its two commitments (its mask seed ``b``'s and its key
``sk1``'s) with its encrypted shares, and the server relays them to every holder, who
checks the shares it was dealt before it masks anything (``fedefc_client/
share_holder.py``). So the server can tell:

- as the share-keys reply arrives: whether the dealer signed each holder's ciphertext
  with its commitments (:func:`bad_signatures`), and sealed secrets of the lengths
  SecAgg+ shares (:func:`bad_commitments`);
- at share time, from a holder's complaint (the key of its channel with the dealer, or a
  proof of it when the shares do not open): whether the dealer's shares, as the dealer
  signed them, fail the dealer's commitments or do not open (the dealer lied) or pass
  them (the complaint is false) (:func:`judge_complaint`, :func:`judge_unopened`);
- at unmask time, from each returned share alone: a share that fails its owner's
  commitment, or is not its holder's, was returned wrong by its holder, since every
  holder checked its shares on arrival (:func:`wrong_returned`, in batches,
  :func:`wrong_shares` one by one).
"""

from __future__ import annotations

from typing import Any

from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from common.share_evidence import proven_channel_key, signed_by
from common.verifiable_shares import (
    COMMITMENTS,
    SECRET_BYTES,
    SIGNATURES,
    ShareError,
    read_commitment,
    verify,
    verify_batch,
)

SECRETS = ("b", "sk1")  # a dealer's two commitments, in the order it sends them


def bad_commitments(value: Any, threshold: int) -> str | None:
    """Why a share-keys reply's commitments cannot be a dealer's two, for a round of
    reconstruction ``threshold``, or None."""
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, bytes) for v in value)):
        return "share-keys reply without its two commitments"
    for name, commitment, length in zip(SECRETS, value, SECRET_BYTES):
        try:
            points, sealed = read_commitment(commitment)
        except ShareError as err:
            return f"share-keys reply whose commitment to {name} is unreadable ({err})"
        if len(points) != threshold:
            return (f"share-keys reply whose commitment to {name} has {len(points)} "
                    f"point(s), not the round's threshold {threshold}")
        if len(sealed) != length:
            return (f"share-keys reply whose commitment to {name} seals {len(sealed)} "
                    f"bytes, not the {length} of a SecAgg+ {name}")
    return None


def bad_signatures(record: dict[str, Any], dealer: int, pk2: bytes | None) -> str | None:
    """Why a share-keys reply's signatures (one per destination,
    :func:`common.share_evidence.sign_deal`) are not its dealer's, of node ``dealer``
    whose setup key is ``pk2``, on each ciphertext with its two commitments, or None."""
    signatures = record.get(SIGNATURES)
    dsts, texts = record[Key.DESTINATION_LIST], record[Key.CIPHERTEXT_LIST]
    if not isinstance(signatures, list) or len(signatures) != len(dsts):
        return "share-keys reply without one signature per destination"
    for dst, text, signature in zip(dsts, texts, signatures):
        if pk2 is None or not signed_by(pk2, signature, dealer, dst, text,
                                        list(record[COMMITMENTS])):
            return (f"share-keys reply whose shares for node {dst} carry no signature of "
                    "its dealer's setup key")
    return None


def judge_unopened(holder: int, dealer: int, proof: bytes, ciphertext: bytes | None,
                   public_keys: dict[int, bytes]) -> tuple[int, str]:
    """(the node that lied, why) for ``holder``'s complaint that ``dealer``'s shares do
    not open, with ``proof`` of their channel's key
    (:func:`common.share_evidence.proven_channel_key`; ``public_keys``: each node's
    setup key pk2): a proven key that does not open the ciphertext the dealer signed
    names the dealer; a proof that fails, or a key that opens it, names the holder."""
    if ciphertext is None:
        return holder, f"it complained about node {dealer}, which dealt it no shares"
    key = (proven_channel_key(proof, public_keys[holder], public_keys[dealer])
           if holder in public_keys and dealer in public_keys else None)
    if key is None:
        return holder, (f"its complaint that node {dealer}'s shares do not open proves no "
                        "key of their channel")
    try:
        decrypt(key, ciphertext)
    except Exception:  # the signed ciphertext does not open under the proven key
        return dealer, (f"it dealt node {holder} encrypted shares that do not open under "
                        "their channel's key (the holder proved the key)")
    return holder, (f"it complained that node {dealer}'s shares do not open, but they open "
                    "under the key it proved: a false complaint")


def judge_complaint(holder: int, dealer: int, key: bytes, ciphertext: bytes | None,
                    commitments: list[bytes]) -> tuple[int, str]:
    """(the node that lied, why) for ``holder``'s provable complaint about ``dealer``:
    ``key`` should open ``ciphertext``, the dealer's encrypted shares for the holder as
    the server relayed them, whose shares are checked against the dealer's
    ``commitments``."""
    if ciphertext is None:
        return holder, f"it complained about node {dealer}, which dealt it no shares"
    try:
        plaintext = decrypt(key, ciphertext)
    except Exception:  # a key that does not open the dealer's ciphertext
        return holder, (f"its complaint about node {dealer}'s shares gives a key that does "
                        "not open them")
    sender, receiver, *shares = share_keys_plaintext_separate(plaintext)
    if (sender, receiver) != (dealer, holder):
        return dealer, (f"it addressed the shares it dealt node {holder} from {sender} to "
                        f"{receiver}")
    for name, share, commitment in zip(SECRETS, shares, commitments, strict=True):
        reason = verify(share, commitment, holder)
        if reason is not None:
            return dealer, f"it dealt node {holder} a share of {name} that {_clause(reason)}"
    return holder, (f"it complained about node {dealer}'s shares, which pass node "
                    f"{dealer}'s commitments: a false complaint")


def _clause(reason: str) -> str:
    """A check's reason, after 'a share that'."""
    return reason.removeprefix("it ")


def wrong_returned(returned: dict[int, tuple[dict[str, Any], dict[str, Any]]],
                   commitments: dict[int, list[bytes]]) -> dict[int, dict[int, str]]:
    """{holder: {owner: why}} of the unmask replies ``returned`` ({holder: (its request,
    its reply)}): each owner's returned shares of one secret are checked together
    (:func:`common.verifiable_shares.verify_batch`: about n t point multiplications for
    the round where one by one they were about n^2 t), and only the holders of a batch
    that fails one by one (:func:`wrong_shares`)."""
    batches: dict[tuple[int, int], list[tuple[bytes, int]]] = {}
    for holder, (request, reply) in returned.items():
        active = set(request[Key.ACTIVE_NODE_ID_LIST])
        for owner, share in zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST], strict=True):
            batches.setdefault((owner, 0 if owner in active else 1), []).append(
                (share, holder))
    suspects = {holder for (owner, which), batch in batches.items()
                if owner not in commitments
                or not verify_batch(batch, commitments[owner][which])
                for _, holder in batch}
    out = {}
    for holder in sorted(suspects):
        wrong = wrong_shares(*returned[holder], holder, commitments)
        if wrong:
            out[holder] = wrong
    return out


def wrong_shares(request: dict[str, Any], reply: dict[str, Any], holder: int,
                 commitments: dict[int, list[bytes]]) -> dict[int, str]:
    """{owner: why} for each share of an unmask ``reply`` (of node ``holder``, to the
    unmask ``request``) that fails its owner's commitment (``b``'s for the nodes the
    request calls active, ``sk1``'s for those it calls dropped) or is not the holder's."""
    active = set(request[Key.ACTIVE_NODE_ID_LIST])
    out = {}
    for owner, share in zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST], strict=True):
        which = 0 if owner in active else 1
        if owner not in commitments:
            out[owner] = f"it returned a share of node {owner}, which dealt none"
            continue
        reason = verify(share, commitments[owner][which], holder)
        if reason is not None:
            out[owner] = f"its share of node {owner}'s {SECRETS[which]} {_clause(reason)}"
    return out
