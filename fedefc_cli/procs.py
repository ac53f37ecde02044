"""Flower's processes: started in their own process groups, watched, and stopped with
everything they started.

A SuperLink starts a ``flower-superexec`` in a session of its own, which starts the
``flwr-serverapp`` / ``flwr-simulation`` process, which starts Ray's processes; a
SuperNode does the same for its ClientApps. Signalling the SuperLink's process group
alone would leave those running, so :func:`stop_tree` signals every process group in
the tree, first SIGTERM, then SIGKILL for whatever is left after ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from common.private_files import open_private

from .errors import LaunchError


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


class Processes:
    """Child processes, each leading its own process group (a SuperExec's ServerApp and
    ClientApp processes join its group); stopped by PID, newest first."""

    def __init__(self) -> None:
        self.running: list[tuple[str, subprocess.Popen, Path | None]] = []
        # name -> how it was started (argv, env, cwd, log), to start it again
        self.specs: dict[str, tuple[list[str], dict[str, str], Path, Path | None]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
              log: Path | None = None) -> subprocess.Popen:
        with open_private(log, "ab") if log else contextlib.nullcontext() as out:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True)
        self.running.append((name, proc, log))
        self.specs[name] = (argv, env, cwd, log)
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start process ``name`` again, as it was started, in its place (after stopping
        whatever of its old tree is left: nothing, for a process that exited, whose
        children live on under another parent)."""
        index = next(i for i, (n, _, _) in enumerate(self.running) if n == name)
        _, old, _ = self.running.pop(index)
        stop_tree(old)
        argv, env, cwd, log = self.specs[name]
        with open_private(log, "ab") if log else contextlib.nullcontext() as out:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True)
        self.running.insert(index, (name, proc, log))
        return proc

    def check_alive(self) -> None:
        """Raise naming the first process that exited, with its log tail."""
        for name, proc, log in self.running:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
                raise LaunchError(f"{name} (pid {proc.pid}) exited with code "
                                  f"{proc.returncode}; log {log}:\n{tail}")

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every process and all it started (:func:`stop_tree`), newest first."""
        for _, proc, _ in reversed(self.running):
            stop_tree(proc, timeout)
        self.running.clear()


class ProcessGroup:
    """A context manager for Flower processes started together: ``_start`` starts them
    (into ``self.procs``); on exit, or when starting fails, all are stopped by PID."""

    def __init__(self) -> None:
        self.procs = Processes()

    def _start(self) -> None:  # pragma: no cover - every subclass starts its own
        raise NotImplementedError

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.procs.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.procs.stop()


STARTUP_S = 600.0  # how long a started process may take to serve: its death ends the wait
# sooner, and a busy machine (a full test suite on two cores) can take minutes


def wait_for_port(host: str, port: int, procs: Processes, timeout: float = STARTUP_S
                  ) -> None:
    """Wait until ``host:port`` accepts connections (raise if a process dies first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check_alive()
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise LaunchError(f"nothing listens on {host}:{port} after {timeout:.0f} s")
