"""Verifiable shares of SecAgg+'s two secrets (docs/PRIVACY.md, "Shares a holder can
check"; docs/THREAT-MODEL.md, "A lying dealer"): Feldman's commitments on a
prime-order group, replacing Flower 1.42's unverifiable Shamir shares (installed at
import by both apps, :func:`install`).

Flower's SecAgg+ client Shamir-shares its mask seed ``b`` and its key ``sk1`` over
GF(2^128) (PyCryptodome's ``Shamir``); a holder cannot tell a wrong share from a right
one, so a client that dealt random shares stopped every round it was in, unnamed. Here
a dealer of secret s (any bytes), with threshold t, draws a key k in Z_q (q: the order
of NIST P-256, generator G; PyCryptodome's points, the package Flower's sharing uses)
and a polynomial f of degree t - 1 over Z_q with f(0) = k, and publishes its
*commitment*: the points C_j = a_j G of f's coefficients, and s encrypted under k
(ChaCha20 keyed by SHA-256 of a domain tag and k, as :mod:`common.secure_prf` draws
masks). The holder of node id x gets the share (x, f(x)) with a copy of the commitment.
Feldman's check: f(x) G = sum_j x^j C_j holds for a share on the committed polynomial
and fails for any other value (:func:`verify`). Any t shares give f(0) = k by Lagrange
interpolation at 0, and k decrypts s (:func:`combine`).

What the commitment reveals: C_0 = k G, from which k is as hard to find as a discrete
logarithm on P-256, and s only encrypted under k; fewer than t shares say nothing more
about k (Shamir). The x of a share is its holder's node id, so a holder cannot return
another's share as its own.

Flower calls ``create_shares(secret, threshold, num)`` inside its client's share-keys
stage and gives the i-th share to the i-th node of the stage's key list, and
``combine_shares(shares)`` in its server's unmask stage: :func:`install` puts
:func:`deal_for_flower` and :func:`combine` there. The client's mod sets who the
holders are and collects the commitments around Flower's stage (:func:`dealing`), to
send them to the server, which relays them to every holder: all see the same
commitment (the check of a share means nothing if each holder gets its own).
"""

from __future__ import annotations

import hashlib
import importlib
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from Crypto.PublicKey import ECC
from Crypto.PublicKey.ECC import EccPoint
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes

CURVE = "p256"
G = ECC._curves[CURVE].G  # PyCryptodome keeps its curves' parameters there
Q = int(ECC._curves[CURVE].order)
POINT = 64  # bytes of a point: x and y, 32 each
SCALAR = 32
INDEX = 8  # a share's x: its holder's node id
DOMAIN = b"fedefc/secagg+/vss/v1\x00"
NONCE = bytes(16)

# What the project adds to SecAgg+'s stage records: a dealer's share-keys reply carries
# its two commitments (b's, sk1's); the server's collect-stage message to a holder
# carries those of each of its sources (two per source, in SOURCE_LIST's order); a
# holder whose dealt shares fail replies with complaints instead of its masked vector.
COMMITMENTS = "fedefc-commitments"
SIGNATURES = "fedefc-signatures"  # a dealer's, one per holder (common/share_evidence.py)
COMPLAINTS = "fedefc-complaints"  # the dealers' node ids
COMPLAINT_KEYS = "fedefc-complaint-keys"  # the channel key opening each one's shares, or b""
COMPLAINT_PROOFS = "fedefc-complaint-proofs"  # else the proof of that key (b"": none)
COMPLAINT_REASONS = "fedefc-complaint-reasons"

# The lengths of the two secrets Flower's client shares (its mask seed: os.urandom(32);
# its key sk1 as PEM, 306 bytes on P-384): a commitment sealing another length is refused
# as the share-keys reply arrives (an empty secret crashed the unmask step).
SECRET_BYTES = (32, len(private_key_to_bytes(generate_key_pairs()[0])))

# The Flower modules that call Shamir's functions by their own global name.
PATCHED = (("flwr.client.mod.secure_aggregation.secaggplus_mod", "create_shares"),
           ("flwr.server.workflow.secure_aggregation.secaggplus_workflow", "combine_shares"))


class ShareError(ValueError):
    """A share or a commitment that cannot be read."""


def _stream(key: int, length: int) -> bytes:
    digest = hashlib.sha256(DOMAIN + key.to_bytes(SCALAR, "big")).digest()
    return Cipher(algorithms.ChaCha20(digest, NONCE), mode=None).encryptor().update(
        bytes(length))


def _xor(data: bytes, pad: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, pad, strict=True))


def _point_bytes(point: EccPoint) -> bytes:
    x, y = point.xy
    return int(x).to_bytes(SCALAR, "big") + int(y).to_bytes(SCALAR, "big")


def _point(data: bytes) -> EccPoint:
    """A commitment's point: on P-256 and not the point at infinity (an honest dealer's
    coefficients are never 0; C_0 at infinity would be the key 0, which anyone can use
    to open the sealed secret)."""
    x, y = int.from_bytes(data[:SCALAR], "big"), int.from_bytes(data[SCALAR:], "big")
    try:
        point = EccPoint(x, y, CURVE)  # checks that (x, y) is on the curve
    except ValueError:
        raise ShareError("a commitment point is not on P-256") from None
    if point.is_point_at_infinity():
        raise ShareError("a commitment point is the point at infinity (a coefficient 0)")
    return point


def read_commitment(data: bytes) -> tuple[list[EccPoint], bytes]:
    """(the points C_0..C_{t-1}, the encrypted secret) of a commitment; :class:
    `ShareError` if it cannot be one."""
    if not isinstance(data, bytes) or len(data) < 2:
        raise ShareError("a commitment must be bytes")
    t = int.from_bytes(data[:2], "big")
    end = 2 + t * POINT
    if t < 1 or len(data) < end:
        raise ShareError(f"a commitment of {t} point(s) holds {len(data)} bytes")
    return [_point(data[i:i + POINT]) for i in range(2, end, POINT)], data[end:]


def commitment_degree(data: bytes) -> int:
    """t, the number of points (the threshold) a commitment commits to."""
    return len(read_commitment(data)[0])


def deal(secret: bytes, threshold: int, holders: list[int]) -> tuple[bytes, list[bytes]]:
    """(the commitment, one share per holder node id) of ``secret`` with ``threshold``:
    module docstring. A share is x (8 bytes), f(x) (32 bytes), then the commitment."""
    if threshold < 1 or len(set(holders)) != len(holders) or not all(
            0 < x < 2**(8 * INDEX) for x in holders):
        raise ValueError(f"threshold {threshold} or holders {holders[:3]} unfit to deal")
    coefficients = [secrets.randbelow(Q - 1) + 1 for _ in range(threshold)]
    commitment = (threshold.to_bytes(2, "big")
                  + b"".join(_point_bytes(G * a) for a in coefficients)
                  + _xor(secret, _stream(coefficients[0], len(secret))))
    shares = []
    for x in holders:
        y = 0
        for a in reversed(coefficients):  # Horner: f(x) mod q
            y = (y * x + a) % Q
        shares.append(x.to_bytes(INDEX, "big") + y.to_bytes(SCALAR, "big") + commitment)
    return commitment, shares


def read_share(share: bytes) -> tuple[int, int, bytes]:
    """(x, f(x), the commitment it carries); :class:`ShareError` if it cannot be one."""
    if not isinstance(share, bytes) or len(share) < INDEX + SCALAR + 2:
        raise ShareError("a share is too short")
    x = int.from_bytes(share[:INDEX], "big")
    y = int.from_bytes(share[INDEX:INDEX + SCALAR], "big")
    return x, y, share[INDEX + SCALAR:]


def verify(share: bytes, commitment: bytes, holder: int) -> str | None:
    """Why ``share`` is not the share of node ``holder`` on the polynomial that
    ``commitment`` (the one every holder was sent) commits to, or None: its x must be
    the holder's id, its copy of the commitment the commitment, and f(x) G = sum_j x^j
    C_j (Feldman's check)."""
    try:
        x, y, carried = read_share(share)
        points, _ = read_commitment(commitment)
    except ShareError as err:
        return str(err)
    if x != holder:
        return f"its index {x} is not its holder's node id {holder}"
    if carried != commitment:
        return "it carries another commitment than the dealer's"
    if y >= Q:
        return "its value lies outside the field"
    expected = points[-1].copy()
    for point in reversed(points[:-1]):  # Horner: sum_j x^j C_j, in place
        expected *= x
        expected += point
    if G * y != expected:
        return "it fails its dealer's commitment (Feldman's check)"
    return None


def verify_batch(shares: list[tuple[bytes, int]], commitment: bytes) -> bool:
    """Whether every (share, holder) of ``shares`` passes :func:`verify` against
    ``commitment``, checked at once: with random 128-bit r_i, sum_i r_i f(x_i) G =
    sum_j (sum_i r_i x_i^j) C_j costs t + 1 point multiplications for the lot, where
    one by one they cost t + 1 each; a batch holding a wrong share passes with a
    probability below 2^-128 (its r_i would have to cancel it). False: check them one by
    one to find which."""
    try:
        points, _ = read_commitment(commitment)
        parsed = [read_share(share) for share, _ in shares]
    except ShareError:
        return False
    if any(x != holder or carried != commitment or y >= Q
           for (x, y, carried), (_, holder) in zip(parsed, shares)):
        return False
    total, weights = 0, [0] * len(points)
    for x, y, _ in parsed:
        r = secrets.randbits(128)
        total = (total + r * y) % Q
        power = r
        for j in range(len(points)):
            weights[j] = (weights[j] + power) % Q
            power = power * x % Q
    expected = points[0] * weights[0]
    for point, weight in zip(points[1:], weights[1:]):
        expected += point * weight
    return G * total == expected


def combine(shares: list[bytes]) -> bytes:
    """The secret of ``shares`` (at least t of one dealing, as the server's checks left
    them: :func:`verify`): f(0) by Lagrange interpolation over t of them, then the
    commitment's encrypted secret decrypted."""
    parsed = {}
    for share in shares:
        x, y, commitment = read_share(share)
        parsed.setdefault(x, (y, commitment))
    points, sealed = read_commitment(next(iter(parsed.values()))[1])
    t = len(points)
    if len(parsed) < t:
        raise ShareError(f"{len(parsed)} distinct share(s), below the threshold {t}")
    xs = sorted(parsed)[:t]
    key = 0
    for j, xj in enumerate(xs):
        num = den = 1
        for m, xm in enumerate(xs):
            if m != j:
                num, den = num * xm % Q, den * (xm - xj) % Q
        key = (key + parsed[xj][0] * num * pow(den, -1, Q)) % Q
    return _xor(sealed, _stream(key, len(sealed)))


_DEALING = threading.local()


@contextmanager
def dealing(holders: list[int]) -> Iterator[list[bytes]]:
    """While Flower's client runs its share-keys stage: the i-th share of each
    ``create_shares`` goes to node ``holders[i]`` (the order of the stage's key list),
    and the commitments made are appended to the list this yields (``b``'s, then
    ``sk1``'s)."""
    made: list[bytes] = []
    _DEALING.state = (holders, made)
    try:
        yield made
    finally:
        del _DEALING.state


def deal_for_flower(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """Flower's ``create_shares(secret, threshold, num)``: :func:`deal` to the holders
    of the current :func:`dealing` (their number, at most ``num``, is what Flower
    hands out)."""
    state = getattr(_DEALING, "state", None)
    if state is None:
        raise RuntimeError("SecAgg+ shares dealt outside fedefc's dealing(): they would "
                           "not be verifiable")
    holders, made = state
    if len(holders) > num:
        raise ValueError(f"{len(holders)} holders for {num} shares")
    commitment, shares = deal(secret, threshold, holders)
    made.append(commitment)
    return shares


def install() -> None:
    """Make Flower's SecAgg+ client deal with :func:`deal_for_flower` and its server
    combine with :func:`combine` (idempotent); fails loudly if Flower moved them."""
    for name, attr in PATCHED:
        module = importlib.import_module(name)
        if not callable(getattr(module, attr, None)):
            raise ImportError(f"{name} has no {attr}: this Flower version moved SecAgg+'s "
                              "Shamir sharing; update common/verifiable_shares.py")
        setattr(module, attr, deal_for_flower if attr == "create_shares" else combine)
