"""Run a command while every core is kept busy: the test suite under load (issue 32).

    .venv/bin/python tests/load_harness.py [--procs N] [--] COMMAND [ARG ...]

starts N CPU-bound background processes (default: twice the machine's cores), runs
COMMAND, stops the background processes (by PID: SIGTERM, then SIGKILL) and exits with
COMMAND's exit code. They are stopped whatever happens: when COMMAND fails, when the
harness is interrupted (Ctrl-C, SIGTERM, SIGHUP), and, should the harness itself be
killed, by the kernel (each one asks to be sent SIGKILL when its parent dies). Before and
after the command it prints the load average and the elapsed time, e.g.::

    .venv/bin/python tests/load_harness.py -- .venv/bin/python -m pytest -q -n 2 tests
    .venv/bin/python tests/load_harness.py --procs 8 -- .venv/bin/python -m pytest -q \\
        tests/test_simulation.py -p no:cacheprovider

The background processes run at normal priority (a nice one would yield to the tests and
load nothing), each in a session of its own, as other programs on the machine are: where
the kernel schedules by autogroup (``/proc/sys/kernel/sched_autogroup_enabled`` = 1,
common), CPU time is shared fairly between sessions before processes, so busy processes
in the tests' own session would take no more from them than one does. Each spins a
pure-Python loop, which holds one core and little memory. With the default 2N on N
cores, the command's session gets about a third of a core while other sessions are busy
(the Flower processes that the deployment tests start in sessions of their own get as
much each): a test whose outcome depends on how fast the machine is shows it here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# The child's own code: ask the kernel for SIGKILL when the harness dies, then spin.
SPIN = """
import ctypes, ctypes.util, signal
try:
    ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl(
        1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
except Exception:
    pass
x = 0
while True:
    x = (x * 1103515245 + 12345) % 2147483648
"""


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def start_load(n: int) -> list[subprocess.Popen]:
    # each in a session of its own, as programs started elsewhere are: with the kernel's
    # autogroup scheduling, CPU time is shared fairly between sessions first, so N busy
    # processes in one session would take no more from the tests than one does
    return [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                             start_new_session=True) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Stop the background processes by PID: SIGTERM, then SIGKILL whatever is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="load_harness.py", description=__doc__.split("\n\n")[0],
        usage="%(prog)s [--procs N] [--] COMMAND [ARG ...]")
    parser.add_argument("--procs", type=int, default=2 * (os.cpu_count() or 1),
                        help="CPU-bound background processes (default: 2 x cores = "
                             "%(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")

    load: list[subprocess.Popen] = []
    child: subprocess.Popen | None = None
    signals = []

    def forward(signum, _frame):
        """Ctrl-C, SIGTERM, SIGHUP: ask the command to stop (SIGINT: pytest stops and runs
        its fixtures' cleanup, which stops the Flower processes its tests started), then
        insist (SIGTERM, then SIGKILL) if signalled again."""
        signals.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal([signal.SIGINT, signal.SIGTERM, signal.SIGKILL][
                min(len(signals), 3) - 1])

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    start = time.monotonic()
    code = 1
    try:
        load = start_load(args.procs)
        print(f"load_harness: {args.procs} busy processes (pids "
              f"{' '.join(str(p.pid) for p in load)}); load average {loadavg()}; running: "
              f"{' '.join(command)}", file=sys.stderr, flush=True)
        if not signals:  # (not interrupted already)
            # its own process group (a Ctrl-C reaches it once, through forward()) in this
            # session, whose CPU share it competes for with the busy processes
            child = subprocess.Popen(command, process_group=0)
            code = child.wait()
            code = 128 - code if code < 0 else code  # killed by a signal: as a shell says
        else:
            code = 130
    finally:
        before = loadavg()
        stop_load(load)
        print(f"load_harness: exit code {code} after {time.monotonic() - start:.0f} s; "
              f"load average {before} before the busy processes were stopped",
              file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
