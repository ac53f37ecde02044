"""Stopping a Flower process and everything it started.

A SuperLink starts a ``flower-superexec`` in a session of its own, which starts the
``flwr-serverapp`` / ``flwr-simulation`` process, which starts Ray's processes; a
SuperNode does the same for its ClientApps. Signalling the SuperLink's process group
alone would leave those running, so :func:`stop_tree` signals every process group in
the tree, first SIGTERM, then SIGKILL for whatever is left after ``timeout``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """``pid`` and all its living descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    for pgid in {_pgid(p) for p in pids} - {None, os.getpgrp()}:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def stop_tree(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process groups of ``proc`` and its descendants; SIGKILL what remains."""
    tree = descendants(proc.pid)
    _signal_groups(tree, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        proc.poll()  # reap the direct child so it does not linger as a zombie
        time.sleep(0.1)
    _signal_groups([p for p in tree if _alive(p)], signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
