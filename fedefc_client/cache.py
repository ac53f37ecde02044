"""The keys of a node's prepared data in its disk cache (:class:`common.disk_cache.DataCache`).

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
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.config import RunConfig
from common.models import TaskShape

FORMAT = 2  # bump when the stored arrays change meaning


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
