"""``flwr-clientapp`` / ``flwr-serverapp`` that run only apps signed by a trusted key.

    python -m fedefc_cli.trusted_apps superexec TRUSTED_KEYS FOLDER SUPEREXEC [flags]
    python -m fedefc_cli.trusted_apps clientapp|serverapp TRUSTED_KEYS [Flower's args...]

A SuperExec starts every app process by the name ``flwr-clientapp`` (on a SuperNode) or
``flwr-serverapp`` (on the SuperLink machine), found on its PATH. With ``--trusted-keys
FILE``, ``fedefc deploy supernode|superlink`` (and the service units) start the SuperExec
through the first form: it writes ``FOLDER/bin/flwr-clientapp`` and ``flwr-serverapp``
(:func:`write_launchers`), each running the second form, puts that folder first on PATH
and becomes the SuperExec (exec, same PID: ``flower-superexec`` with the repairs of
:mod:`.flower_repairs`). The second form is Flower's own app
process, with one check added between
receiving the app and installing it: :func:`.app_signing.check_signed_fab` on the FAB and
the run config the run will see. A refused app is never installed nor imported; the
process fails the way a failing app does (a ClientApp's error reply names the reason to
the ServerApp; a refused ServerApp fails its run, the reason in ``flwr log``).

It patches two names inside Flower's process modules (``install_from_fab``,
``run_from_proto``): pinned to flwr 1.42.0, and checked by
tests/test_trusted_apps.py so that an upgrade that moves them fails loudly.
"""

from __future__ import annotations

import importlib
import io
import os
import shlex
import sys
import zipfile
from pathlib import Path
from typing import Any

from .app_signing import UntrustedAppError, check_signed_fab, fused_run_config, load_trusted_keys

ROLES = {  # role -> (Flower's process module, its entry point, the executable's name)
    "clientapp": ("flwr.supernode.runtime.run_clientapp", "flwr.supernode.cli:flwr_clientapp",
                  "flwr-clientapp"),
    "serverapp": ("flwr.superlink.runtime.run_serverapp", "flwr.superlink.cli:flwr_serverapp",
                  "flwr-serverapp"),
}


def guard(module: Any, trusted_keys: str) -> None:
    """Make ``module`` (Flower's ClientApp or ServerApp process) check every FAB before it
    installs it. The trusted keys are read now, so a bad file stops the process at once."""
    trusted = load_trusted_keys(trusted_keys)
    seen: dict[str, Any] = {}
    install, run_from_proto = module.install_from_fab, module.run_from_proto

    def remember_run(proto):
        seen["run"] = run = run_from_proto(proto)
        return run

    def checked_install(fab_content: bytes, *args, **kwargs):
        with zipfile.ZipFile(io.BytesIO(fab_content)) as fab:
            files = {n: fab.read(n) for n in fab.namelist()}
        run_config = fused_run_config(files, seen["run"].override_config)
        key_id = check_signed_fab(fab_content, run_config, trusted)
        print(f"fedefc: app signed by trusted key {key_id!r}", file=sys.stderr, flush=True)
        return install(fab_content, *args, **kwargs)

    module.run_from_proto = remember_run
    module.install_from_fab = checked_install


def write_launchers(folder: Path, trusted_keys: str, python: str = sys.executable) -> Path:
    """``folder/bin/flwr-clientapp`` and ``flwr-serverapp``, each running this module with
    ``trusted_keys``; put ``folder/bin`` first on the SuperExec's PATH. Returns that bin."""
    bin_dir = Path(folder) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    keys = str(Path(trusted_keys).expanduser().resolve())
    load_trusted_keys(keys)  # refuse a bad file before anything starts
    for role, (_, _, name) in ROLES.items():
        path = bin_dir / name
        path.write_text(launcher_text(role, keys, python))
        path.chmod(0o755)
    return bin_dir


def launcher_text(role: str, keys: str, python: str = sys.executable) -> str:
    """The launcher of ``role`` (:func:`write_launchers`)."""
    return (f"#!/bin/sh\nexec {shlex.quote(python)} -m fedefc_cli.trusted_apps {role} "
            f"{shlex.quote(keys)} \"$@\"\n")


def launcher_args(path: str) -> list[str] | None:
    """``[ROLE, TRUSTED_KEYS]`` of the launcher at ``path`` if :func:`write_launchers`
    wrote it for this interpreter, else None: what the SuperExec's zygote
    (:mod:`.app_zygote`) runs in place of the launcher, through :func:`launched`."""
    try:
        text = Path(path).read_text()
        words = shlex.split(text.splitlines()[1])
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None
    if len(words) != 7 or words[4] not in ROLES:
        return None
    return words[4:6] if text == launcher_text(*words[4:6]) else None


def launched() -> None:
    """A launcher's process, forked by the zygote: ``sys.argv`` is the launcher's path,
    then :func:`main`'s arguments (``ROLE TRUSTED_KEYS [Flower's args...]``)."""
    main(sys.argv[1:])


def superexec_argv(superexec: list[str], trusted_keys: str | None, folder: Path) -> list[str]:
    """The command of a SuperExec: ``superexec`` (Flower's SuperExec and its flags), or,
    with ``trusted_keys``, the same through this module's ``superexec`` form (launchers
    in ``folder/bin``)."""
    if not trusted_keys:
        return superexec
    keys = str(Path(trusted_keys).expanduser().resolve())
    load_trusted_keys(keys)  # refuse a bad file before anything starts
    return [sys.executable, "-m", "fedefc_cli.trusted_apps", "superexec", keys,
            str(Path(folder).resolve()), *superexec]


def _exec_superexec(keys: str, folder: str, argv: list[str]) -> None:
    bin_dir = write_launchers(Path(folder), keys)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}
    os.execve(argv[0], argv, env)


def main(argv: list[str]) -> None:
    if len(argv) >= 4 and argv[0] == "superexec":
        try:
            _exec_superexec(argv[1], argv[2], argv[3:])
        except (UntrustedAppError, ValueError, OSError) as err:
            sys.exit(f"fedefc: {err}")
    if len(argv) < 2 or argv[0] not in ROLES:
        sys.exit("usage: python -m fedefc_cli.trusted_apps clientapp|serverapp TRUSTED_KEYS "
                 "[flwr-clientapp/flwr-serverapp arguments], or superexec TRUSTED_KEYS FOLDER "
                 "SUPEREXEC [flags]")
    role, keys, rest = argv[0], argv[1], argv[2:]
    module_name, entry, name = ROLES[role]
    try:
        guard(importlib.import_module(module_name), keys)
    except (UntrustedAppError, ValueError) as err:
        sys.exit(f"fedefc: {err}")
    sys.argv = [os.path.join(os.path.dirname(sys.executable), name), *rest]
    package, func = entry.split(":")
    getattr(importlib.import_module(package), func)()


if __name__ == "__main__":
    main(sys.argv[1:])
