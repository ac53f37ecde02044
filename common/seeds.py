"""Deterministic seeds derived from the run seed and a path of names or numbers."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``parts`` (stable across processes)."""
    text = "/".join([str(seed), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
