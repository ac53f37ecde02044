"""Driving Flower's own executables: ``flower-superlink``, ``flwr run``, ``flwr ls``, ``flwr log``.

Facts of Flower 1.42 this module is built around (docs/ARCHITECTURE.md, "Flower's
processes"): ``flwr run`` keeps its connections in ``$FLWR_HOME/config.toml``, so every
run here gets a private ``FLWR_HOME``; the SuperLink would ``uv sync`` the app's
dependencies for every run unless told not to (it fails offline); ``flwr run --stream``
exits 0 even when the run failed, so the outcome is read from ``flwr ls``, and from the
run's log, where a ServerApp that trained nothing says ``RUN FAILED: <reason>``
(:class:`RunOutcome`); and Flower's processes start each other by name, so this
environment's scripts go first on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.private_files import open_private

from .app_files import stage_app
from .errors import LaunchError
from .log_view import LogView
from .procs import ProcessGroup, wait_for_port
from .progress import ROUND_LINE, RoundProgress
from .ray_cluster import ray_env
from .run_configs import APP_DIR, write_run_config


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for offline, private Flower processes."""
    env = dict(os.environ)
    # Flower's processes start each other by name (the SuperLink runs flower-superexec,
    # which runs flwr-simulation): put this environment's scripts first on PATH, so a
    # venv works without being activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(FLWR_HOME=str(flwr_home), FLWR_DISABLE_UPDATE_CHECK="1",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    return env


def flower_bin(name: str) -> str:
    """A Flower executable next to this interpreter (works without an activated venv)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def flwr_json(args: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """``flwr ARGS --format json``, parsed; LaunchError with its output otherwise."""
    out = subprocess.run([flower_bin("flwr"), *args, "--format", "json"], env=env, cwd=cwd,
                         capture_output=True, text=True)
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError:
        raise LaunchError(f"flwr {' '.join(args)} gave no JSON (exit {out.returncode}):\n"
                          f"{out.stdout[-2000:]}{out.stderr[-2000:]}") from None


class SuperLinkGone(LaunchError):
    """The SuperLink of a connection stopped answering (``when``: the time it was seen)."""

    def __init__(self, connection: str, when: str):
        super().__init__(f"the SuperLink of connection {connection!r} stopped answering at "
                         f"{when}")
        self.connection = connection
        self.when = when


# How long submit waits, by default, for a SuperLink that stopped answering mid-run to
# answer again: a supervisor or systemd restarts it within seconds, but a busy machine
# can take minutes to start it and its SuperExec (fedefc deploy submit --reconnect-wait).
RECONNECT_S = 600.0
LOST_LINE = "SuperLink is unavailable"  # flwr's words when its connection is gone


def run_row(connection: str, run_id: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """The run's row of ``flwr ls --run-id`` (its ``status``, ``status-details``, ...);
    :class:`SuperLinkGone` when the SuperLink does not answer."""
    res = flwr_json(["ls", connection, "--run-id", run_id], env, cwd)
    if not res.get("success", True) and \
            "unavailable" in str(res.get("error-message", "")).lower():
        raise SuperLinkGone(connection, time.strftime("%H:%M:%S"))
    runs = res.get("runs") or []
    if not runs:
        raise LaunchError(f"flwr ls knows no run {run_id}: {res}")
    return runs[0]


def flower_reason(row: dict[str, Any]) -> str | None:
    """Why Flower says the run of ``row`` (its ``flwr ls`` row) ended: its status
    details, e.g. ``No heartbeat received from the task`` (a SuperLink that was away
    longer than the ServerApp's heartbeat patience ends its run so, and the ServerApp's
    last lines are then refused); for a ServerApp that raised, its exception's text;
    None when it says nothing (Flower's ``N/A`` included). For a failed run whose log
    names no reason."""
    details = str(row.get("status-details") or "").strip()
    if details.startswith(SERVERAPP_RAISED):  # the ServerApp's own exception, not Flower's
        return f"the ServerApp raised: {details.removeprefix(SERVERAPP_RAISED)}"
    return f"Flower says: {details}" if details and details != "N/A" else None


def active_runs(connection: str, env: dict[str, str], cwd: Path,
                listing: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(run id, status) of every run of the SuperLink that has not finished, from
    ``listing`` (what ``flwr ls`` said just now) or a new ``flwr ls``."""
    res = listing if listing is not None else flwr_json(["ls", connection], env, cwd)
    return [(str(r["run-id"]), str(r["status"])) for r in res.get("runs") or []
            if not str(r.get("status", "")).startswith("finished")]


# The ServerApp's contract (docs/DEPLOYMENT.md, "When a run fails"): a run that trained
# nothing logs a last line ``RUN FAILED: <reason>`` and raises; a run that completed
# without a site for more rounds than max-missed-share allows logs a last line
# ``RUN DEGRADED: <reason>`` (fedefc_server/summary.py); one that stopped because a
# restarted SuperLink may have lost a round's messages logs ``RUN INTERRUPTED: <reason>``
# and raises, to be resumed (fedefc_server/link_watch.py).
FAILED_LINE = re.compile(r"RUN FAILED: (.*)")
DEGRADED_LINE = re.compile(r"RUN DEGRADED: (.*)")
INTERRUPTED_LINE = re.compile(r"RUN INTERRUPTED: (.*)")
ERROR_LINE = re.compile(r"\b(ERROR|Error|Exception)\b")
# The last line of a Python traceback: the exception's type (with its module) and text,
# e.g. "fedefc_cli.app_signing.UntrustedAppError: the app is not signed ...". A ServerApp
# that raised logs its traceback, then Flower's ``Exit Code: 201`` (any exception), which
# names no cause; Flower's status details say ``ServerApp failed with exception: TEXT``.
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
EXIT_CODE_LINE = re.compile(r"\bExit Code: \d+")
SERVERAPP_RAISED = "ServerApp failed with exception: "


@dataclass(frozen=True)
class RunOutcome:
    """How a submitted run ended: Flower's status and, if the log says so, why it failed."""

    run_id: str
    status: str  # as ``flwr ls`` reports it
    # the last ``RUN FAILED:`` line's reason, else (a run that did not complete) its
    # ``RUN INTERRUPTED:`` reason, the last error line, or Flower's status details
    failure: str | None
    degradation: str | None = None  # the ``RUN DEGRADED:`` line's reason
    superlink_lost: str | None = None  # when the SuperLink was seen not answering, if it was
    last_round: int = 0  # the last round its log reports recorded (0: none)
    app_failed: bool = False  # its log has a ``RUN FAILED:`` line: the app itself gave up

    @property
    def completed(self) -> bool:
        """Flower reports ``finished:completed`` and the log reports no failure and no
        degradation."""
        return (self.status == "finished:completed" and self.failure is None
                and self.degradation is None)

    @property
    def degraded(self) -> bool:
        """Flower reports ``finished:completed``, the log no failure but ``RUN DEGRADED``."""
        return (self.status == "finished:completed" and self.failure is None
                and self.degradation is not None)

    @property
    def interrupted(self) -> bool:
        """Flower reports the run failed after it recorded a round, and the app did not
        give up (no ``RUN FAILED:`` line): its ServerApp was stopped from outside (its
        SuperExec or the SuperLink exited or restarted), so resuming it from its
        checkpoint can complete it (docs/DEPLOYMENT.md, "Resuming a run")."""
        return self.status == "finished:failed" and not self.app_failed and self.last_round > 0

    @property
    def verdict(self) -> str:
        """``finished:completed`` for a good run only; a run that Flower calls completed
        but whose log reports ``RUN FAILED`` or ``RUN DEGRADED`` says so."""
        if self.status == "finished:completed" and self.failure is not None:
            return f"finished:completed but RUN FAILED: {self.failure}"
        if self.degraded:
            return f"finished:completed but RUN DEGRADED: {self.degradation}"
        return self.status


def last_reason(lines: list[str], pattern: re.Pattern) -> str | None:
    """The reason of the last line of a run's log that ``pattern`` (one of the
    ServerApp's ``RUN ...:`` lines) matches, if any."""
    for line in reversed(lines):
        if match := pattern.search(line):
            return match.group(1).strip()
    return None


def degradation_reason(lines: list[str]) -> str | None:
    """The last ``RUN DEGRADED:`` reason of a run's log, if any."""
    return last_reason(lines, DEGRADED_LINE)


def last_round(lines: list[str]) -> int:
    """The last round a run's log reports recorded (``[round t/T]``, t >= 1), else 0."""
    rounds = [int(m.group(1)) for line in lines for m in [ROUND_LINE.search(line)] if m]
    return max(rounds, default=0)


def failure_reason(lines: list[str], status: str) -> str | None:
    """The last ``RUN FAILED:`` reason of a run's log; for a run Flower did not report
    completed, else its ``RUN INTERRUPTED:`` reason (the app stopped to be resumed), else
    the exception the ServerApp raised (its traceback's last line: ``UntrustedAppError:
    the app is not signed ...``), else the last line that names an error, Flower's
    ``Exit Code: N`` lines left out (they name no cause), or None."""
    failed = last_reason(lines, FAILED_LINE)
    if failed is not None or status == "finished:completed":
        return failed
    interrupted = last_reason(lines, INTERRUPTED_LINE)
    if interrupted is not None:
        return interrupted
    raised = [f"{m.group(1)}: {m.group(2).strip()}" for line in lines
              if (m := EXCEPTION_LINE.match(line.strip()))]
    if raised:
        return raised[-1]
    errors = [line.strip() for line in lines
              if ERROR_LINE.search(line) and not EXIT_CODE_LINE.search(line)]
    return errors[-1] if errors else None


# a terminal's colour codes, which Flower's logger writes whatever its output is
COLOUR = re.compile(rb"\x1b\[[0-9;]*m")


def copy_lines(stream, out, keep_colour: bool, shown: list[str] | None = None,
               view: LogView | None = None, full=None) -> list[str]:
    """Copy a process's output ``stream`` line by line to ``out`` (a binary file), its
    colour codes and a progress line after each round (:mod:`.progress`) only when
    ``keep_colour`` (a terminal); the lines as text, without colour codes. ``shown``: the
    lines of the same log copied before (a log followed again from its start): a line
    equal to the one at its place there is not copied again. ``view``: what ``out``
    shows of the log (:class:`.log_view.LogView`: tracebacks, Flower's exit blocks and
    repeated lines folded); ``full``: a binary file that gets every line, as it came
    but for its colour codes."""
    lines: list[str] = []
    shown = shown or []
    progress = RoundProgress() if keep_colour else None

    def show(items: list[str | None], raw: bytes, plain: bytes, text: str) -> None:
        for item in items:
            if item is not None:
                out.write(f"{item}\n".encode())
                continue
            out.write(raw if keep_colour else plain)
            note = progress.after(text) if progress is not None else None
            if note:
                out.write(f"\x1b[2m{note}\x1b[0m\n".encode())
        out.flush()

    for raw in stream:
        plain = COLOUR.sub(b"", raw)
        text = plain.decode(errors="replace").rstrip("\n")
        if len(lines) >= len(shown) or shown[len(lines)] != text:
            if full is not None:
                full.write(plain)
            show(view.feed(text) if view is not None else [None], raw, plain, text)
        lines.append(text)
    if view is not None:
        show(view.close(), b"", b"", "")
    if full is not None:
        full.flush()
    return lines


def to_terminal(out) -> bool:
    """Whether output meant for ``out`` (None: this process's stdout) reaches a terminal."""
    return out is None and sys.stdout.isatty()


def _follow_log(connection: str, run_id: str, env: dict[str, str], cwd: Path, out,
                timeout: float | None, shown: list[str] | None = None) -> list[str]:
    """``flwr log RUN_ID --stream`` until the stream ends (at most ``timeout`` seconds;
    None: no limit), copied to ``out`` (a binary file) or shown on stdout (colour codes
    only on a terminal; folded: :class:`.log_view.LogView`, the whole text being
    Flower's), but for the ``shown`` lines of an earlier stream of it
    (:func:`copy_lines`); returns its lines."""
    proc = subprocess.Popen([flower_bin("flwr"), "log", run_id, connection, "--stream"],
                            env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout, proc.kill) if timeout is not None else None
    if timer is not None:
        timer.start()
    view = LogView(f"flwr log {run_id} {connection}") if out is None else None
    try:
        lines = copy_lines(proc.stdout, out if out is not None else sys.stdout.buffer,
                           to_terminal(out), shown, view)
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if proc.returncode == -signal.SIGKILL:
        raise LaunchError(f"run {run_id} did not end within {timeout:.0f} s")
    return lines


def submit_run(connection: str, run_config: dict[str, Any], env: dict[str, str], cwd: Path,
               app_dir: Path = APP_DIR, log: Path | None = None, timeout: float | None = None,
               sign_key: tuple[str, str] | None = None,
               say: Callable[[str], None] | None = None,
               reconnect_s: float | None = None) -> RunOutcome:
    """``flwr run`` the app (signed with ``sign_key`` = (private key file, key id) when
    given: :mod:`.app_signing`), follow its log until it ends (to ``log``, else stdout;
    :func:`follow_to_end`: however long it runs, unless ``timeout`` seconds) and return
    how it ended; ``say`` is told each step as it starts. A SuperLink that stops
    answering meanwhile is waited for ``reconnect_s`` (default :data:`RECONNECT_S`)."""
    say = say or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="fedefc-submit-") as tmp:
        cfg_file = write_run_config(Path(tmp) / "run-config.toml", run_config)
        if sign_key:
            say(f"signing the app and this run's config with key {sign_key[1]!r}")
            from flwr.common.config import parse_config_args  # lazy: flwr, 0.5 s of CPU

            from .app_signing import stage_signed_app  # lazy: flwr's CLI, 0.8 s of CPU
            app_dir = stage_signed_app(app_dir, parse_config_args([str(cfg_file)]),
                                       sign_key[0], sign_key[1], Path(tmp) / "app")
        say(f"packing the app and sending it to the SuperLink of {connection!r} (flwr run)")
        if not sign_key:  # signed: staged with its signature
            app_dir = stage_app(app_dir, Path(tmp) / "app")
        res = flwr_json(["run", str(app_dir), connection, "--run-config", str(cfg_file)],
                        env, cwd)
    if not res.get("success") or not res.get("run-id"):
        raise LaunchError(f"flwr run was refused: {res}")
    run_id = str(res["run-id"])
    say(f"run {run_id} submitted; its log follows (flwr log {run_id} {connection} --stream)")
    with open_private(log, "ab") if log else contextlib.nullcontext() as out:
        lines, row, lost = follow_to_end(connection, run_id, env, cwd, out, timeout, say,
                                         reconnect_s)
    status = str(row.get("status"))
    failure = failure_reason(lines, status)
    if failure is None and status != "finished:completed":
        failure = flower_reason(row)
    return RunOutcome(run_id, status, failure, degradation_reason(lines), lost,
                      last_round(lines), any(FAILED_LINE.search(line) for line in lines))


def follow_to_end(connection: str, run_id: str, env: dict[str, str], cwd: Path, out,
                  timeout: float | None, say: Callable[[str], None],
                  reconnect_s: float | None) -> tuple[list[str], dict[str, Any], str | None]:
    """Follow the run's log until the run has finished and its log was read to its end:
    (its lines, its last ``flwr ls`` row, when the SuperLink was seen not answering).

    A stream can end before the run does: with a SuperLink that restarted (the
    ServerApp outlived it: Flower's Runtime API calls retry, and the run went on, maybe
    to its end while the stream was gone), or with a Control API call that failed on a
    busy SuperLink while the run goes on. Either way the log is followed again
    (what was shown is not shown twice), as long as ``flwr ls`` says the run is not
    finished, and once more where a finished run's stream was cut, so that its last
    lines (RUN DEGRADED, RUN FAILED, the summary) are read; a run that is not finished
    is asked about for :data:`SETTLE_S` first (:func:`final_row`), which paces the
    following again. A log that already holds the ServerApp's ``RUN FAILED`` line is
    not followed again nor waited on: the run's outcome is decided, and on a busy
    coordinator Flower takes a while to mark it finished (docs/DEPLOYMENT.md, "On a busy
    coordinator"); its row is taken as ``flwr ls`` gives it at once. Only ``timeout``
    (None: none) ends the following of a live run."""
    deadline = None if timeout is None else time.monotonic() + timeout
    lines: list[str] = []
    lost: str | None = None
    finished_before = False  # the run had finished when this stream began: it is whole
    while True:
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        lines = _follow_log(connection, run_id, env, cwd, out, left, lines) or lines
        decided = any(FAILED_LINE.search(line) for line in lines)
        row, gone = final_row(connection, run_id, env, cwd, reconnect_s,
                              0.0 if decided else SETTLE_S)
        cut = stream_lost(lines)
        lost = lost or gone or cut
        finished = str(row.get("status", "")).startswith("finished")
        if decided or (finished and (finished_before or not cut)) or (
                deadline is not None and time.monotonic() >= deadline):
            return lines, row, lost
        finished_before = finished
        why = ("the SuperLink answers again" if cut or gone else
               "its log stream ended early")
        say(f"{why} and run {run_id} is {row.get('status')}: following its log again")


def stream_lost(lines: list[str]) -> str | None:
    """When a run's log stream ended because the SuperLink stopped answering, if it did."""
    if any(LOST_LINE in line for line in lines[-5:]):
        return f"{time.strftime('%H:%M:%S')} or before (the log stream ended so)"
    return None


SETTLE_S = 10.0  # how long a stream's end waits for the run's status to say finished


def final_row(connection: str, run_id: str, env: dict[str, str], cwd: Path,
              reconnect_s: float | None = None, settle: float = SETTLE_S
              ) -> tuple[dict[str, Any], str | None]:
    """(the run's ``flwr ls`` row once it has finished, or after ``settle`` seconds (0:
    the first row); when the SuperLink was seen not answering, if it was). A SuperLink
    that stopped answering (its log stream ended with it) is waited for ``reconnect_s``
    (default :data:`RECONNECT_S`); :class:`SuperLinkGone` if it does not come back."""
    reconnect_s = RECONNECT_S if reconnect_s is None else reconnect_s
    deadline, lost, lost_at = time.monotonic() + settle, None, None
    while True:
        try:
            row = run_row(connection, run_id, env, cwd)
        except SuperLinkGone as gone:
            lost, lost_at = lost or gone.when, lost_at or time.monotonic()
            if time.monotonic() - lost_at > reconnect_s:
                raise SuperLinkGone(connection, lost) from None
            time.sleep(min(5.0, reconnect_s / 10))
            continue
        if str(row.get("status", "")).startswith("finished") or time.monotonic() >= deadline:
            return row, lost
        time.sleep(1)


# Flower's own state in this process's memory, no sqlite file: a private simulation
# SuperLink is never restarted, so it keeps nothing worth a file, and its state cannot
# be "locked" by a busy machine (docs/RELIABILITY.md, "The SuperLink's database under
# load")
MEMORY_STATE = ":flwr-in-memory:"


class LocalSimulation(ProcessGroup):
    """A private simulation SuperLink on loopback ports and its FLWR_HOME; stopped, with
    everything it started, on exit. Its clients run on a private Ray, or on the nodes of
    the Ray cluster at ``ray_address`` (:mod:`.ray_cluster`)."""

    CONNECTION = "fedefc-sim"

    def __init__(self, work_dir: Path, ray_address: str | None = None):
        super().__init__()
        self.work_dir = work_dir
        self.flwr_home = work_dir / "flwr-home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.control_port = free_port()
        self.env = {**flwr_env(self.flwr_home), **ray_env(ray_address)}
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n[superlink.{self.CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')

    @property
    def log_path(self) -> Path:
        return self.work_dir / "superlink.log"

    def _start(self) -> None:
        self.procs.start("flower-superlink", [
            flower_bin("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1",
            "--port", str(self.port), "--control-api-address", f"127.0.0.1:{self.control_port}",
            "--disable-runtime-dependency-installation", "--database", MEMORY_STATE],
            self.env, self.work_dir, self.log_path)
        wait_for_port("127.0.0.1", self.port, self.procs)

    def run(self, run_config: dict[str, Any], num_supernodes: int, client_cpus: int,
            client_gpus: float, app_dir: Path = APP_DIR, log_path: Path | None = None,
            full_log: Path | None = None) -> tuple[int, str]:
        """Submit the app, stream its log (to ``log_path``; else shown on stdout, folded
        (:class:`.log_view.LogView`), its whole text appended to ``full_log``), and
        return (run id, status) once it ends."""
        cfg_file = write_run_config(self.work_dir / "run-config.toml", run_config)
        fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={int(client_cpus)} "
               f"client-resources-num-gpus={client_gpus}")
        shows = log_path is None and full_log is not None
        with (tempfile.TemporaryDirectory(prefix="app-", dir=self.work_dir) as staged,
              open_private(log_path, "ab") if log_path else contextlib.nullcontext() as out,
              open_private(full_log, "ab") if shows else contextlib.nullcontext() as full):
            cmd = [flower_bin("flwr"), "run", str(stage_app(app_dir, Path(staged))),
                   self.CONNECTION, "--stream", "--run-config", str(cfg_file),
                   "--federation-config", fed]
            proc = subprocess.Popen(cmd, env=self.env, cwd=self.work_dir,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            copy_lines(proc.stdout, out if out is not None else sys.stdout.buffer,
                       to_terminal(out), view=LogView(str(full_log)) if shows else None,
                       full=full)
            code = proc.wait()
        if code != 0:
            raise LaunchError(f"flwr run exited with code {code}")
        return self.latest_status()

    def latest_status(self) -> tuple[int, str]:
        runs = flwr_json(["ls", self.CONNECTION], self.env, self.work_dir).get("runs")
        if not runs:
            raise LaunchError(f"flwr ls lists no run; see {self.log_path}")
        last = max(runs, key=lambda r: r.get("created-at", ""))
        status, details = str(last["status"]), last.get("status-details")
        if status != "finished:completed" and details:  # Flower's reason, e.g. the exception
            status = f"{status} ({details})"
        return int(last["run-id"]), status
