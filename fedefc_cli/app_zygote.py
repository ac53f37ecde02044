"""Flower's app processes forked from one that has already imported torch and Flower.

    python -m fedefc_cli.app_zygote   (started by a SuperExec: :class:`Zygote`)

A SuperExec starts one process per task: a ``flwr-clientapp`` for every message a node
receives (each SecAgg+ stage is one), a ``flwr-serverapp`` for every run. Each such
process first imports torch and Flower's app modules: 5 of the 7 CPU s a FedEFC
ClientApp process spends on a training message (docs/BENCHMARKS.md, "Deployment against
Flower's floor"). The SuperExecs that :mod:`.flower_repairs` starts hand Flower's own
app commands to a zygote instead: one process, started at the SuperExec's first task,
that imports :data:`PRELOAD` once and then forks a child per task, which runs the
command's entry point as the executable would (its arguments, its output or none, its
exit status) and ends through the interpreter's normal exit. Only third-party modules are
preloaded, never the app's own code: a child imports the app from the FAB it installs,
as a fresh process does, so a signed app's check (:mod:`.trusted_apps`) sees what runs.

With ``--trusted-keys``, the launcher that :mod:`.trusted_apps` puts first on PATH is run
the same way, its check included. Any other command (another installation's script, a
launcher for another interpreter) is started as before, as its own process; so is every
command of a SuperExec whose environment has ``FEDEFC_APP_ZYGOTE=off`` (Flower's own
way; tests/benchmarks/bench_flower_floor.py compares the two). The zygote reaps its
children and ends when its SuperExec closes the pipe it reads. A child's name
(``pgrep flwr-clientapp``) is its executable's; its command line in ``ps`` is the
zygote's (docs/RELIABILITY.md, "App processes").
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from .trusted_apps import ROLES, launcher_args

# Flower's app executables the zygote runs -> their console-script entry points
ENTRIES = {name: entry for _, entry, name in ROLES.values()}
TRUSTED_ENTRY = "fedefc_cli.trusted_apps:launched"  # a launcher of --trusted-keys
PRELOAD = ("torch", "flwr.supernode.cli", "flwr.superlink.cli")
PR_SET_NAME = 15  # prctl(2)
ZYGOTE_SWITCH = "FEDEFC_APP_ZYGOTE"  # "off" in a SuperExec's environment: a process per task


def task_of(args: list[str]) -> tuple[str, list[str]] | None:
    """The entry point and ``sys.argv`` the zygote runs for the command ``args``: Flower's
    own script installed beside this interpreter, or a launcher of
    :mod:`.trusted_apps` for it; None for any other command."""
    if not args or args[0] not in ENTRIES:
        return None
    found = shutil.which(args[0])
    if found == os.path.join(os.path.dirname(sys.executable), args[0]):
        return ENTRIES[args[0]], args
    launcher = launcher_args(found) if found else None
    return (TRUSTED_ENTRY, [found, *launcher, *args[1:]]) if launcher else None


class Zygote:
    """The SuperExec's side: the zygote process, started at the first task."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, entry: str, args: list[str], quiet: bool) -> None:
        """Start the task ``args`` (run as ``entry``) in a child of the zygote; a zygote
        that died is started again."""
        request = json.dumps({"entry": entry, "argv": args, "quiet": quiet}) + "\n"
        for attempt in (1, 2):
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
                    [sys.executable, "-m", "fedefc_cli.app_zygote"], stdin=subprocess.PIPE,
                    text=True)
            try:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
                return
            except BrokenPipeError:
                if attempt == 2:
                    raise
                self.proc = None


def reap(*_: Any) -> None:
    """Collect every child that has exited (the zygote's SIGCHLD handler)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def name_process(name: str) -> None:
    """The process's name (``/proc/PID/comm``: what ``pgrep`` and ``top`` show) becomes
    ``name``, the executable's; its command line stays the zygote's."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def run_task(entry: str, argv: list[str], quiet: bool) -> int:
    """In the forked child: the task's entry point, as its executable runs it; the exit
    status its process would have."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    name_process(os.path.basename(argv[0]))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # not the zygote's requests
    if quiet:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os.close(devnull)
    sys.argv = argv
    module, func = entry.split(":")
    try:
        code = getattr(importlib.import_module(module), func)()
    except SystemExit as done:
        code = done.code
    except BaseException:  # pylint: disable=broad-exception-caught - as the interpreter
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def serve() -> int:
    """The zygote: preload, then fork a child per request until stdin closes. Returns in
    a child with the child's exit status."""
    start, imported = time.monotonic(), []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as err:  # pylint: disable=broad-exception-caught - a task says it
            print(f"app zygote {os.getpid()}: {name} not imported ({err!r}); each task "
                  "imports it, and fails as a fresh process would", file=sys.stderr)
    print(f"app zygote {os.getpid()}: {', '.join(imported) or 'nothing'} imported in "
          f"{time.monotonic() - start:.1f} s; app processes fork from here "
          f"({ZYGOTE_SWITCH}=off: a fresh process per task)", file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is its SuperExec's and apps'
    for line in sys.stdin:
        request = json.loads(line)
        if os.fork() == 0:
            return run_task(request["entry"], request["argv"], request["quiet"])
    return 0


if __name__ == "__main__":
    sys.exit(serve())
