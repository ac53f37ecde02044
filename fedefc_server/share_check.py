"""Which holder's Shamir shares of a secret are wrong (docs/THREAT-MODEL.md, "Malformed
secure replies"; issue 29, item 4).

In SecAgg+'s unmask stage every holder of a client's secret returns its share, and
Flower combines all of them (``flwr.common.secure_aggregation.crypto.shamir.
combine_shares``): one well-formed but wrong share makes a wrong secret, and the round
fails without saying whose share it was. Shares from more holders than the threshold
are a Reed-Solomon code word, so the wrong ones can be found: :func:`bad_holders`
returns the smallest set of holders without whose shares the others lie on one
polynomial of degree < threshold. That set is unique as long as it holds at most
(n - t) // 2 of the n shares (t: the threshold): two polynomials that each agree with
n - (n - t) // 2 >= (n + t) / 2 shares agree on t of them, so they are one. With more
wrong shares nobody can be told apart (:class:`UndecidableShares`).

The shares are Flower's: 4 bytes of index (little-endian), then 16 bytes per chunk of
the padded secret, each a value of PyCryptodome's ``Shamir`` (``ssss=False``) in
GF(2^128) with the modulus x^128 + x^7 + x^2 + x + 1, the index as the point. A share
is wrong if any of its chunks is. :func:`gf_mul` is that field's product, as
``Crypto.Protocol.SecretSharing._Element`` computes it, about 14 times faster
(48 µs against 675 µs a product, measured on the busy 2-core development machine).

What this cannot tell: whether a wrong share was returned wrong by its holder or dealt
wrong by the secret's owner (SecAgg+ shares are not verifiable); the caller names the
holder and the owner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from functools import lru_cache
from itertools import combinations

MODULUS = (1 << 128) | 0x87  # x^128 + x^7 + x^2 + x + 1
_MASK = (1 << 128) - 1


class UndecidableShares(ValueError):
    """More shares are wrong than the others can outvote: no holder can be named."""


def gf_mul(a: int, b: int) -> int:
    """The product of two elements of GF(2^128) (bit i: the coefficient of x^i)."""
    table = [0] * 16
    for i in range(1, 16):  # a times each 4-bit polynomial
        table[i] = table[i >> 1] << 1 if i % 2 == 0 else table[i - 1] ^ a
    product, shift = 0, 0
    while b:
        product ^= table[b & 15] << shift
        b >>= 4
        shift += 4
    while product >> 128:  # x^128 = x^7 + x^2 + x + 1
        high = product >> 128
        product = (product & _MASK) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
    return product


def gf_inverse(a: int) -> int:
    """The inverse of a non-zero element: a^(2^128 - 2)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^128)")
    result, power, exponent = 1, a, (1 << 128) - 2
    while exponent:
        if exponent & 1:
            result = gf_mul(result, power)
        power = gf_mul(power, power)
        exponent >>= 1
    return result


def split_share(share: bytes) -> tuple[int, list[int]]:
    """(index, the chunks' field values) of one of Flower's shares."""
    index = int.from_bytes(share[:4], "little")
    return index, [int.from_bytes(share[i:i + 16], "big") for i in range(4, len(share), 16)]


@lru_cache(maxsize=4096)
def _inverse_denominators(base: tuple[int, ...]) -> tuple[int, ...]:
    """1 / prod_{m != j} (x_j - x_m) for each point x_j of ``base`` (the indices repeat
    from secret to secret and round to round, so they are computed once)."""
    out = []
    for j, xj in enumerate(base):
        den = 1
        for m, xm in enumerate(base):
            if m != j:
                den = gf_mul(den, xj ^ xm)
        out.append(gf_inverse(den))
    return tuple(out)


def _lagrange(base: tuple[int, ...], x: int) -> list[int]:
    """The coefficients c_j with P(x) = sum_j c_j P(base_j) for every P of degree
    < len(base) (characteristic 2: a difference is a sum)."""
    coefficients = []
    for j, inverse in enumerate(_inverse_denominators(base)):
        num = inverse
        for m, xm in enumerate(base):
            if m != j:
                num = gf_mul(num, x ^ xm)
        coefficients.append(num)
    return coefficients


def consistent(points: list[tuple[int, list[int]]], threshold: int) -> bool:
    """Whether ``points`` (index, chunk values) lie, chunk by chunk, on one polynomial of
    degree < ``threshold``: the first ``threshold`` of them interpolated at the others."""
    base, rest = points[:threshold], points[threshold:]
    xs = tuple(x for x, _ in base)
    for x, values in rest:
        coefficients = _lagrange(xs, x)
        for c, value in enumerate(values):
            guess = 0
            for coefficient, (_, base_values) in zip(coefficients, base, strict=True):
                guess ^= gf_mul(coefficient, base_values[c])
            if guess != value:
                return False
    return True


def bad_holders(shares: Mapping[int, bytes], threshold: int) -> set[int]:
    """The holders (the keys of ``shares``: holder -> its share of one secret) whose
    shares are malformed (another length than most shares', an index of 0 or one
    another holder returned too) or off the polynomial the others agree on (module
    docstring); empty when all agree, or when no more than ``threshold`` well-formed
    shares came (nothing to compare). :class:`UndecidableShares` when more than
    (n - threshold) // 2 of the n well-formed shares would have to be wrong."""
    if threshold < 1:
        raise ValueError(f"threshold {threshold} must be at least 1")
    length = Counter(len(s) for s in shares.values()).most_common(1)[0][0] if shares else 0
    parsed = {h: split_share(s) for h, s in shares.items()
              if len(s) == length and (len(s) - 4) % 16 == 0 and len(s) > 4}
    counts = Counter(index for index, _ in parsed.values())
    malformed = {h for h in shares
                 if h not in parsed or parsed[h][0] == 0 or counts[parsed[h][0]] > 1}
    holders = sorted(h for h in parsed if h not in malformed)
    n = len(holders)
    if n <= threshold:
        return malformed
    for e in range(0, (n - threshold) // 2 + 1):
        for wrong in combinations(holders, e):
            if consistent([parsed[h] for h in holders if h not in wrong], threshold):
                return malformed | set(wrong)
    raise UndecidableShares(f"more than {(n - threshold) // 2} of {n} shares (threshold "
                            f"{threshold}) disagree: the wrong ones cannot be told apart")
