"""How vectors and matrices travel in Flower's legacy messages.

Legacy fit configs and fit metrics hold scalars only (bool, int, float, str, bytes).
A vector or matrix that a noise-robust baseline must exchange (FedNoRo's per-class
losses, RoFL's class centroids) travels as ``bytes``: the array in NumPy's ``.npy``
format (dtype, shape and values; NaN survives; no pickle). docs/BASELINE-METHODS.md lists
every such exchange.
"""

from __future__ import annotations

import io

import numpy as np


def pack_array(array: np.ndarray) -> bytes:
    """An array as ``.npy`` bytes."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def unpack_array(data: bytes) -> np.ndarray:
    """The array packed by :func:`pack_array`; TypeError for anything but bytes,
    ValueError for bytes that are not a whole pickle-free ``.npy`` array."""
    if not isinstance(data, bytes):
        raise TypeError(f"expected .npy bytes, got {type(data).__name__}")
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except EOFError as err:  # empty bytes
        raise ValueError(f"not .npy bytes ({err})") from None
