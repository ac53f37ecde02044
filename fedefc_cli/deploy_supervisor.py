"""``fedefc deploy superlink`` and ``fedefc deploy supernode``: one machine's processes,
a SuperLink or a SuperNode and the SuperExec that runs its apps (:class:`Pair`), started
in the foreground and kept running by a :class:`Supervisor` (Ctrl-C stops both);
``fedefc deploy service`` writes the same pairs as systemd units (:mod:`.services`).

The process topology (docs/DEPLOYMENT.md; deploy/compose.yml runs the same)::

    SuperLink machine     flower-superlink --isolation process  + flower-superexec (ServerApps)
    every client machine  flower-supernode --isolation process  + flower-superexec (ClientApps)
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deploy_flags import (
    TLSFiles,
    check_private,
    superexec_command,
    superlink_flags,
    supernode_flags,
)
from .errors import UsageError
from .flower import COLOUR, flwr_env, free_port
from .flower_repairs import command as repaired
from .procs import Processes, wait_for_port

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "fedefc" / "node-data"
STATE_ROOT = Path.home() / ".fedefc"  # default state folders (outside any checkout)


def state_dir(folder: str | Path) -> tuple[Path, dict[str, str]]:
    """A SuperLink's or SuperNode's own folder (made absolute, created) and the
    environment of its processes (FLWR_HOME inside it), as on its own machine."""
    path = Path(folder).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path, flwr_env(path / "flwr-home")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_port_free(host: str, port: int, flag: str) -> None:
    """UsageError when something already listens on ``host:port`` (e.g. the SuperLink of
    an earlier start): the new process would fail, or its SuperExec would dial the old one."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise UsageError(
                f"{flag} {port} on {host} is in use ({err.strerror}): is a SuperLink or "
                "SuperNode started earlier still running? Stop it first (Ctrl-C, or kill "
                "its PID; the quick start's own processes: kill $(jobs -p)), or choose "
                f"another {flag}") from None


# How long the SuperLink counts a SuperNode online after its last heartbeat (Flower 1.42:
# HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL = 2 x 30 s), and a margin: a node that
# stopped without signing off (killed; or its SuperLink restarted meanwhile) is refused
# activation until then, with the code an unregistered key gets (2004).
ONLINE_PATIENCE_S = 65.0
ACTIVATED = "SuperNode ID:"  # Flower's line once the SuperLink activated the node


def activation_refused(text: str) -> bool:
    """Whether a SuperNode's log says the SuperLink refused to activate it (code 2004)."""
    return "code: 2004" in text


def supernode_wait_out(text: str, earlier: str, auth_key: str | None,
                       superlink: str) -> tuple[float, str] | None:
    """(seconds to wait, what to say) when the SuperNode's exit is one that waiting
    clears, else None. Flower's SuperLink refuses to activate a node (code 2004) both
    for a key that is not registered and for a node whose earlier session still counts
    as online: a node that stopped without signing off stays online until 60 s after its
    last heartbeat. A key that this state folder's earlier log shows activated
    (``earlier``) was registered, so the refusal is the earlier session's: waited out."""
    if not (auth_key and activation_refused(text) and ACTIVATED in earlier):
        return None
    return ONLINE_PATIENCE_S, (
        f"the SuperLink at {superlink} refused to activate this SuperNode (code 2004) while "
        "its earlier session still counts as online (this key was activated before, so it "
        "is registered; a node that stopped without signing off, killed or cut off from a "
        "restarting SuperLink, counts as online until 60 s after its last heartbeat): "
        f"waiting {ONLINE_PATIENCE_S:.0f} s for that session to expire, then starting it "
        "again")


def supernode_exit_hint(text: str, earlier: str, auth_key: str | None,
                        superlink: str) -> str | None:
    """What a SuperNode's exit means, where Flower's own message misleads: exit 305 reads
    "could not establish a connection" even when the SuperLink refused the node's key,
    or refused it because its earlier session still counts as online
    (:func:`supernode_wait_out`, after which this is said)."""
    if activation_refused(text) and auth_key:
        before = ("; this key was activated before, and the earlier session of this node "
                  "has expired by now" if ACTIVATED in earlier else "")
        return (f"the SuperLink at {superlink} refused to activate this SuperNode (code "
                f"2004){before}: either its public key {auth_key}.pub is not registered "
                "there, or another SuperNode with the same key is online (one key per node). "
                "The SuperLink's log says which: 'No SuperNode found with the given public "
                "key' (not registered) or 'SuperNode with node ID N could not be activated' "
                "(online elsewhere). Fix: the operator registers the key with "
                f"deploy/register-nodes.sh CONNECTION {auth_key}.pub ('Public key already in "
                "use' means it is registered: then stop the other node that uses it), then "
                "start this SuperNode again")
    if "Exit Code: 305" in text:
        return (f"the SuperNode could not connect to the SuperLink at {superlink}: check that "
                "it runs and that this machine reaches that address; with TLS, that --ca-cert "
                "is the CA that signed the SuperLink's certificate and the host name is among "
                "its names (deploy/gen-certs.sh); with --node-auth on the SuperLink, that this "
                "node has --auth-key")
    return None


class Supervisor:
    """Keeps a machine's processes running (the SuperLink or a SuperNode, and its
    SuperExec): one that exits after running at least ``settle_s`` is started again on
    its own, the others left running (a SuperExec that fails on a busy SuperLink does not
    take the SuperLink down), after a pause that doubles from ``pause_s`` with each
    restart, and so is one killed by a signal however soon (it had started: the OOM
    killer, an operator's kill); one that exits by itself sooner (it could not start: a
    flag, a port, a key), or more than ``max_restarts`` times in ``window_s``, stops them
    all, unless ``wait_out(name, text, earlier)`` names a wait that clears its cause
    (:func:`supernode_wait_out`): it is then started again after that wait, once in a
    row. Every exit is reported with the end of its log (its colour codes only on a
    terminal) and ``hint(name, text, earlier)``, when that explains it; ``text`` is what
    the process logged this time, ``earlier`` what its log held before."""

    def __init__(self, procs: Processes, hint=None, settle_s: float = 30.0,
                 pause_s: float = 2.0, max_restarts: int = 5, window_s: float = 600.0,
                 clock=time.monotonic, wait_out=None):
        self.procs = procs
        self.hint = hint
        self.wait_out = wait_out
        self.settle_s = settle_s
        self.pause_s = pause_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.started = {name: clock() for name, _, _ in procs.running}
        self.offsets = {name: self._size(log) for name, _, log in procs.running}
        self.restarts: dict[str, list[float]] = {}
        self.waited: set[str] = set()  # started again after a wait, and not settled since

    @staticmethod
    def _size(log: Path | None) -> int:
        return log.stat().st_size if log and log.exists() else 0

    def texts(self, name: str, log: Path | None) -> tuple[str, str]:
        """(what process ``name`` logged since it was last started, what its log held
        before)."""
        data = log.read_bytes() if log and log.exists() else b""
        start = self.offsets.get(name, 0)
        return (data[start:].decode(errors="replace"),
                data[:start].decode(errors="replace"))

    def report(self, name: str, code: int | None, log: Path | None, text: str,
               explained: str | None) -> None:
        tail = "\n".join(text.splitlines()[-15:])
        if not sys.stderr.isatty():  # Flower's colour codes, for a terminal only
            tail = COLOUR.sub(b"", tail.encode()).decode(errors="replace")
        print(f"fedefc deploy: {name} exited with code {code} at "
              f"{time.strftime('%H:%M:%S')}; the end of its log {log}:\n{tail}",
              file=sys.stderr, flush=True)
        if explained:
            print(f"fedefc deploy: {explained}", file=sys.stderr, flush=True)

    def _start_again(self, name: str, pause: float) -> None:
        time.sleep(pause)
        log = self.procs.specs[name][3]
        self.offsets[name] = self._size(log)
        self.procs.restart(name)
        self.started[name] = self.clock()

    def step(self) -> int | None:
        """Look once: restart what exited and may be restarted; the exit code of the
        whole when a process must not be (1), else None."""
        for name, proc, log in list(self.procs.running):
            if proc.poll() is None:
                continue
            text, earlier = self.texts(name, log)
            now = self.clock()
            soon = now - self.started[name] < self.settle_s and proc.returncode >= 0
            wait = (self.wait_out(name, text, earlier) if soon and self.wait_out
                    and name not in self.waited else None)
            self.report(name, proc.returncode, log, text, wait[1] if wait else
                        self.hint(name, text, earlier) if self.hint else None)
            recent = [t for t in self.restarts.get(name, []) if now - t < self.window_s]
            self.restarts[name] = [*recent, now]
            if wait is not None:
                self.waited.add(name)
                self._start_again(name, wait[0])
                continue
            if soon:
                print(f"fedefc deploy: {name} exited {now - self.started[name]:.0f} s after "
                      "it started, so starting it again would fail again: stopping all",
                      file=sys.stderr, flush=True)
                return 1
            self.waited.discard(name)  # it had settled: a later refusal may be waited out
            if len(recent) >= self.max_restarts:
                print(f"fedefc deploy: {name} exited {len(recent) + 1} times in "
                      f"{self.window_s:.0f} s: stopping all", file=sys.stderr, flush=True)
                return 1
            pause = self.pause_s * 2 ** len(recent)
            print(f"fedefc deploy: starting {name} again in {pause:.0f} s (restart "
                  f"{len(recent) + 1} of at most {self.max_restarts} in "
                  f"{self.window_s:.0f} s); the others keep running", file=sys.stderr,
                  flush=True)
            self._start_again(name, pause)
        return None


def _foreground(procs: Processes, hint=None, wait_out=None) -> int:
    """Supervise the processes (:class:`Supervisor`) until SIGINT/SIGTERM arrives or one
    must not be restarted; then stop all and return the exit code."""
    stop = {"signal": False}

    def handler(signum, frame):  # noqa: ARG001
        stop["signal"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    supervisor = Supervisor(procs, hint, wait_out=wait_out)
    code = 0
    try:
        while not stop["signal"]:
            outcome = supervisor.step()
            if outcome is not None:
                code = outcome
                break
            time.sleep(0.5)
    finally:
        procs.stop()
    return code


@dataclass(frozen=True)
class Pair:
    """A SuperLink or SuperNode and the SuperExec that runs its apps, as one machine runs
    them: what ``fedefc deploy superlink|supernode`` starts in the foreground and what
    ``fedefc deploy service`` writes as systemd units (the same commands)."""

    name: str  # "superlink" or "supernode-K"
    program: str  # "flower-superlink" or "flower-supernode": what ``main`` runs
    main: list[str]  # flower-superlink / flower-supernode and its flags
    superexec: list[str]  # the SuperExec's command (superexec_command)
    state: Path  # its folder (FLWR_HOME, database, logs)
    listen: tuple[str, int]  # where the SuperExec dials the main process
    summary: str  # one line: what runs, where it listens

    @property
    def env(self) -> dict[str, str]:
        return flwr_env(self.state / "flwr-home")


def superlink_pair(args: argparse.Namespace, state: Path | None = None) -> Pair:
    """The SuperLink machine's processes for ``fedefc deploy superlink`` flags."""
    tls = TLSFiles.in_dir(Path(args.certs).expanduser()) if args.certs else None
    if tls is None and not _is_loopback(args.host) and not args.allow_insecure:
        raise UsageError(
            f"refusing to serve the SuperLink without TLS on --host {args.host}: its port "
            "also carries the Control and Runtime APIs. Give --certs (deploy/gen-certs.sh), "
            "or --allow-insecure on a trusted private network only")
    secret = (check_private(args.superexec_secret, "--superexec-secret")
              if args.superexec_secret else None)
    state = Path(state or args.state_dir or STATE_ROOT / "superlink").expanduser().resolve()
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # SAN has it
    main = repaired("superlink", superlink_flags(
        args.host, args.port, str(state / "state.db"), tls, args.node_auth, secret))
    superexec = superexec_command(f"{local}:{args.port}", tls.ca_cert if tls else None,
                                  secret, args.trusted_keys, state)
    summary = (f"SuperLink on {args.host}:{args.port} ({'TLS' if tls else 'insecure'}"
               f"{', SuperNode authentication' if args.node_auth else ''}"
               f"{', signed apps only' if args.trusted_keys else ''})")
    return Pair("superlink", "flower-superlink", main, superexec, state, (local, args.port),
                summary)


def supernode_pair(args: argparse.Namespace, port: int, state: Path | None = None,
                   service: bool = False) -> Pair:
    """A client machine's processes for ``fedefc deploy supernode`` flags; its Runtime
    API on 127.0.0.1:``port``. The prepared-data cache defaults to
    :data:`DEFAULT_CACHE_DIR`, or for a ``service`` to ``STATE/cache``."""
    state = Path(state or args.state_dir or STATE_ROOT / f"supernode-{args.partition_id}")
    state = state.expanduser().resolve()
    cache = args.cache_dir or (state / "cache" if service else DEFAULT_CACHE_DIR)
    node_config: dict[str, Any] = {"partition-id": args.partition_id,
                                   "num-partitions": args.num_partitions,
                                   "cache-dir": str(Path(cache).expanduser().resolve())}
    if args.data_path:
        node_config["data-path"] = str(Path(args.data_path).expanduser().resolve())
        if not Path(node_config["data-path"]).exists():
            raise UsageError(f"--data-path {node_config['data-path']} does not exist")
    ca = str(Path(args.ca_cert).expanduser().resolve()) if args.ca_cert else None
    key = check_private(args.auth_key, "--auth-key") if args.auth_key else None
    secret = (check_private(args.superexec_secret, "--superexec-secret")
              if args.superexec_secret else None)
    main = repaired("supernode", supernode_flags(args.superlink, node_config, "127.0.0.1",
                                                 port, ca, key, secret))
    superexec = superexec_command(f"127.0.0.1:{port}", None, secret, args.trusted_keys, state)
    summary = (f"SuperNode (partition-id {args.partition_id}) -> SuperLink {args.superlink}; "
               f"Runtime API 127.0.0.1:{port}"
               f"{'; signed apps only' if args.trusted_keys else ''}")
    return Pair(f"supernode-{args.partition_id}", "flower-supernode", main, superexec, state,
                ("127.0.0.1", port), summary)


def cmd_superlink(args: argparse.Namespace) -> int:
    pair = superlink_pair(args)
    check_port_free(args.host, args.port, "--port")
    pair.state.mkdir(parents=True, exist_ok=True)
    print(f"fedefc deploy: {pair.summary}; logs {pair.state}/superlink.log, superexec.log; "
          "Ctrl-C stops it", flush=True)
    return _run_pair(pair)


def cmd_supernode(args: argparse.Namespace) -> int:
    port = args.runtime_port or free_port()
    check_port_free("127.0.0.1", port, "--runtime-port")
    pair = supernode_pair(args, port)
    pair.state.mkdir(parents=True, exist_ok=True)
    print(f"fedefc deploy: {pair.summary}; logs {pair.state}/supernode.log, superexec.log; "
          "Ctrl-C stops it", flush=True)
    key = check_private(args.auth_key, "--auth-key") if args.auth_key else None

    def hint(name: str, text: str, earlier: str) -> str | None:
        return (supernode_exit_hint(text, earlier, key, args.superlink)
                if name == "flower-supernode" else None)

    def wait_out(name: str, text: str, earlier: str) -> tuple[float, str] | None:
        return (supernode_wait_out(text, earlier, key, args.superlink)
                if name == "flower-supernode" else None)

    return _run_pair(pair, hint, wait_out)


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _run_pair(pair: Pair, hint=None, wait_out=None) -> int:
    """Start the pair's main process (logging to ``state/<superlink|supernode>.log``) and,
    once it listens, its SuperExec; then run both in the foreground. A signal while they
    start stops whatever started."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    procs = Processes()
    name = pair.program
    try:
        procs.start(name, pair.main, pair.env, pair.state,
                    pair.state / f"{name.removeprefix('flower-')}.log")
        wait_for_port(*pair.listen, procs)
        procs.start("flower-superexec", pair.superexec, pair.env, pair.state,
                    pair.state / "superexec.log")
    except BaseException:
        procs.stop()
        raise
    return _foreground(procs, hint, wait_out)
