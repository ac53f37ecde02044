"""The on-disk cache of a node's prepared data.

A SuperNode runs every message in a fresh ClientApp process (torch imported again), so
the node's data, decoded, partitioned and noised, is prepared once and kept as an
uncompressed ``.npz`` under the node config's ``cache-dir``. The key holds everything
that decides the data:

- a partition of the run's dataset: :meth:`RunConfig.data_key` (dataset, its paths,
  shape and normalization keys, partition and noise keys, seed) and the partition id;
  the entry holds the whole partition (the held-out split is made on loading) and the
  dataset's K and normalization;
- private data: the run's input shape and K (they fix the checks and the decoding),
  the data path, and the size and modification time of every file under it, so edited
  data is re-read.

Entries are written atomically (temp file + rename): a crashed writer never leaves a
half-written entry, and two processes building the same entry both leave a whole one.
An unreadable entry is rebuilt.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable
from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.common.logger import log

from common.config import RunConfig
from common.models import TaskShape
from common.results import atomic_write_bytes

FORMAT = 2  # bump when the stored arrays change meaning

Arrays = dict[str, np.ndarray]


def partition_key(cfg: RunConfig, partition_id: int) -> str:
    """The entry of partition ``partition_id`` of the run's federated data plan."""
    return f"partition-{cfg.data_key()}-p{partition_id}-v{FORMAT}"


def private_key(task: TaskShape, data_path: str) -> str:
    """The entry of the private data at ``data_path`` (a file or a folder tree), read
    for a run of input shape and K ``task``."""
    root = Path(data_path)
    digest = hashlib.sha256(json.dumps([FORMAT, list(task.input_shape), task.num_classes,
                                        str(root)]).encode())
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        st = file.stat()
        digest.update(f"{file.relative_to(root) if file != root else ''}\0{st.st_size}\0"
                      f"{st.st_mtime_ns}\n".encode())
    return f"private-{digest.hexdigest()[:20]}-v{FORMAT}"


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
            self.root.mkdir(parents=True, exist_ok=True)
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
