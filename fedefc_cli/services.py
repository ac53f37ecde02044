"""systemd units for a site: the same processes ``fedefc deploy superlink|supernode`` start.

``fedefc deploy service superlink|supernode [their flags] --user U --state-dir DIR
--units-dir OUT`` writes two units per machine, from the very commands the foreground
commands run (:class:`.deploy_supervisor.Pair`): the SuperLink or SuperNode, and its SuperExec
(bound to it: stopped and restarted with it). Each unit:

- runs as the dedicated system user ``--user`` (which must exist and own every private
  file it reads), never as root, with that user's primary group (``nogroup`` for
  ``nobody`` on Debian: not always the user's name); ``UMask=0077`` so that whatever it
  writes is its own;
- restarts whenever it exits (``Restart=always``: a SuperExec that gave up on a busy
  SuperLink may exit with code 0) and starts at boot once enabled; the SuperExec alone
  when it exits, both when the SuperLink does (``PartOf=``);
- logs to the systemd journal (stdout and stderr), where journald rotates them:
  ``journalctl -u UNIT``; sizes in ``/etc/systemd/journald.conf`` (``SystemMaxUse=``);
- gets the environment the foreground commands give (``FLWR_HOME`` in the state folder,
  Flower's update check, telemetry and runtime ``uv sync`` off) and this Python
  environment's ``bin`` first on ``PATH``.

docs/DEPLOYMENT.md, "Run it as a service", has the install commands.
"""

from __future__ import annotations

import argparse
import grp
import pwd
import re
import sys
from pathlib import Path

from .deploy_supervisor import Pair, superlink_pair, supernode_pair
from .errors import UsageError
from .run_configs import APP_DIR

# what fedefc_cli.flower.flwr_env gives the foreground processes, less the caller's own
ENVIRONMENT = {"FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",
               "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONUNBUFFERED": "1"}
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def systemd_word(word: str) -> str:
    """One command-line word in systemd's syntax: double-quoted, with ``\\`` and ``"``
    escaped, when it holds anything but plain characters; ``%`` (specifiers) and ``$``
    (variables) doubled, so systemd passes the word through unchanged."""
    word = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(argv: list[str]) -> str:
    return " ".join(systemd_word(w) for w in argv)


def check_service_user(user: str, private_files: list[str]) -> None:
    """UsageError unless ``user`` exists, is not root, and owns every private file (the
    service reads them as that user, and they must stay 0600)."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise UsageError(f"--user {user}: no such user; create the service user first: sudo "
                         f"useradd --system --home-dir /var/lib/fedefc --shell /usr/sbin/nologin "
                         f"{user}") from None
    if entry.pw_uid == 0:
        raise UsageError("--user root: the services must not run as root; create a dedicated "
                         "user (sudo useradd --system ... fedefc)")
    foreign = [path for path in private_files if Path(path).stat().st_uid != entry.pw_uid]
    if foreign:
        raise UsageError(f"{', '.join(foreign)}: not owned by {user} (uid {entry.pw_uid}), "
                         f"the user the service runs as, who must read them: sudo chown "
                         f"{user}: {' '.join(foreign)} (they stay mode 0600)")


def primary_group(user: str) -> str:
    """The name of ``user``'s primary group (its number where the group has no name)."""
    gid = pwd.getpwnam(user).pw_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def unit(description: str, argv: list[str], user: str, state: Path,
         bound_to: str | None = None) -> str:
    """A service unit running ``argv`` as ``user`` (with its primary group) in ``state``
    (absolute)."""
    env = {**ENVIRONMENT, "FLWR_HOME": str(state / "flwr-home"),
           "PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}"}
    lines = ["[Unit]", f"Description={description}",
             f"Documentation=file://{APP_DIR / 'docs' / 'DEPLOYMENT.md'}",
             "After=network-online.target", "Wants=network-online.target"]
    if bound_to:
        lines += [f"Requires={bound_to}", f"After={bound_to}", f"PartOf={bound_to}"]
    lines += ["", "[Service]", "Type=simple", f"User={user}", f"Group={primary_group(user)}",
              f"WorkingDirectory={state}",
              *(f"Environment={systemd_word(f'{k}={v}')}" for k, v in sorted(env.items())),
              f"ExecStart={exec_line(argv)}",
              "Restart=always", "RestartSec=10s", "TimeoutStopSec=30s",
              "KillSignal=SIGTERM", "UMask=0077",
              "StandardOutput=journal", "StandardError=journal",
              "NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=full",
              "", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def write_units(pair: Pair, user: str, units_dir: Path, private_files: list[str]) -> list[Path]:
    """The pair's two unit files (``fedefc-NAME.service`` and
    ``fedefc-NAME-superexec.service``) in ``units_dir``; returns their paths."""
    check_service_user(user, private_files)
    if not pair.state.is_absolute():
        raise UsageError(f"--state-dir {pair.state} must be absolute")
    main_name, exec_name = f"fedefc-{pair.name}.service", f"fedefc-{pair.name}-superexec.service"
    units_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (
            (main_name, unit(f"FedEFC {pair.summary}", pair.main, user, pair.state)),
            (exec_name, unit(f"FedEFC SuperExec of {pair.name} (runs its apps)", pair.superexec,
                             user, pair.state, bound_to=main_name))):
        path = units_dir / name
        if path.exists():
            raise UsageError(f"{path} already exists; choose a new --units-dir (nothing "
                             "overwritten)")
        path.write_text(text)
        written.append(path)
    return written


PRIVATE_TMP = ("/tmp", "/var/tmp")  # what PrivateTmp=yes replaces with an empty folder
PATH_FLAGS = ("state_dir", "data_path", "cache_dir", "certs", "ca_cert", "auth_key",
              "superexec_secret", "trusted_keys")


def private_tmp_warnings(args: argparse.Namespace) -> list[str]:
    """A warning for every path flag under /tmp or /var/tmp: the unit runs with
    ``PrivateTmp=yes``, which gives it an empty /tmp of its own, so it would not find
    them (a state folder there would vanish with the unit)."""
    out = []
    for flag in PATH_FLAGS:
        value = getattr(args, flag, None)
        if not value:
            continue
        path = Path(value).expanduser().resolve()
        root = next((t for t in PRIVATE_TMP if path == Path(t) or Path(t) in path.parents),
                    None)
        if root:
            out.append(f"--{flag.replace('_', '-')} {path} is under {root}: the unit runs "
                       f"with PrivateTmp=yes, which gives it an empty {root} of its own, so "
                       "it will not see this path; move it elsewhere (e.g. under "
                       "/var/lib/fedefc or /srv) and write the units again")
    return out


def cmd_service(args: argparse.Namespace) -> int:
    """``fedefc deploy service superlink|supernode ...``: write the units."""
    if not args.state_dir:
        raise UsageError("--state-dir is required for a service: an absolute folder owned by "
                         "the service user, e.g. /var/lib/fedefc/superlink")
    state = Path(args.state_dir).expanduser().resolve()
    if args.role == "superlink":
        pair = superlink_pair(args, state)
        private = [f for f in (args.superexec_secret,
                               args.certs and str(Path(args.certs) / "server.key")) if f]
    else:
        if not args.runtime_port:
            raise UsageError("--runtime-port is required for a service (a fixed local port "
                             "for its SuperExec, e.g. 9094)")
        pair = supernode_pair(args, args.runtime_port, state, service=True)
        private = [f for f in (args.auth_key, args.superexec_secret) if f]
    paths = write_units(pair, args.user, Path(args.units_dir).expanduser().resolve(),
                        [str(Path(f).expanduser().resolve()) for f in private])
    for warning in private_tmp_warnings(args):
        print(f"fedefc deploy: WARNING: {warning}", file=sys.stderr)
    names = " ".join(p.name for p in paths)
    print(f"wrote {', '.join(str(p) for p in paths)}\ninstall and start them:\n"
          f"  sudo install -d -o {args.user} -g {primary_group(args.user)} -m 700 {state}\n"
          f"  sudo cp {' '.join(str(p) for p in paths)} /etc/systemd/system/\n"
          f"  sudo systemctl daemon-reload && sudo systemctl enable --now {names}\n"
          f"logs: journalctl -u {paths[0].name} -u {paths[1].name} (rotated by journald)")
    return 0
