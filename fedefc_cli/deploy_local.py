"""A whole federation on one machine with the deployment's process topology
(:class:`LocalDeployment`): the tests and benchmarks of a real Flower deployment on
127.0.0.1, with the same flags as ``fedefc deploy`` (:mod:`.deploy_flags`).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deploy_flags import TLSFiles, superexec_command, superlink_flags, supernode_flags
from .deploy_submit import write_connection
from .deploy_supervisor import state_dir
from .errors import LaunchError
from .flower import RunOutcome, flower_bin, flwr_env, flwr_json, free_port, submit_run
from .flower_repairs import command as repaired
from .procs import STARTUP_S, ProcessGroup, wait_for_port
from .run_configs import APP_DIR

DEPLOY_DIR = APP_DIR / "deploy"


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
        self.procs.start("flower-superlink", repaired("superlink", superlink_flags(
            "127.0.0.1", self.port, str(folder / "state.db"), self.tls, self.node_auth,
            self.link_secret)), env, folder, folder / "superlink.log")
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

    def wait_online(self, count: int, timeout: float = STARTUP_S) -> None:
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
