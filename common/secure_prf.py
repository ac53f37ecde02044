"""A full-entropy mask generator for Flower's SecAgg+ (docs/PRIVACY.md, "The masks"):
a TEMPORARY replacement of Flower 1.42's ``pseudo_rand_gen`` until upstream fixes it
(flwr issue #7522), installed by both apps at import (:func:`install`).

Every SecAgg+ mask, a client's private mask and each pairwise mask, is a stream of
integers drawn from a seed: 32 random bytes for the private mask, a 32-byte key agreed
by Diffie-Hellman (base64, 44 bytes) for a pairwise one. Flower's generator XORs the
seed's 4-byte words into ONE 32-bit integer and seeds NumPy's ``RandomState`` (a
Mersenne Twister, not a cryptographic generator) with it: whoever holds a client's
masked vector and all but its private mask (the server, once it has removed the
pairwise masks of a client it reconstructed) can try all 2**32 seeds, and two seeds
that differ only in how their words XOR together give the same mask.

:func:`pseudo_rand_gen` keeps Flower's signature and output types (a list of int64
arrays of the requested shapes, a 0-d array for the shape ``()``), and draws from
ChaCha20 (the ``cryptography`` package Flower itself uses) keyed by SHA-256 of a domain
tag and the WHOLE seed: all 256 bits of the seed count, and the stream is a
cryptographic PRF of it. Its values are uniform over the full range ``[0, num_range)``
(Flower's ``randint(0, num_range - 1)`` never draws ``num_range - 1``, as NumPy's upper
bound is exclusive); ``num_range`` must be a power of two up to 2**32, which Flower's
``SecAggPlusWorkflow`` requires of its ``modulus_range`` anyway, so taking the low bits
of 32-bit words is exactly uniform.

The client and the server must use the same generator, or the masks do not cancel and
the decoded sum is garbage: :func:`install` replaces the name in both Flower modules that
look it up (the client mod and the server workflow) in whichever process imports an
app, and fails loudly if a Flower upgrade moved them.
"""

from __future__ import annotations

import hashlib
import importlib
import math

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

DOMAIN = b"fedefc/secagg+/mask/v1\x00"  # the key is SHA-256(DOMAIN || seed)
NONCE = bytes(16)  # one key per seed, so one fixed nonce (counter starts at 0)
MAX_RANGE = 2**32

# The Flower modules that call ``pseudo_rand_gen`` by their own global name (by module
# path: the packages above them export functions of the same names).
PATCHED_MODULES = tuple(importlib.import_module(name) for name in (
    "flwr.client.mod.secure_aggregation.secaggplus_mod",
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow"))


def pseudo_rand_gen(seed: bytes, num_range: int,
                    dimensions_list: list[tuple[int, ...]]) -> list[np.ndarray]:
    """One int64 array per shape in ``dimensions_list``, uniform over ``[0, num_range)``,
    a pure function of the whole ``seed`` (ChaCha20 keyed by SHA-256(DOMAIN || seed);
    the arrays take consecutive parts of one stream)."""
    if not isinstance(seed, bytes) or not seed:
        raise ValueError(f"a mask seed must be non-empty bytes, got {type(seed).__name__}")
    if not (isinstance(num_range, int) and 2 <= num_range <= MAX_RANGE
            and num_range & (num_range - 1) == 0):
        raise ValueError(f"num_range={num_range!r}: the mask range must be a power of two in "
                         f"2..2**32 (SecAgg+'s modulus_range)")
    key = hashlib.sha256(DOMAIN + seed).digest()
    stream = Cipher(algorithms.ChaCha20(key, NONCE), mode=None).encryptor()
    sizes = [math.prod(shape) for shape in dimensions_list]
    words = np.frombuffer(stream.update(bytes(4 * sum(sizes))), dtype="<u4")
    values = (words & np.uint32(num_range - 1)).astype(np.int64)
    out, start = [], 0
    for shape, size in zip(dimensions_list, sizes):
        out.append(values[start:start + size].reshape(shape))
        start += size
    return out


def install() -> None:
    """Make Flower's SecAgg+ client mod and server workflow draw their masks from
    :func:`pseudo_rand_gen` (idempotent). Called at import by both apps."""
    for module in PATCHED_MODULES:
        if not callable(getattr(module, "pseudo_rand_gen", None)):
            raise ImportError(
                f"{module.__name__} has no pseudo_rand_gen: this Flower version moved the "
                "SecAgg+ mask generator; check whether flwr#7522 is fixed there and update "
                "common/secure_prf.py (docs/PRIVACY.md, 'The masks')")
        module.pseudo_rand_gen = pseudo_rand_gen


def installed() -> bool:
    """Whether both Flower modules use :func:`pseudo_rand_gen`."""
    return all(module.pseudo_rand_gen is pseudo_rand_gen for module in PATCHED_MODULES)
