"""Prepared arrays kept on disk as uncompressed ``.npz`` files, written atomically.

Used for a SuperNode's prepared data (``fedefc_client/cache.py``: a SuperNode starts a
fresh ClientApp process per message) and for a simulation's federated data plan
(``common/data_plan.py``: the launcher, the ServerApp and every Ray actor of a run
share one). A temp file + rename means a crashed writer never leaves a half-written
entry, and two processes building the same entry both leave a whole one. An unreadable
entry is rebuilt. Entries are owner-only (0600), and so is a cache folder the cache
creates (0700): a node's entry is its decoded private data and labels.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable
from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.common.logger import log

from .private_files import make_private_dir
from .results import atomic_write_bytes

Arrays = dict[str, np.ndarray]


class DataCache:
    """Prepared arrays stored as ``<root>/<key>.npz``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.npz"

    def load(self, key: str) -> Arrays | None:
        """The stored arrays, or None when the entry is absent or unreadable."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            log(WARNING, "data cache entry %s is unreadable (%s); rebuilding it", path, err)
            return None

    def store(self, key: str, arrays: Arrays) -> Path:
        """Write the entry atomically and return its path."""
        try:
            make_private_dir(self.root)
        except OSError as err:
            raise OSError(f"cache-dir={str(self.root)!r} cannot be created ({err}); give "
                          "a writable absolute folder in the node config") from None
        if not os.access(self.root, os.W_OK):
            raise OSError(f"cache-dir={str(self.root)!r} is not writable; give a writable "
                          "absolute folder in the node config")
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        path = self.path(key)
        atomic_write_bytes(path, buf.getvalue())
        return path

    def get_or_build(self, key: str, build: Callable[[], Arrays]) -> Arrays:
        """The entry's arrays, built by ``build`` and stored on a miss."""
        arrays = self.load(key)
        if arrays is None:
            arrays = build()
            self.store(key, arrays)
        return arrays
