"""The command lines of a deployment's processes: flower-superlink, flower-supernode
and flower-superexec (docs/DEPLOYMENT.md; deploy/compose.yml runs the same).

:func:`superlink_flags`, :func:`superexec_flags` and :func:`supernode_flags` are the one
place where these flags are written: ``fedefc deploy superlink|supernode|service``
(:mod:`.deploy_supervisor`, :mod:`.services`), :class:`.deploy_local.LocalDeployment`
(tests and benchmarks, everything on 127.0.0.1) and the compose test use them all.
Private keys and SuperExec secrets must be the owner's alone: every command refuses one
that other users can read or write (:func:`check_private`).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .app_signing import SigningKeyError
from .errors import UsageError
from .flower_repairs import command as repaired
from .run_configs import toml_value
from .trusted_apps import superexec_argv


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
