"""What a SecAgg+ holder can prove against a dealer (docs/THREAT-MODEL.md, "A lying
dealer"): the dealer's signature on what it dealt, and the key of a channel whose
shares do not open.

**Signatures.** A dealer signs, for each holder, the holder's encrypted shares and its
own two commitments (:func:`sign_deal`: ECDSA over SHA-256 with its second SecAgg+ key
``sk2``, on Flower's curve P-384; the public half ``pk2`` went to the server and every
node in the setup stage). The server checks every signature as the share-keys reply
arrives and relays each with its shares; a holder checks its own (:func:`signed_by`).
So what the dealer signed is the dealer's: a ciphertext that does not open, or shares
that carry another commitment than the one it sent the server, can be held against it;
and a server that relays anything else (a forged commitment, another ciphertext) is
caught by the holder, which then gives nothing.

**A channel's key.** Flower keys the channel of a dealer d and a holder h with HKDF of
the x coordinate of s_h P_d = s_d P_h (``generate_shared_key``). When a signed
ciphertext does not open under it, the holder sends S = s_h P_d with a Chaum-Pedersen
proof that log_G P_h = log_{P_d} S (:func:`channel_proof`), so the server derives the
key itself (:func:`proven_channel_key`) and sees that the ciphertext does not open;
the holder's private key stays its own. The key opens this one channel only: the
dealer's ciphertext, which does not open, and the holder's shares for the dealer,
which the dealer holds anyway.
"""

from __future__ import annotations

import base64
import hashlib
import secrets

from Crypto.PublicKey import ECC
from Crypto.PublicKey.ECC import EccPoint
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

CURVE = "p384"  # Flower's SecAgg+ keys (flwr.supercore.primitives.asymmetric)
G = ECC._curves[CURVE].G
N = int(ECC._curves[CURVE].order)
SCALAR = 48
DOMAIN = b"fedefc/secagg+/deal/v1\x00"
PROOF_DOMAIN = b"fedefc/secagg+/channel-proof/v1\x00"
PROOF = 4 * SCALAR  # S (x, y), c, z


def _framed(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def transcript(dealer: int, holder: int, ciphertext: bytes, commitments: list[bytes]
               ) -> bytes:
    """What a dealer signs for one holder: both node ids, the holder's ciphertext and
    the dealer's two commitments (each length-prefixed)."""
    return DOMAIN + _framed(dealer.to_bytes(8, "big"), holder.to_bytes(8, "big"),
                            ciphertext, *commitments)


def sign_deal(sk2: bytes, dealer: int, holder: int, ciphertext: bytes,
              commitments: list[bytes]) -> bytes:
    """The dealer's signature (its SecAgg+ ``sk2``) of :func:`transcript`."""
    return bytes_to_private_key(sk2).sign(
        transcript(dealer, holder, ciphertext, commitments), ec.ECDSA(hashes.SHA256()))


def signed_by(pk2: bytes, signature: object, dealer: int, holder: int, ciphertext: bytes,
              commitments: list[bytes]) -> bool:
    """Whether ``signature`` is the signature of the dealer whose SecAgg+ ``pk2`` this
    is on :func:`transcript`."""
    if not isinstance(signature, bytes):
        return False
    try:
        bytes_to_public_key(pk2).verify(signature, transcript(
            dealer, holder, ciphertext, commitments), ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _point(pk: bytes) -> EccPoint:
    numbers = bytes_to_public_key(pk).public_numbers()
    return EccPoint(numbers.x, numbers.y, CURVE)


def _bytes(point: EccPoint) -> bytes:
    x, y = point.xy
    return int(x).to_bytes(SCALAR, "big") + int(y).to_bytes(SCALAR, "big")


def _challenge(*points: EccPoint) -> int:
    return int.from_bytes(hashlib.sha384(
        PROOF_DOMAIN + b"".join(_bytes(p) for p in points)).digest(), "big") % N


def fernet_key(shared: EccPoint) -> bytes:
    """Flower's channel key from the shared point: HKDF-SHA256 of its x coordinate
    (``generate_shared_key``)."""
    x = int(shared.xy[0]).to_bytes(SCALAR, "big")
    return base64.urlsafe_b64encode(HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                                         info=None).derive(x))


def channel_proof(sk2: bytes, pk2: bytes, dealer_pk2: bytes) -> bytes:
    """The holder's proof of its channel with the dealer of ``dealer_pk2``: S = s_h P_d,
    and (c, z) with c = H(P_h, P_d, S, rG, rP_d), z = r + c s_h (module docstring)."""
    s = bytes_to_private_key(sk2).private_numbers().private_value
    own, dealer = _point(pk2), _point(dealer_pk2)
    shared = dealer * s
    r = secrets.randbelow(N - 1) + 1
    c = _challenge(own, dealer, shared, G * r, dealer * r)
    z = (r + c * s) % N
    return _bytes(shared) + c.to_bytes(SCALAR, "big") + z.to_bytes(SCALAR, "big")


def proven_channel_key(proof: object, holder_pk2: bytes, dealer_pk2: bytes) -> bytes | None:
    """The channel key of the holder and the dealer of these SecAgg+ ``pk2``, if
    ``proof`` proves it (:func:`channel_proof`), else None."""
    if not isinstance(proof, bytes) or len(proof) != PROOF:
        return None
    try:
        shared = EccPoint(int.from_bytes(proof[:SCALAR], "big"),
                          int.from_bytes(proof[SCALAR:2 * SCALAR], "big"), CURVE)
        own, dealer = _point(holder_pk2), _point(dealer_pk2)
    except ValueError:  # not a point of the curve
        return None
    c = int.from_bytes(proof[2 * SCALAR:3 * SCALAR], "big")
    z = int.from_bytes(proof[3 * SCALAR:], "big")
    if not (0 <= c < N and 0 <= z < N) or shared.is_point_at_infinity():
        return None
    first = G * z + own * ((N - c) % N)  # z G - c P_h
    second = dealer * z + shared * ((N - c) % N)  # z P_d - c S
    if c != _challenge(own, dealer, shared, first, second):
        return None
    return fernet_key(shared)
