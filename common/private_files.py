"""Owner-only files and folders (docs/PRIVACY.md, "Data at rest").

Everything the project writes may hold private facts: a node's cache holds its decoded
data and labels, its audit log what it sent, a run's folder the model trained on
everyone's data, its per-round metrics and its checkpoint. So every file is created
mode 0600 and every folder the project creates mode 0700, whatever the umask (a
stricter umask still applies). A folder that already exists (the operator's own
``cache-dir``, say) keeps its mode; the files the project puts in it are 0600.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dir(path: str | Path) -> Path:
    """Create ``path`` and its missing parents, each mode 0700; an existing folder is
    left as it is."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            continue
        os.chmod(folder, DIR_MODE)  # mkdir's mode is masked by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    return path


def open_private(path: str | Path, mode: str = "a") -> IO:
    """``open(path, mode)`` for writing or appending, the file created (or made) 0600."""
    if mode not in ("a", "ab", "w", "wb"):
        raise ValueError(f"open_private writes or appends (a, ab, w, wb), not mode {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a file that existed before keeps no wider mode
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise
