"""Who lied about SecAgg+'s verifiable shares (:mod:`common.verifiable_shares`;
docs/THREAT-MODEL.md, "A lying dealer" and "Malformed secure replies").

Every dealer sends the server its two commitments (its mask seed ``b``'s and its key
``sk1``'s) with its encrypted shares, and the server relays them to every holder, who
checks the shares it was dealt before it masks anything (``fedefc_client/
share_holder.py``). So the server can tell:

- at share time, from a holder's provable complaint (the key of its channel with the
  dealer): whether the dealer's shares, as the server relayed them, fail the dealer's
  commitments (the dealer lied) or pass them (the complaint is false)
  (:func:`judge_complaint`);
- at unmask time, from each returned share alone: a share that fails its owner's
  commitment, or is not its holder's, was returned wrong by its holder, since every
  holder checked its shares on arrival (:func:`wrong_shares`).
"""

from __future__ import annotations

from typing import Any

from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from common.verifiable_shares import ShareError, commitment_degree, verify

SECRETS = ("b", "sk1")  # a dealer's two commitments, in the order it sends them


def bad_commitments(value: Any, threshold: int) -> str | None:
    """Why a share-keys reply's commitments cannot be a dealer's two, for a round of
    reconstruction ``threshold``, or None."""
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, bytes) for v in value)):
        return "share-keys reply without its two commitments"
    for name, commitment in zip(SECRETS, value):
        try:
            degree = commitment_degree(commitment)
        except ShareError as err:
            return f"share-keys reply whose commitment to {name} is unreadable ({err})"
        if degree != threshold:
            return (f"share-keys reply whose commitment to {name} has {degree} point(s), "
                    f"not the round's threshold {threshold}")
    return None


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
