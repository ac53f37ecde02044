"""Run FedEFC across machines: a SuperLink and SuperNodes, each with a SuperExec.

The process topology (docs/DEPLOYMENT.md; deploy/compose.yml runs the same)::

    SuperLink machine     flower-superlink --isolation process  + flower-superexec (ServerApps)
    every client machine  flower-supernode --isolation process  + flower-superexec (ClientApps)

:func:`superlink_flags`, :func:`superexec_flags` and :func:`supernode_flags` are the one
place where these flags are written: the ``fedefc deploy`` commands below,
:class:`LocalDeployment` (tests and benchmark, everything on 127.0.0.1) and the compose
test use them all.

``fedefc deploy`` (or the deploy/*.sh wrappers):

- ``superlink``: the SuperLink and its SuperExec in the foreground (Ctrl-C stops both);
- ``supernode``: a SuperNode and its SuperExec in the foreground;
- ``service``: the same two processes as systemd units (:mod:`.services`);
- ``connection``: add a ``[superlink.NAME]`` entry to ``$FLWR_HOME/config.toml``;
- ``register``: register SuperNode public keys with a SuperLink (node authentication);
- ``submit``: ``flwr run`` the app on a connection (signed with ``--sign-key``:
  :mod:`.app_signing`), refused while another run runs there; follow its log, and exit
  non-zero, with the reason, unless it completed (:class:`.flower.RunOutcome`);
- ``fetch``: copy a run's out-dir from the SuperLink machine and summarize it;
- ``export``: write every partition of a run config as a private-data ``.npz``.

Private keys and SuperExec secrets must be the owner's alone: ``superlink`` and
``supernode`` refuse one that other users can read or write (:func:`check_private`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from common.data_files import write_npz
from common.errors import ConfigError
from common.results import atomic_write_json

from .app_signing import SigningKeyError
from .end_of_run import tell_run
from .errors import EXIT_DEGRADED, LaunchError, UsageError
from .flower import (
    COLOUR,
    RunOutcome,
    SuperLinkGone,
    active_runs,
    flower_bin,
    flwr_env,
    flwr_json,
    free_port,
    submit_run,
)
from .flower_repairs import command as repaired
from .prepare_data import write_image_folder
from .procs import Processes, ProcessGroup, wait_for_port
from .run_configs import APP_DIR, inexact_resume_note, merged_config, resume_config, toml_value
from .trusted_apps import superexec_argv

DEPLOY_DIR = APP_DIR / "deploy"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "fedefc" / "node-data"
STATE_ROOT = Path.home() / ".fedefc"  # default state folders (outside any checkout)


def check_private(path: str | Path, what: str) -> str:
    """``path`` made absolute, after checking that it is a file only its owner can read or
    write (mode 0600 or 0400); UsageError naming the file and the fix otherwise."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UsageError(f"{what} {file} does not exist (or is not a file)")
    mode = stat.S_IMODE(file.stat().st_mode)
    if mode & 0o077:
        raise UsageError(f"{what} {file} is readable or writable by other users (mode "
                         f"{mode:04o}); make it the owner's alone: chmod 600 {file}")
    return str(file)


# -- the flags of each process ----------------------------------------------------------
@dataclass(frozen=True)
class TLSFiles:
    """The SuperLink's TLS files, as deploy/gen-certs.sh names them."""

    ca_cert: str
    server_cert: str
    server_key: str

    @classmethod
    def in_dir(cls, folder: str | Path) -> TLSFiles:
        root = Path(folder).resolve()
        files = cls(str(root / "ca.crt"), str(root / "server.pem"), str(root / "server.key"))
        missing = [f for f in (files.ca_cert, files.server_cert, files.server_key)
                   if not Path(f).is_file()]
        if missing:
            raise UsageError(f"TLS files missing: {', '.join(missing)}; create them with "
                             f"deploy/gen-certs.sh {root} <host name> <IP>")
        check_private(files.server_key, "the SuperLink's TLS private key")
        return files


def superlink_flags(host: str, port: int, database: str, tls: TLSFiles | None = None,
                    node_auth: bool = False, superexec_secret: str | None = None) -> list[str]:
    """flower-superlink: one port for the Fleet, Control and Runtime APIs; ServerApps run
    by a separate SuperExec (``--isolation process``); no runtime ``uv sync``."""
    if node_auth and tls is None:
        raise UsageError("SuperNode authentication needs TLS: give the certificates too")
    flags = ["--isolation", "process", "--host", host, "--port", str(port),
             "--database", database, "--disable-runtime-dependency-installation"]
    if tls is None:
        flags.append("--insecure")
    else:
        flags += ["--ssl-ca-certfile", tls.ca_cert, "--ssl-certfile", tls.server_cert,
                  "--ssl-keyfile", tls.server_key]
    if node_auth:
        flags.append("--enable-supernode-auth")
    if superexec_secret:
        flags += ["--superexec-auth-secret-file", superexec_secret]
    return flags


def superexec_flags(runtime_address: str, ca_cert: str | None = None,
                    superexec_secret: str | None = None) -> list[str]:
    """flower-superexec: starts the ServerApp / ClientApp processes of one SuperLink or
    SuperNode, whose Runtime API is at ``runtime_address`` (TLS when ``ca_cert``)."""
    flags = ["--runtime-api-address", runtime_address]
    flags += ["--root-certificates", ca_cert] if ca_cert else ["--insecure"]
    if superexec_secret:
        flags += ["--superexec-auth-secret-file", superexec_secret]
    return flags


def render_node_config(node_config: dict[str, Any]) -> str:
    """``--node-config`` text: ``key=value`` pairs with TOML values (strings quoted)."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in node_config.items())


def supernode_flags(superlink: str, node_config: dict[str, Any], host: str, port: int,
                    ca_cert: str | None = None, auth_key: str | None = None,
                    superexec_secret: str | None = None) -> list[str]:
    """flower-supernode: connects to ``superlink``; its Runtime API (``host:port``) is for
    its own SuperExec only; ClientApps run by that SuperExec (``--isolation process``)."""
    if auth_key and not ca_cert:
        raise UsageError("SuperNode authentication needs TLS: give the CA certificate too")
    flags = ["--superlink", superlink, "--isolation", "process", "--host", host,
             "--port", str(port), "--node-config", render_node_config(node_config)]
    flags += ["--root-certificates", ca_cert] if ca_cert else ["--insecure"]
    if auth_key:
        flags += ["--auth-supernode-private-key", auth_key]
    if superexec_secret:
        flags += ["--superexec-auth-secret-file", superexec_secret]
    return flags


def superexec_command(runtime_address: str, ca_cert: str | None, superexec_secret: str | None,
                      trusted_keys: str | None, state: Path) -> list[str]:
    """The SuperExec's command line: ``flower-superexec`` with :func:`superexec_flags` and
    the repairs of :mod:`.flower_repairs`; with ``trusted_keys`` it runs only apps signed
    by one of them (:mod:`.trusted_apps`, its launchers in ``state/bin``)."""
    try:
        return superexec_argv(repaired("superexec", superexec_flags(
            runtime_address, ca_cert, superexec_secret)), trusted_keys, state)
    except SigningKeyError as err:
        raise UsageError(f"--trusted-keys: {err}") from None


# -- the flwr CLI side ----------------------------------------------------------------------
def write_connection(flwr_home: Path, name: str, address: str,
                     ca_cert: str | None = None) -> Path:
    """Add or replace ``[superlink.NAME]`` in ``flwr_home/config.toml`` (others kept)."""
    if ca_cert and not Path(ca_cert).is_absolute():
        raise UsageError(f"root certificate {ca_cert!r} must be an absolute path")
    path = flwr_home / "config.toml"
    config: dict[str, Any] = {}
    if path.exists():
        with open(path, "rb") as fh:
            config = tomllib.load(fh)
    links = config.setdefault("superlink", {})
    links[name] = ({"address": address, "root-certificates": ca_cert} if ca_cert
                   else {"address": address, "insecure": True})
    links.setdefault("default", name)
    flwr_home.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


# -- a whole federation on one machine ------------------------------------------------------
@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode of a :class:`LocalDeployment`."""

    node_config: dict[str, Any]
    auth_key: str | None = None  # private key; its public key is auth_key + ".pub"
    superexec_secret: str | None = None  # shared by this SuperNode and its SuperExec
    trusted_keys: str | None = None  # run only apps signed by these keys (app_signing)
    extra_flags: tuple[str, ...] = ()  # more flower-supernode flags


class LocalDeployment(ProcessGroup):
    """A federation on 127.0.0.1 with the deployment topology (module docstring).

    Every SuperLink/SuperNode pair gets its own folder and FLWR_HOME under ``work_dir``,
    as on its own machine; the ``flwr`` CLI gets another, holding the connection
    ``fedefc``. With ``tls`` the SuperLink serves TLS; with node keys it also requires
    SuperNode authentication, and the public keys are registered with
    deploy/register-nodes.sh before the SuperNodes start; ``link_secret`` is the
    SuperExec shared secret of the SuperLink pair. Every process is stopped by PID on
    exit, also when starting fails.
    """

    CONNECTION = "fedefc"

    def __init__(self, work_dir: Path, nodes: list[NodeSpec], tls: TLSFiles | None = None,
                 link_secret: str | None = None, link_trusted_keys: str | None = None):
        super().__init__()
        self.link_trusted_keys = link_trusted_keys
        self.work_dir = Path(work_dir).resolve()
        self.nodes = nodes
        self.tls = tls
        self.node_auth = any(n.auth_key for n in nodes)
        self.link_secret = link_secret
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cli_env = flwr_env(self.work_dir / "cli" / "flwr-home")
        self.cli_dir = self.work_dir / "cli"

    @property
    def ca_cert(self) -> str | None:
        return self.tls.ca_cert if self.tls else None

    def _start(self) -> None:
        folder, env = state_dir(self.work_dir / "superlink")
        self.procs.start("flower-superlink", [flower_bin("flower-superlink"), *superlink_flags(
            "127.0.0.1", self.port, str(folder / "state.db"), self.tls, self.node_auth,
            self.link_secret)], env, folder, folder / "superlink.log")
        wait_for_port("127.0.0.1", self.port, self.procs)
        self.procs.start("superlink's flower-superexec", superexec_command(
            self.address, self.ca_cert, self.link_secret, self.link_trusted_keys, folder),
            env, folder, folder / "superexec.log")
        self.cli_dir.mkdir(parents=True, exist_ok=True)
        write_connection(Path(self.cli_env["FLWR_HOME"]), self.CONNECTION, self.address,
                         self.ca_cert)
        if self.node_auth:
            self.register([f"{n.auth_key}.pub" for n in self.nodes if n.auth_key])
        for i, node in enumerate(self.nodes):
            self.start_node(f"node-{i}", node)

    def register(self, public_keys: list[str]) -> None:
        """Register SuperNode public keys with deploy/register-nodes.sh."""
        env = {**self.cli_env, "PATH": f"{Path(flower_bin('flwr')).parent}:{self.cli_env['PATH']}"}
        out = subprocess.run(["bash", str(DEPLOY_DIR / "register-nodes.sh"), self.CONNECTION,
                              *public_keys], env=env, cwd=self.cli_dir, capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise LaunchError(f"registering {public_keys} failed:\n{out.stdout}{out.stderr}")

    def start_node(self, name: str, node: NodeSpec) -> subprocess.Popen:
        """Start one SuperNode and its SuperExec (folder ``work_dir/name``)."""
        folder, env = state_dir(self.work_dir / name)
        port = free_port()
        proc = self.procs.start(f"{name} flower-supernode", repaired("supernode", [
            *supernode_flags(self.address, node.node_config, "127.0.0.1", port, self.ca_cert,
                             node.auth_key, node.superexec_secret), *node.extra_flags]),
            env, folder, folder / "supernode.log")
        self.procs.start(f"{name} flower-superexec", superexec_command(
            f"127.0.0.1:{port}", None, node.superexec_secret, node.trusted_keys, folder),
            env, folder, folder / "superexec.log")
        return proc

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink reports online."""
        res = flwr_json(["supernode", "ls", self.CONNECTION], self.cli_env, self.cli_dir)
        return sum(1 for n in res.get("nodes", []) if n.get("status") == "online")

    def wait_online(self, count: int, timeout: float = 120.0) -> None:
        """Wait until ``count`` SuperNodes are online (raise if a process dies first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.procs.check_alive()
            if self.online_nodes() >= count:
                return
            time.sleep(1.0)
        raise LaunchError(f"fewer than {count} SuperNodes online after {timeout:.0f} s")

    def submit(self, run_config: dict[str, Any], timeout: float = 1800.0,
               app_dir: Path = APP_DIR, sign_key: tuple[str, str] | None = None) -> RunOutcome:
        """Submit an app (this project's by default) with ``run_config``, signed with
        ``sign_key`` when given, once every SuperNode is online; return how it ended."""
        self.wait_online(len(self.nodes))
        return submit_run(self.CONNECTION, run_config, self.cli_env, self.cli_dir, app_dir,
                          log=self.cli_dir / "run.log", timeout=timeout, sign_key=sign_key)

    def run(self, run_config: dict[str, Any], timeout: float = 1800.0,
            sign_key: tuple[str, str] | None = None) -> tuple[str, str]:
        """Submit the app with ``run_config``; return (run id, verdict) once it ends: the
        verdict is ``finished:completed`` only for a run whose log reports no failure
        (:attr:`.flower.RunOutcome.verdict`)."""
        outcome = self.submit(run_config, timeout, sign_key=sign_key)
        return outcome.run_id, outcome.verdict


# -- the fedefc deploy commands ----------------------------------------------------------
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


def supernode_exit_hint(log_text: str, auth_key: str | None, superlink: str) -> str | None:
    """What a SuperNode's exit means, where Flower's own message misleads: exit 305 reads
    "could not establish a connection" even when the SuperLink refused the node's key."""
    if "code: 2004" in log_text and auth_key:
        return (f"the SuperLink at {superlink} refused to activate this SuperNode (code 2004): "
                f"its public key {auth_key}.pub is not registered there (the SuperLink's log "
                "says 'No SuperNode found with the given public key'), or another SuperNode "
                "with the same key is online. Fix: the operator registers the key with "
                f"deploy/register-nodes.sh CONNECTION {auth_key}.pub (one key per node), then "
                "start this SuperNode again")
    if "Exit Code: 305" in log_text:
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
    all. Every exit is reported
    with the end of its log (its colour codes only on a terminal) and ``hint(name, log
    text)``, when that explains it."""

    def __init__(self, procs: Processes, hint=None, settle_s: float = 30.0,
                 pause_s: float = 2.0, max_restarts: int = 5, window_s: float = 600.0,
                 clock=time.monotonic):
        self.procs = procs
        self.hint = hint
        self.settle_s = settle_s
        self.pause_s = pause_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.started = {name: clock() for name, _, _ in procs.running}
        self.restarts: dict[str, list[float]] = {}

    def report(self, name: str, code: int | None, log: Path | None) -> None:
        text = log.read_text(errors="replace") if log and log.exists() else ""
        tail = "\n".join(text.splitlines()[-15:])
        if not sys.stderr.isatty():  # Flower's colour codes, for a terminal only
            tail = COLOUR.sub(b"", tail.encode()).decode(errors="replace")
        print(f"fedefc deploy: {name} exited with code {code} at "
              f"{time.strftime('%H:%M:%S')}; the end of its log {log}:\n{tail}",
              file=sys.stderr, flush=True)
        explained = self.hint(name, text) if self.hint else None
        if explained:
            print(f"fedefc deploy: {explained}", file=sys.stderr, flush=True)

    def step(self) -> int | None:
        """Look once: restart what exited and may be restarted; the exit code of the
        whole when a process must not be (1), else None."""
        for name, proc, log in list(self.procs.running):
            if proc.poll() is None:
                continue
            self.report(name, proc.returncode, log)
            now = self.clock()
            recent = [t for t in self.restarts.get(name, []) if now - t < self.window_s]
            if now - self.started[name] < self.settle_s and proc.returncode >= 0:
                print(f"fedefc deploy: {name} exited {now - self.started[name]:.0f} s after "
                      "it started, so starting it again would fail again: stopping all",
                      file=sys.stderr, flush=True)
                return 1
            if len(recent) >= self.max_restarts:
                print(f"fedefc deploy: {name} exited {len(recent) + 1} times in "
                      f"{self.window_s:.0f} s: stopping all", file=sys.stderr, flush=True)
                return 1
            pause = self.pause_s * 2 ** len(recent)
            print(f"fedefc deploy: starting {name} again in {pause:.0f} s (restart "
                  f"{len(recent) + 1} of at most {self.max_restarts} in "
                  f"{self.window_s:.0f} s); the others keep running", file=sys.stderr,
                  flush=True)
            time.sleep(pause)
            self.procs.restart(name)
            self.started[name] = self.clock()
            self.restarts[name] = [*recent, now]
        return None


def _foreground(procs: Processes, hint=None) -> int:
    """Supervise the processes (:class:`Supervisor`) until SIGINT/SIGTERM arrives or one
    must not be restarted; then stop all and return the exit code."""
    stop = {"signal": False}

    def handler(signum, frame):  # noqa: ARG001
        stop["signal"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    supervisor = Supervisor(procs, hint)
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
    main = [flower_bin("flower-superlink"), *superlink_flags(
        args.host, args.port, str(state / "state.db"), tls, args.node_auth, secret)]
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

    def hint(name: str, text: str) -> str | None:
        return supernode_exit_hint(text, key, args.superlink) if name == "flower-supernode" \
            else None

    return _run_pair(pair, hint)


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _run_pair(pair: Pair, hint=None) -> int:
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
    return _foreground(procs, hint)


def cmd_connection(args: argparse.Namespace) -> int:
    home = Path(args.flwr_home).resolve() if args.flwr_home else default_flwr_home()
    ca = str(Path(args.ca_cert).resolve()) if args.ca_cert else None
    path = write_connection(home, args.name, args.address, ca)
    print(f"connection {args.name!r} -> {args.address} ({'TLS' if ca else 'insecure'}) "
          f"written to {path}")
    return 0


def default_flwr_home() -> Path:
    """Where the flwr CLI keeps its connections: $FLWR_HOME, else ~/.flwr."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


REFUSED_S = 30.0  # how long a first ask waits for a SuperLink whose port refuses (one
# started just before, as in the quick start, can take that long to listen on a busy machine)


def connection_address(connection: str, env: dict[str, str]) -> tuple[str, int] | None:
    """(host, port) of ``connection`` in ``$FLWR_HOME/config.toml``, if it is there."""
    path = Path(env.get("FLWR_HOME") or default_flwr_home()) / "config.toml"
    try:
        with open(path, "rb") as fh:
            address = str(tomllib.load(fh)["superlink"][connection]["address"])
        host, _, port = address.rpartition(":")
        return host.strip("[]"), int(port)
    except (OSError, KeyError, TypeError, ValueError, tomllib.TOMLDecodeError):
        return None


def port_refuses(address: tuple[str, int] | None) -> bool:
    """Whether nothing listens at ``address`` (the connection is refused at once)."""
    if address is None:
        return False
    try:
        with socket.create_connection(address, timeout=5.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout, a name that does not resolve: flwr says what it is
        return False


def flwr_words(message: str) -> str:
    """flwr's error text without its progress lines, as one sentence without a closing
    full stop (it ends its own with two)."""
    return message.strip().split("\n\n")[-1].strip().rstrip(".")


def wait_for_superlink(connection: str, env: dict[str, str], cwd: Path,
                       timeout: float = 60.0, refused_s: float = REFUSED_S
                       ) -> dict[str, Any]:
    """Wait until the SuperLink of ``connection`` answers ``flwr ls`` (one started just
    before, as in the quick start, may need a few seconds); LaunchError after ``timeout``,
    or after ``refused_s`` while nothing listens at its address (the port refuses: no
    SuperLink there, or the connection's address is wrong), said at the first refusal.
    Returns what ``flwr ls`` said (its runs)."""
    start = time.monotonic()
    address = connection_address(connection, env)
    where = f"{address[0]}:{address[1]}" if address else connection
    said = False
    while True:
        if port_refuses(address):
            if not said:
                print(f"fedefc deploy: nothing listens on {where} (connection {connection!r} "
                      f"refused); waiting up to {refused_s:.0f} s for a SuperLink to start "
                      "there", file=sys.stderr, flush=True)
                said = True
            if time.monotonic() - start > refused_s:
                raise LaunchError(
                    f"nothing listens on {where}, the address of connection {connection!r}: "
                    f"the connection was refused for {refused_s:.0f} s. Is the SuperLink "
                    "running (deploy/start-superlink.sh; its log says which --host and "
                    "--port it serves), and is the connection's address right (fedefc "
                    f"deploy connection {connection} HOST:PORT)?")
            time.sleep(1.0)
            continue
        res = flwr_json(["ls", connection], env, cwd)
        if res.get("success", True):
            return res
        message = flwr_words(str(res.get("error-message", res)))
        if "unavailable" not in message:
            raise UsageError(f"flwr cannot use connection {connection!r}: {message} (add it "
                             f"with: fedefc deploy connection {connection} HOST:PORT)")
        if time.monotonic() - start > timeout:
            raise LaunchError(f"the SuperLink of connection {connection!r} did not answer "
                              f"within {timeout:.0f} s: {message}. "
                              "Is it running (deploy/start-superlink.sh), and is the "
                              "connection's address right (fedefc deploy connection)?")
        time.sleep(2.0)


def public_key_file(path: str | Path) -> str:
    """``path`` made absolute, after checking that it is a file holding no private key."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UsageError(f"public key {file} not found (nothing registered)")
    if "PRIVATE KEY" in file.read_text(errors="replace"):
        raise UsageError(f"{file} is a private key: register its public key ({file}.pub) "
                         "and keep the private key on its node (nothing registered)")
    return str(file)


def cmd_register(args: argparse.Namespace) -> int:
    """``flwr supernode register`` every public key, once the SuperLink answers; a key is
    named after its file (``node-0.pub`` -> ``node-0``)."""
    keys = [public_key_file(k) for k in args.public_keys]
    env, cwd = flwr_env(default_flwr_home()), Path.cwd()
    wait_for_superlink(args.connection, env, cwd)
    failed = []
    for key in keys:
        name = Path(key).name.removesuffix(".pub")
        res = flwr_json(["supernode", "register", key, args.connection, "--name", name],
                        env, cwd)
        if res.get("success", True):
            print(f"registered {key} as SuperNode {name!r} (node id {res.get('node-id')})")
        else:
            failed.append(f"{key}: {str(res.get('error-message', res)).strip()}")
    if failed:
        raise LaunchError("registering failed for " + "; ".join(failed))
    return 0


def refuse_a_busy_superlink(connection: str, env: dict[str, str], cwd: Path,
                            listing: dict[str, Any] | None = None) -> None:
    """UsageError naming the runs that have not finished on the SuperLink (``listing``:
    what ``flwr ls`` said just now, else asked again): a second run would share the
    SuperNodes with them (each slowing the other, both recorded as if alone) and its
    out-dir may be theirs."""
    busy = active_runs(connection, env, cwd, listing)
    if busy:
        listed = ", ".join(f"{run_id} ({status})" for run_id, status in busy)
        first = busy[0][0]
        raise UsageError(
            f"the SuperLink of connection {connection!r} is running another run: {listed}; "
            f"nothing submitted. Wait for it to end (flwr log {first} {connection} --stream) "
            f"or stop it (flwr stop {first} {connection}), then submit again")


def superlink_lost_text(connection: str, when: str, resume: str) -> str:
    """Where to look when the SuperLink stopped during a run, and how to go on (the
    command ``resume``: :func:`resume_command`)."""
    return (f"The SuperLink of connection {connection!r} stopped answering at {when}. Its "
            "log is superlink.log in its state folder on the SuperLink machine (the "
            "folder fedefc deploy superlink printed; ~/.fedefc/superlink/ by default), or "
            "journalctl -u fedefc-superlink for the service; its SuperExec's is "
            "superexec.log beside it. A SuperLink that restarts ends the run it was "
            f"running as failed; once it answers again, continue the run with: {resume}")


def resume_command(args: argparse.Namespace, out_dir: str) -> str:
    """The ``fedefc deploy submit`` command that resumes the run of ``args`` (a submit's
    flags) whose out-dir is ``out_dir``, complete for the deployment it came from: its
    connection (with ``FLWR_HOME`` where one is set), its signing key and key id, and,
    where the out-dir is not on this machine (its config.json cannot be read here), the
    preset and ``--set`` of the submission, which the resumed run must repeat."""
    words = ["fedefc", "deploy", "submit", args.connection]
    if args.preset and not (Path(out_dir) / "config.json").is_file():
        words.append(args.preset)
    words += ["--resume", out_dir]
    if not (Path(out_dir) / "config.json").is_file():
        for override in args.overrides:
            words += ["--set", override]
    if args.sign_key:
        words += ["--sign-key", str(Path(args.sign_key).expanduser().resolve())]
    if args.key_id:
        words += ["--key-id", args.key_id]
    home = os.environ.get("FLWR_HOME")
    return (f"FLWR_HOME={shlex.quote(home)} " if home else "") + shlex.join(words)


SILENT_NODE = re.compile(r"node (\d+) failed to declare: no reply within")


def silent_nodes_hint(reason: str, connection: str = "CONNECTION") -> str | None:
    """What to do about the nodes that a failed run's ``reason`` names as never
    answering: each may be stuck (docs/RELIABILITY.md, "A SuperLink restart
    mid-round"), and restarting it clears whatever it holds."""
    nodes = sorted(set(SILENT_NODE.findall(reason)))
    if not nodes:
        return None
    return (f"Node{'s' * (len(nodes) > 1)} {', '.join(nodes)} never answered: if "
            f"{'they are' if len(nodes) > 1 else 'it is'} online (flwr supernode ls "
            f"{connection} lists the node ids, each by its key's name with node "
            "authentication), a SuperNode may be stuck: restart it on its machine (Ctrl-C "
            "its fedefc deploy supernode and start it again, or sudo systemctl restart "
            "fedefc-supernode-K), then submit the run again; its supernode.log says what it "
            "received last")


def explain_failure(outcome: RunOutcome, out_dir: str, connection: str,
                    resume: str | None = None) -> str:
    """What the operator reads when a run did not complete: its status, the reason its
    log gives, and what is (and is not) in its out-dir; ``resume``: the command that
    resumes it (:func:`resume_command`)."""
    reason = outcome.failure or "its log names no reason"
    lines = [f"run {outcome.run_id} ended {outcome.status}: it did not complete. "
             f"Reason: {reason}",
             f"Its whole log: flwr log {outcome.run_id} {connection}"]
    if outcome.superlink_lost:
        lines.append(superlink_lost_text(connection, outcome.superlink_lost, resume or (
            f"fedefc deploy submit {connection} --resume {out_dir}")))
    if hint := silent_nodes_hint(reason, connection):
        lines.append(hint)
    if "already holds results" in reason:
        lines.append(f"Its out-dir {out_dir} holds an earlier run's results, left untouched; "
                     "this run wrote nothing there. Submit again with a new out-dir.")
    else:
        lines.append(f"What it wrote before failing, if anything, is in {out_dir} on the "
                     "SuperLink machine (its summary.json, if written, says \"status\": "
                     "\"failed\" and why).")
    return "\n".join(lines)


def resume_submission(folder: str, preset: str | None, overrides: list[str]
                      ) -> dict[str, Any]:
    """The run config that resumes the deployment run whose out-dir is ``folder`` (on the
    SuperLink machine). Where that folder is on this machine too (the operator works on
    the SuperLink machine, or fetched it), its own ``config.json`` with ``overrides``
    (e.g. ``rounds``), as ``fedefc resume`` does; else the preset and overrides, which
    must repeat the run's config (the ServerApp refuses a checkpoint of another config,
    naming the keys). ConfigError naming the value and the fix otherwise."""
    from common.methods import load_run_config  # lazy: torch, 1.9 s of CPU
    from fedefc_server import checkpoint  # lazy: torch, 1.9 s of CPU
    from fedefc_server.checkpoint import CheckpointError  # lazy: torch, 1.9 s of CPU
    path = Path(folder).expanduser()
    if not path.is_absolute():
        raise ConfigError(f"--resume {folder!r} is not absolute; give the run's out-dir as "
                          "the absolute folder on the SuperLink machine, e.g. --resume "
                          "/srv/fedefc/runs/run1")
    if (path / "config.json").is_file():
        if preset:
            raise ConfigError(f"--resume {folder} takes the run's own config from its "
                              f"config.json; leave out the preset {preset!r} (change keys "
                              "that may differ with --set, e.g. --set rounds=60)")
        if not (path / checkpoint.FILE).is_file():
            raise CheckpointError(f"--resume {folder}: no {checkpoint.FILE} there; the run "
                                  "finished no round, so there is nothing to resume: submit "
                                  "it anew with a new out-dir")
        print(f"fedefc deploy: resuming the run in {path} with its own config.json",
              flush=True)
        return resume_config(str(path), overrides)
    merged = {**merged_config(preset, overrides), "resume-from": str(path),
              "out-dir": str(path)}
    print(f"fedefc deploy: {path} is not on this machine: resuming it with the config of "
          "the preset and --set given, which must be the run's (the ServerApp refuses a "
          "checkpoint of another config, naming the keys)", flush=True)
    return load_run_config(merged).to_flat()


def progress(text: str) -> None:
    """One step of ``submit``, on stderr as it starts (the run's log goes to stdout)."""
    print(f"fedefc deploy: {text} ...", file=sys.stderr, flush=True)


def submit_resuming(connection: str, run_config: dict[str, Any], env: dict[str, str],
                    sign: tuple[str, str] | None, max_resumes: int,
                    reconnect_s: float) -> RunOutcome:
    """Submit the run and follow it; while it is :attr:`.flower.RunOutcome.interrupted`
    (its ServerApp stopped from outside: its SuperExec or the SuperLink exited, and the
    supervisor of ``fedefc deploy superlink`` or systemd started it again) and got
    further than the attempt before, submit it again resuming from its out-dir's
    checkpoint (docs/DEPLOYMENT.md, "Resuming a run"), at most ``max_resumes`` times. A
    SuperLink that stops answering is waited for ``reconnect_s`` each time. How the last
    attempt ended."""
    out_dir = str(run_config["out-dir"])
    outcome = submit_run(connection, run_config, env, Path.cwd(), sign_key=sign, say=progress,
                         reconnect_s=reconnect_s)
    reached, resumes = 0, 0
    while outcome.interrupted and outcome.last_round > reached and resumes < max_resumes:
        reached, resumes = outcome.last_round, resumes + 1
        print(f"fedefc deploy: run {outcome.run_id} stopped unfinished after round "
              f"{outcome.last_round} ({outcome.failure or 'its log names no reason'}); "
              f"resuming it from its checkpoint in {out_dir} (resume {resumes} of at most "
              f"{max_resumes}: --max-resumes)", file=sys.stderr, flush=True)
        wait_for_superlink(connection, env, Path.cwd(), reconnect_s, refused_s=reconnect_s)
        outcome = submit_run(connection, {**run_config, "resume-from": out_dir,
                                          "out-dir": out_dir},
                             env, Path.cwd(), sign_key=sign, say=progress,
                             reconnect_s=reconnect_s)
    return outcome


def cmd_submit(args: argparse.Namespace) -> int:
    progress("checking the run config")
    from common.methods import load_run_config, short_run_warning  # lazy: torch, 1.9 s of CPU
    if args.resume:
        merged = resume_submission(args.resume, args.preset, args.overrides)
        note = inexact_resume_note(merged)
        if note:
            print(f"fedefc deploy: {note}", flush=True)
    else:
        merged = merged_config(args.preset, args.overrides)
    if not merged.get("out-dir"):
        raise ConfigError("out-dir is required: an absolute folder on the SuperLink machine, "
                          "where the ServerApp writes; e.g. --set out-dir=\"/srv/fedefc/run1\"")
    cfg = load_run_config(merged)
    warning = short_run_warning(cfg)
    if warning:
        print(f"fedefc deploy: WARNING: {warning}", file=sys.stderr, flush=True)
    sign = None
    if args.sign_key:
        key = check_private(args.sign_key, "--sign-key")
        sign = (key, args.key_id or Path(key).name)
    env = flwr_env(default_flwr_home())
    progress(f"asking the SuperLink of connection {args.connection!r} (flwr ls)")
    listing = wait_for_superlink(args.connection, env, Path.cwd())
    refuse_a_busy_superlink(args.connection, env, Path.cwd(), listing)
    try:
        outcome = submit_resuming(args.connection, cfg.to_flat(), env, sign,
                                  args.max_resumes, args.reconnect_wait)
    except SuperLinkGone as gone:
        lost = superlink_lost_text(args.connection, gone.when,
                                   resume_command(args, cfg.out_dir))
        print(f"fedefc deploy: the run did not end here: {lost}", file=sys.stderr)
        return 1
    tell_run(cfg.out_dir)
    if outcome.degraded:
        print(f"fedefc deploy: run {outcome.run_id} completed DEGRADED: {outcome.degradation}."
              f"\nIts model and summary are in {cfg.out_dir} on the SuperLink machine; the "
              "summary's missed_rounds lists, per partition, the rounds it missed, and each "
              "round's record in metrics.jsonl says why (missing). Whole log: flwr log "
              f"{outcome.run_id} {args.connection}", file=sys.stderr)
        return EXIT_DEGRADED
    if not outcome.completed:
        explained = explain_failure(outcome, cfg.out_dir, args.connection,
                                    resume_command(args, cfg.out_dir))
        print(f"fedefc deploy: {explained}", file=sys.stderr)
        return 1
    print(f"run {outcome.run_id}: {outcome.status}; results in {cfg.out_dir} on the SuperLink "
          "machine (its SUMMARY line above counts client failures and rejected replies; "
          f"bring them here with: fedefc deploy fetch HOST:{cfg.out_dir} LOCAL_DIR)")
    return 0


RESULT_FILES = ("config.json", "metrics.jsonl", "summary.json", "model.pt")


def _is_remote(source: str) -> bool:
    """``[user@]host:/path`` (scp's form), not a local path."""
    head, sep, _ = source.partition(":")
    return bool(sep) and "/" not in head and bool(head)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Copy a run's out-dir from the SuperLink machine (``[user@]host:/abs/out-dir``, by
    scp over SSH) or from a local path, then check and summarize what arrived."""
    dest = Path(args.dest).expanduser().resolve()
    if dest.exists():
        raise UsageError(f"{dest} already exists; choose a new LOCAL_DIR (nothing overwritten)")
    if _is_remote(args.source):
        if not shutil.which("scp"):
            raise UsageError("scp not found; install openssh-client, or copy the out-dir "
                             "by other means and give its local path")
        code = subprocess.call(["scp", "-r", "-p", "-q", args.source, str(dest)])
        if code != 0:
            raise LaunchError(f"scp -r {args.source} {dest} failed (exit {code}): check the "
                              "host name, your SSH access to it, and the out-dir's path there")
    else:
        source = Path(args.source).expanduser().resolve()
        if not source.is_dir():
            raise UsageError(f"{source} is not a run's out-dir (no such folder); give "
                             "HOST:/abs/out-dir for the SuperLink machine's folder")
        shutil.copytree(source, dest)
    missing = [name for name in RESULT_FILES if not (dest / name).is_file()]
    summary = {}
    if (dest / "summary.json").is_file():
        summary = json.loads((dest / "summary.json").read_text())
    print(f"fetched {args.source} -> {dest}: "
          f"{', '.join(sorted(p.name for p in dest.iterdir()))}")
    tell_run(dest)
    if summary.get("status") == "failed":
        failure = summary.get("failure", "no reason recorded")
        hint = silent_nodes_hint(failure)
        print(f"fedefc deploy: the run FAILED: {failure}" + (f"\n{hint}" if hint else ""),
              file=sys.stderr)
        return 1
    if summary.get("status") == "degraded":
        print(f"fedefc deploy: the run is DEGRADED: {summary.get('degraded')}",
              file=sys.stderr)
    if missing:
        print(f"fedefc deploy: {', '.join(missing)} missing: the run did not finish (it may "
              "still run, or have failed before writing them; see flwr log RUN_ID)",
              file=sys.stderr)
        return 1
    return EXIT_DEGRADED if summary.get("status") == "degraded" else 0


def cmd_export(args: argparse.Namespace) -> int:
    """Each partition K of the run's dataset (noisy labels included) as a node's private
    data: ``OUT/node-K/data.npz``, or with ``--images`` a folder of PNG files per class
    (``OUT/node-K/<class index>/<n>.png``) and the federation's class map
    ``OUT/classes.json``, to try ``fedefc data`` as a site with real images would
    (docs/DEPLOYMENT.md, "Node data"). With ``validation-labels = "verified"`` the
    simulation's verified share is written with its true labels and marked in a
    ``verified`` array (docs/FEDEFC.md §3.7)."""
    import torch  # lazy: torch, 1.9 s of CPU

    from common.data_plan import data_plan  # lazy: torch, 1.9 s of CPU
    from common.methods import load_run_config  # lazy: torch, 1.9 s of CPU
    from fedefc_client.local_data import checked_in_partition  # lazy: torch, 1.9 s of CPU
    cfg = load_run_config(merged_config(args.preset, args.overrides))
    if args.images and cfg.validation_labels == "verified":
        raise UsageError("validation-labels=\"verified\" with --images: an image folder "
                         "cannot mark verified samples; export an .npz per node (without "
                         "--images)")
    out = Path(args.out_dir).expanduser().resolve()
    folders = [out / f"node-{pid}" for pid in range(cfg.num_clients)]
    paths = folders if args.images else [folder / "data.npz" for folder in folders]
    existing = [str(p) for p in [*paths, out / "classes.json"] if p.exists()]
    if existing:
        raise UsageError(f"{', '.join(existing)} already exist; choose a new OUT_DIR "
                         "(nothing overwritten)")
    fed = data_plan(cfg)
    if args.images and (fed.data.train_x.dim() != 4 or fed.data.train_x.dtype != torch.uint8
                        or fed.data.train_x.shape[1] not in (1, 3)):
        raise UsageError(f"dataset={cfg.dataset!r} holds no 8-bit gray or RGB images "
                         f"(samples of shape {tuple(fed.data.train_x.shape[1:])}); export it "
                         "without --images (an .npz per node)")
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write to OUT_DIR {out} ({err.strerror}: {err.filename}); "
                         "choose a folder you can write to") from None
    for pid, (idx, path) in enumerate(zip(fed.client_indices, paths)):
        x, y = fed.data.train_x[torch.as_tensor(idx)].numpy(), fed.noisy_labels[idx]
        checked = checked_in_partition(cfg, pid, len(idx), fed.data.num_classes)
        if checked is not None:
            y = y.copy()
            y[checked] = fed.true_labels[idx][checked]
        if args.images:
            write_image_folder(path, x, y)
        else:
            write_npz(path, x, y, checked)
        print(f"partition {pid}: {len(idx)} samples -> {path}")
    if args.images:
        atomic_write_json(out / "classes.json", {str(c): c for c in range(fed.data.num_classes)})
        print(f"class map (the same at every node) -> {out / 'classes.json'}")
    return 0
