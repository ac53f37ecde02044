"""Operating a federation, without Flower processes: signed apps, systemd units, the
certificate renewal, bringing results home (docs/DEPLOYMENT.md).

- Signed apps (:mod:`fedefc_cli.app_signing`): the FAB ``flwr run`` would build, signed
  for one run config, verifies; every change an outsider could make (no signature,
  another key, a changed or added file, another run config, an altered signature) is
  refused, with the reason. Real FABs, built by Flower's own builder.
- Service units: written from the same commands as the foreground processes, checked by
  ``systemd-analyze verify`` and parsed back word for word.
- The certificate renewal on real openssl certificates: the new one verifies against
  the unchanged CA, keeps the names, and ``--check`` tells when renewal is due.
- ``fedefc deploy fetch``: copies, checks and summarizes a run's out-dir.
"""

from __future__ import annotations

import grp
import importlib
import io
import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import tomli_w
import yaml
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import parse_config_args
from packaging.requirements import Requirement

from common.results import check_output_dir
from fedefc_cli import (
    app_signing,
    deploy_export,
    deploy_supervisor,
    services,
    simulation,
    trusted_apps,
)
from fedefc_cli.app_signing import (
    SIGNATURE_FILE,
    SigningKeyError,
    UntrustedAppError,
    check_signed_fab,
    fused_run_config,
    load_trusted_keys,
    stage_signed_app,
)
from fedefc_cli.deploy_local import DEPLOY_DIR
from fedefc_cli.errors import LaunchError
from fedefc_cli.main import build_parser, main
from fedefc_cli.procs import Processes
from fedefc_cli.run_configs import APP_DIR, write_run_config
from tests.helpers import patience

NOOP_APP = Path(__file__).parent / "flower_apps" / "noop"


def script(name: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY_DIR / name), *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """deploy/gen-signing-key.sh's coordinator key, and an outsider's."""
    folder = tmp_path_factory.mktemp("keys") / "keys"
    for name in ("coordinator", "outsider"):
        out = script("gen-signing-key.sh", folder, name)
        assert out.returncode == 0, out.stderr
    return folder


def fab_of(folder: Path) -> bytes:
    """The FAB ``flwr run folder`` would send (Flower's builder)."""
    return build_fab_from_disk(folder)


def run_config_of(fab: bytes, overrides: dict) -> dict:
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        return fused_run_config({n: z.read(n) for n in z.namelist()}, overrides)


def signed(tmp_path: Path, keys: Path, overrides: dict, key: str = "coordinator",
           app: Path = NOOP_APP) -> Path:
    """The staged, signed app for ``overrides`` as parsed from a --run-config file."""
    cfg = write_run_config(tmp_path / "run.toml", overrides)
    return stage_signed_app(app, parse_config_args([str(cfg)]), keys / key, key,
                            tmp_path / f"staged-{key}")


# -- signed apps -------------------------------------------------------------------------
def test_signing_key_script_writes_flowers_trusted_entities_format(keys):
    assert (keys / "coordinator").stat().st_mode & 0o777 == 0o600
    text = (keys / "coordinator.trusted.yaml").read_text()
    assert text.startswith('coordinator: "ssh-ed25519 AAAA')
    assert set(load_trusted_keys(keys / "coordinator.trusted.yaml")) == {"coordinator"}
    again = script("gen-signing-key.sh", keys, "coordinator")
    assert again.returncode == 2 and "already exists; nothing overwritten" in again.stderr


def test_a_signed_app_verifies_for_its_run_config_only(tmp_path, keys):
    overrides = {"mode": "ok", "rounds": 2, "hold-s": 1.5, "marker-dir": "/tmp/m"}
    staged = signed(tmp_path, keys, overrides)
    fab = fab_of(staged)
    trusted = load_trusted_keys(keys / "coordinator.trusted.yaml")
    assert check_signed_fab(fab, run_config_of(fab, overrides), trusted) == "coordinator"
    # the same code with another run config (e.g. an outsider's replay): refused
    with pytest.raises(UntrustedAppError, match="run config differs .* in rounds"):
        check_signed_fab(fab, run_config_of(fab, {**overrides, "rounds": 3}), trusted)
    # 2 and 2.0 are different run configs to the app: refused too
    with pytest.raises(UntrustedAppError, match="run config differs"):
        check_signed_fab(fab, run_config_of(fab, {**overrides, "rounds": 2.0}), trusted)


def test_this_projects_app_is_signed_with_its_whole_run_config(tmp_path, keys):
    """The FedEFC app ships with a fab-include list: the signature is added to it, every
    shipped file is covered, and the defaults fill the rest of the signed config."""
    staged = signed(tmp_path, keys, {"rounds": 3, "out-dir": "/srv/run"}, app=APP_DIR)
    fab = fab_of(staged)
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        names = set(z.namelist())
        signature = json.loads(z.read(SIGNATURE_FILE))
    assert SIGNATURE_FILE in names and "fedefc_client/client_app.py" in names
    assert set(signature["files"]) == names - {SIGNATURE_FILE, ".info/CONTENT"}
    assert signature["run-config"]["rounds"] == 3 and signature["run-config"]["method"] == "fedefc"
    trusted = load_trusted_keys(keys / "coordinator.trusted.yaml")
    run_config = run_config_of(fab, {"rounds": 3, "out-dir": "/srv/run"})
    assert check_signed_fab(fab, run_config, trusted) == "coordinator"


@pytest.mark.parametrize("attack,reason", [
    ("unsigned", "the app is not signed"),
    ("other-key", "signed by key 'outsider', which this machine does not trust"),
    ("changed-file", "files differ from what key 'coordinator' signed: noop_app/client_app.py"),
    ("added-file", "files differ from what key 'coordinator' signed: noop_app/extra.py"),
    ("altered-signature", "does not verify"),
    ("renamed-key", "does not verify"),
])
def test_an_outsiders_app_is_refused_with_the_reason(tmp_path, keys, attack, reason):
    overrides = {"mode": "ok"}
    app = signed(tmp_path, keys, overrides, key="outsider" if attack == "other-key"
                 else "coordinator")
    if attack == "unsigned":
        (app / SIGNATURE_FILE).unlink()
    elif attack == "changed-file":
        path = app / "noop_app" / "client_app.py"
        path.write_text(path.read_text() + "\nimport os  # the outsider's code\n")
    elif attack == "added-file":
        (app / "noop_app" / "extra.py").write_text("print('outsider')\n")
    elif attack in ("altered-signature", "renamed-key"):
        doc = json.loads((app / SIGNATURE_FILE).read_text())
        if attack == "altered-signature":
            doc["run-config"]["mode"] = "fail"
        else:  # an outsider's signature presented under the trusted name
            doc = json.loads((signed(tmp_path, keys, overrides, key="outsider")
                              / SIGNATURE_FILE).read_text()) | {"key-id": "coordinator"}
        (app / SIGNATURE_FILE).write_text(json.dumps(doc))
    fab = fab_of(app)
    trusted = load_trusted_keys(keys / "coordinator.trusted.yaml")
    with pytest.raises(UntrustedAppError, match="refused: ") as err:
        check_signed_fab(fab, run_config_of(fab, overrides), trusted)
    assert reason in str(err.value)


def test_bad_key_files_are_named_with_the_fix(tmp_path, keys):
    (tmp_path / "t.yaml").write_text("coordinator: not-a-key\n")
    with pytest.raises(SigningKeyError, match="key 'coordinator' is not an OpenSSH public key"):
        load_trusted_keys(tmp_path / "t.yaml")
    rsa = tmp_path / "rsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(rsa)], check=True)
    (tmp_path / "e.yaml").write_text(f'k: "{(tmp_path / "rsa.pub").read_text().strip()}"\n')
    with pytest.raises(SigningKeyError, match="is not Ed25519"):
        load_trusted_keys(tmp_path / "e.yaml")
    with pytest.raises(SigningKeyError, match="is not Ed25519"):
        app_signing.load_signing_key(rsa)
    with pytest.raises(SigningKeyError, match="unreadable"):
        load_trusted_keys(tmp_path / "missing.yaml")


def test_the_guard_hooks_flowers_app_processes_where_it_expects():
    """The two names :mod:`fedefc_cli.trusted_apps` replaces exist in flwr 1.42's
    ClientApp and ServerApp process modules (an upgrade that moves them fails here)."""
    for module_name, entry, _ in trusted_apps.ROLES.values():
        module = importlib.import_module(module_name)
        assert callable(module.install_from_fab) and callable(module.run_from_proto)
        package, func = entry.split(":")
        assert callable(getattr(importlib.import_module(package), func))


def test_the_guard_checks_before_installing(tmp_path, keys):
    """Driven like Flower's process drives it: run_from_proto, then install_from_fab; an
    unsigned FAB never reaches the real install."""
    installed = []

    class Process:  # stands for flwr.supernode.runtime.run_clientapp
        install_from_fab = staticmethod(lambda content, **kw: installed.append(content))
        run_from_proto = staticmethod(lambda proto: proto)

    class Run:
        override_config = {"mode": "ok"}

    trusted_apps.guard(Process, str(keys / "coordinator.trusted.yaml"))
    good = fab_of(signed(tmp_path, keys, {"mode": "ok"}))
    Process.run_from_proto(Run())
    Process.install_from_fab(good, skip_prompt=True)
    assert installed == [good]
    with pytest.raises(UntrustedAppError, match="not signed"):
        Process.install_from_fab(fab_of(NOOP_APP), skip_prompt=True)
    assert installed == [good]


def test_launchers_run_the_guard_with_the_trusted_keys(tmp_path, keys):
    bin_dir = trusted_apps.write_launchers(tmp_path, str(keys / "coordinator.trusted.yaml"))
    text = (bin_dir / "flwr-clientapp").read_text()
    assert "-m fedefc_cli.trusted_apps clientapp" in text
    assert str(keys / "coordinator.trusted.yaml") in text
    assert os.access(bin_dir / "flwr-serverapp", os.X_OK)
    with pytest.raises(SigningKeyError):
        trusted_apps.write_launchers(tmp_path, str(tmp_path / "none.yaml"))


# -- systemd units --------------------------------------------------------------------------
def parse_exec_start(text: str) -> list[str]:
    """ExecStart's words as systemd reads them (double quotes, backslash escapes, %% and
    $$ undoubled): the subset of its syntax :func:`services.systemd_word` writes."""
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart="))
    return [w.replace("%%", "%").replace("$$", "$") for w in words]


def unit_settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


@pytest.fixture
def service_user(monkeypatch) -> str:
    """A service user 'fedefc' that is this test's own uid (not root), so that the files
    the test writes count as the service user's."""
    me = pwd.getpwuid(os.getuid())
    entry = pwd.struct_passwd(("fedefc", "x", 4242 if me.pw_uid == 0 else me.pw_uid,
                               me.pw_gid, "", "/var/lib/fedefc", "/usr/sbin/nologin"))
    real = pwd.getpwnam
    monkeypatch.setattr(services.pwd, "getpwnam",
                        lambda name: entry if name == "fedefc" else real(name))
    return "fedefc"


def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    certs, keys, secret = tmp_path / "certs", tmp_path / "nodekeys", tmp_path / "link.secret"
    for name, args in (("gen-certs.sh", [certs, "superlink.example.org"]),
                       ("gen-node-keys.sh", [keys, "node-0"]),
                       ("gen-secret.sh", [secret])):
        assert script(name, *args).returncode == 0
    return certs, keys, secret


def chown_to(paths: list[Path], uid: int) -> None:
    if os.getuid() == 0:
        for path in paths:
            os.chown(path, uid, -1)


def test_service_units_run_the_foreground_commands_as_a_dedicated_user(
        tmp_path, keys, service_user):
    certs, node_keys, secret = tls_files(tmp_path)
    uid = services.pwd.getpwnam(service_user).pw_uid
    chown_to([certs / "server.key", secret, node_keys / "node-0"], uid)
    trusted = keys / "coordinator.trusted.yaml"
    link = ["--host", "0.0.0.0", "--port", "8443", "--certs", str(certs), "--node-auth",
            "--superexec-secret", str(secret), "--trusted-keys", str(trusted),
            "--state-dir", "/var/lib/fedefc/superlink"]
    node = ["--superlink", "superlink.example.org:8443", "--partition-id", "2",
            "--num-partitions", "3", "--ca-cert", str(certs / "ca.crt"), "--auth-key",
            str(node_keys / "node-0"), "--runtime-port", "9094", "--trusted-keys", str(trusted),
            "--state-dir", "/var/lib/fedefc/node-2"]
    units = tmp_path / "units"
    assert main(["deploy", "service", "superlink", *link, "--user", service_user,
                 "--units-dir", str(units)]) == 0
    assert main(["deploy", "service", "supernode", *node, "--user", service_user,
                 "--units-dir", str(units)]) == 0
    names = sorted(p.name for p in units.iterdir())
    assert names == ["fedefc-superlink-superexec.service", "fedefc-superlink.service",
                     "fedefc-supernode-2-superexec.service", "fedefc-supernode-2.service"]
    # the very commands `fedefc deploy superlink|supernode` run
    args = build_parser().parse_args(["deploy", "superlink", *link])
    link_pair = deploy_supervisor.superlink_pair(args)
    args = build_parser().parse_args(["deploy", "supernode", *node])
    node_pair = deploy_supervisor.supernode_pair(args, 9094, service=True)
    for pair in (link_pair, node_pair):
        main_unit = (units / f"fedefc-{pair.name}.service").read_text()
        exec_unit = (units / f"fedefc-{pair.name}-superexec.service").read_text()
        assert parse_exec_start(main_unit) == pair.main
        assert parse_exec_start(exec_unit) == pair.superexec
        for text in (main_unit, exec_unit):
            settings = unit_settings(text)
            assert settings["User"] == [service_user] and settings["Restart"] == ["always"]
            assert settings["UMask"] == ["0077"] and settings["StandardOutput"] == ["journal"]
            env = dict(e.split("=", 1) for e in settings["Environment"])
            assert env["FLWR_HOME"] == f"{pair.state}/flwr-home"
            assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
        assert unit_settings(exec_unit)["PartOf"] == [f"fedefc-{pair.name}.service"]
    # explicit bind address; the node's cache in its state folder; signed apps only
    assert link_pair.main[link_pair.main.index("--host") + 1] == "0.0.0.0"
    assert 'cache-dir="/var/lib/fedefc/node-2/cache"' in " ".join(node_pair.main)
    assert "fedefc_cli.trusted_apps" in node_pair.superexec
    if shutil.which("systemd-analyze"):
        out = subprocess.run(["systemd-analyze", "verify", *map(str, sorted(units.iterdir()))],
                             capture_output=True, text=True)
        assert out.returncode == 0 and out.stderr == "", out.stderr


def test_service_units_run_with_the_users_own_primary_group(tmp_path, capsys):
    """Issue 49's trial: the generator wrote Group=<user> and `install -g <user>`, which
    fail where the user's group has another name (Debian's nobody is in nogroup). The
    group is the user's primary group now, by the system's own records."""
    user = next((u for u in pwd.getpwall() if u.pw_uid != 0
                 and grp.getgrgid(u.pw_gid).gr_name != u.pw_name), None)
    if user is None:
        pytest.skip("no user here whose primary group has another name")
    group = grp.getgrgid(user.pw_gid).gr_name
    units = tmp_path / "units"
    assert main(["deploy", "service", "superlink", "--host", "127.0.0.1", "--port", "8000",
                 "--state-dir", "/var/lib/fedefc/superlink", "--user", user.pw_name,
                 "--units-dir", str(units)]) == 0
    for path in units.iterdir():
        settings = unit_settings(path.read_text())
        assert (settings["User"], settings["Group"]) == ([user.pw_name], [group])
    assert f"sudo install -d -o {user.pw_name} -g {group} -m 700 /var/lib/fedefc/superlink" \
        in capsys.readouterr().out


def test_service_refuses_root_a_missing_user_and_files_it_cannot_read(
        tmp_path, service_user, capsys):
    certs, _, secret = tls_files(tmp_path)
    base = ["deploy", "service", "superlink", "--host", "0.0.0.0", "--certs", str(certs),
            "--superexec-secret", str(secret), "--state-dir", "/var/lib/fedefc/superlink",
            "--units-dir", str(tmp_path / "units")]
    assert main([*base, "--user", "root"]) == 2
    assert "must not run as root" in capsys.readouterr().err
    assert main([*base, "--user", "no-such-user-fedefc"]) == 2
    assert "sudo useradd --system" in capsys.readouterr().err
    if os.getuid() == 0:  # the files belong to root, the service user is another uid
        assert main([*base, "--user", service_user]) == 2
        assert f"sudo chown {service_user}: {secret} {certs / 'server.key'} (they stay mode " \
               "0600)" in capsys.readouterr().err
    assert not (tmp_path / "units").exists()


def test_service_warns_of_paths_a_private_tmp_hides(tmp_path, service_user, capsys):
    """The units run with PrivateTmp=yes: a node's data under /tmp and its cache under
    /var/tmp would be invisible to them; the generator says so, naming each flag."""
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip("pytest's temporary folder is not under /tmp here")
    data = tmp_path / "node-0.npz"
    data.write_bytes(b"")
    assert main(["deploy", "service", "supernode", "--superlink", "link:8443",
                 "--partition-id", "0", "--num-partitions", "3", "--data-path", str(data),
                 "--cache-dir", "/var/tmp/fedefc-cache", "--runtime-port", "9094",
                 "--state-dir", "/var/lib/fedefc/node-0", "--user", service_user,
                 "--units-dir", str(tmp_path / "units")]) == 0
    err = capsys.readouterr().err
    assert (f"WARNING: --data-path {data} is under /tmp: the unit runs with PrivateTmp=yes, "
            "which gives it an empty /tmp of its own") in err
    assert "WARNING: --cache-dir /var/tmp/fedefc-cache is under /var/tmp" in err
    assert "--state-dir" not in err and err.count("WARNING") == 2


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["deploy", "service", "superlink"], 2),  # a flag missing: argparse refuses
    (["deploy", "service", "superlink", "--host", "0.0.0.0", "--allow-insecure", "--user",
      "root", "--state-dir", "/var/lib/fedefc/superlink", "--units-dir", "{tmp}/u"], 2),
    (["deploy", "fetch", "/no/such/run", "{tmp}/new"], 2),
    (["deploy", "connection", "c", "127.0.0.1:9", "--flwr-home", "{tmp}/home"], 0),
], ids=["help", "argparse", "service-as-root", "fetch-missing", "connection"])
def test_commands_that_parse_and_refuse_load_neither_torch_nor_flower(tmp_path, argv, code):
    """What made every `fedefc` call take 25-56 s on a loaded machine (issue 30): torch and
    Flower, imported by every command. A command that only parses, refuses or writes a
    small file imports neither (measured: 0.2 s of CPU, was 3.0 s)."""
    probe = ("import sys; from fedefc_cli.main import main\n"
             "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\n"
             "print('LOADED', sorted(m for m in ('torch', 'flwr', 'pydantic')"
             " if m in sys.modules), code)")
    out = subprocess.run([sys.executable, "-c", probe,
                          *(a.format(tmp=tmp_path) for a in argv)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    last = out.stdout.strip().splitlines()[-1]
    assert last == f"LOADED [] {code}", out.stdout[-2000:] + out.stderr[-2000:]


def supervised(tmp_path: Path, flaky: str, **limits):
    """A 'SuperLink' that runs until stopped and a 'SuperExec' running ``flaky`` (Python
    source), under a :class:`deploy_supervisor.Supervisor` with ``limits``."""
    procs = Processes()
    env = dict(os.environ)
    procs.start("superlink", [sys.executable, "-c", "import time; time.sleep(120)"], env,
                tmp_path, tmp_path / "superlink.log")
    procs.start("superexec", [sys.executable, "-c", flaky], env, tmp_path,
                tmp_path / "superexec.log")
    return procs, deploy_supervisor.Supervisor(procs, **{"pause_s": 0.01, **limits})


def supervise_until(supervisor, done, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = supervisor.step()
        if code is not None or done():
            return code
        time.sleep(0.05)
    raise AssertionError("the supervisor never got there")


def test_a_superexec_that_exits_is_started_again_and_the_superlink_kept(tmp_path, capsys):
    """Issue 30's chain: the SuperExec exited on a busy SuperLink, and the script then
    stopped the SuperLink too. Now the SuperExec alone is started again."""
    marker = tmp_path / "crashed-once"
    flaky = (f"import pathlib, sys, time\nm = pathlib.Path({str(marker)!r})\n"
             "if not m.exists():\n    m.write_text('x'); print('HTTP 500: database is "
             "locked'); sys.exit(1)\ntime.sleep(120)")
    procs, supervisor = supervised(tmp_path, flaky, settle_s=0.0)
    try:
        link = procs.running[0][1]
        first = procs.running[1][1]
        assert supervise_until(supervisor, lambda: procs.running[1][1] is not first) is None
        second = procs.running[1][1]
        time.sleep(0.5)
        assert supervisor.step() is None  # the new one runs
        assert second.poll() is None and link.poll() is None
        assert procs.running[0][1] is link  # the same SuperLink process, never stopped
        err = capsys.readouterr().err
        assert "superexec exited with code 1" in err and "database is locked" in err
        assert "starting superexec again" in err and "the others keep running" in err
    finally:
        procs.stop()
    assert link.poll() is not None and second.poll() is not None  # nothing left running


def test_a_crash_report_keeps_colour_codes_off_a_redirected_log(tmp_path, capsys):
    """Issue 49's trial: the supervisor's report of a crash copied the colour codes of
    Flower's log into the operator's redirected log. They reach a terminal only."""
    flaky = ("import sys\nprint('\\x1b[91mERROR \\x1b[0m:     database is locked')\n"
             "sys.exit(1)")
    procs, supervisor = supervised(tmp_path, flaky, settle_s=0.0)
    try:
        first = procs.running[1][1]
        assert supervise_until(supervisor, lambda: procs.running[1][1] is not first) is None
    finally:
        procs.stop()
    err = capsys.readouterr().err
    assert "ERROR :     database is locked" in err and "\x1b" not in err


def test_a_process_killed_soon_after_it_started_is_started_again(tmp_path, capsys):
    """A SuperExec SIGKILLed 28 s after it started (the crash test on an idle machine) was
    taken for one that could not start, and the supervisor stopped the whole SuperLink.
    A process killed by a signal had started; it is started again however soon."""
    procs, supervisor = supervised(tmp_path, "import time; time.sleep(120)", settle_s=60.0)
    try:
        first = procs.running[1][1]
        first.kill()
        assert supervise_until(supervisor, lambda: procs.running[1][1] is not first) is None
        err = capsys.readouterr().err
        assert "superexec exited with code -9" in err and "starting superexec again" in err
        assert procs.running[0][1].poll() is None  # the SuperLink kept running
    finally:
        procs.stop()


@pytest.mark.parametrize("limits, message", [
    ({"settle_s": 60.0}, "exited 0 s after it started, so starting it again would fail"),
    ({"settle_s": 0.0, "max_restarts": 2}, "superexec exited 3 times in 600 s"),
], ids=["exits-at-start", "crash-loop"])
def test_a_process_that_cannot_run_stops_them_all(tmp_path, capsys, limits, message):
    procs, supervisor = supervised(tmp_path, "import sys; sys.exit(3)", **limits)
    try:
        assert supervise_until(supervisor, lambda: False) == 1
        assert message in capsys.readouterr().err
    finally:
        procs.stop()


# Flower 1.42's own words when the SuperLink refuses to activate a SuperNode (exit 305),
# for an unregistered key and for a node whose earlier session still counts as online.
REFUSAL = ("ERROR :     Exit Code: 305\nFailed to initialize the connection to the SuperLink."
           "\n[code: 2004] Failed to activate SuperNode.")


def refused_node(tmp_path: Path, times: int, earlier: str, monkeypatch):
    """A 'SuperNode' refused activation on its first ``times`` starts, then running, whose
    log held ``earlier`` before; under a Supervisor with the supernode's hint and wait."""
    monkeypatch.setattr(deploy_supervisor, "ONLINE_PATIENCE_S", 0.01)
    log = tmp_path / "supernode.log"
    log.write_text(earlier)
    count = tmp_path / "starts"
    flaky = (f"import pathlib, sys, time\nc = pathlib.Path({str(count)!r})\n"
             "n = int(c.read_text()) if c.exists() else 0\nc.write_text(str(n + 1))\n"
             f"if n < {times}:\n    print({REFUSAL!r}); sys.exit(1)\ntime.sleep(120)")
    procs = Processes()
    procs.start("flower-supernode", [sys.executable, "-c", flaky], dict(os.environ),
                tmp_path, log)
    key, link = "/k/node-0", "link:8000"
    return procs, deploy_supervisor.Supervisor(
        procs, lambda n, t, e: deploy_supervisor.supernode_exit_hint(t, e, key, link),
        settle_s=60.0, pause_s=0.01,
        wait_out=lambda n, t, e: deploy_supervisor.supernode_wait_out(t, e, key, link))


def test_a_restarted_node_whose_old_session_still_counts_online_waits_it_out(
        tmp_path, capsys, monkeypatch):
    """Issue 60's trial: a SuperNode started again within a minute was refused (code 2004)
    while its earlier session still counted as online; the wrapper blamed the key and gave
    up because the exit came within 30 s. A key this node had activated before is
    registered: the refusal is waited out, said so, and the node started again."""
    procs, supervisor = refused_node(tmp_path, 1, "INFO : SuperNode ID: 42\n", monkeypatch)
    try:
        first = procs.running[0][1]
        assert supervise_until(supervisor, lambda: procs.running[0][1] is not first) is None
        time.sleep(0.5)
        assert supervisor.step() is None and procs.running[0][1].poll() is None
    finally:
        procs.stop()
    err = " ".join(capsys.readouterr().err.split())
    assert "refused to activate this SuperNode (code 2004) while its earlier session still " \
           "counts as online" in err and "then starting it again" in err
    assert "not registered" not in err and "stopping all" not in err


@pytest.mark.parametrize("earlier, said", [
    ("INFO : SuperNode ID: 42\n", "this key was activated before"),
    ("", "either its public key /k/node-0.pub is not registered there")],
    ids=["refused-after-the-wait", "never-activated"])
def test_a_node_refused_for_its_key_stops_naming_the_key(tmp_path, capsys, monkeypatch,
                                                         earlier, said):
    """Refused again once its earlier session has expired, or refused with a key never
    activated here: the key is the cause, said with both of Flower's log lines and the
    fix, and the node stops (starting it again would be refused again)."""
    procs, supervisor = refused_node(tmp_path, 9, earlier, monkeypatch)
    try:
        assert supervise_until(supervisor, lambda: False) == 1
    finally:
        procs.stop()
    err = " ".join(capsys.readouterr().err.split())
    assert said in err and "deploy/register-nodes.sh CONNECTION /k/node-0.pub" in err
    assert "'Public key already in use' means it is registered" in err
    assert err.count("still counts as online") == (1 if earlier else 0)


def test_systemd_words_survive_quoting():
    words = ['partition-id=0 cache-dir="/a b/c"', "50%", "$HOME", "back\\slash", "plain/x"]
    line = "ExecStart=/bin/x " + services.exec_line(words)
    assert parse_exec_start(line)[1:] == words


# -- the certificate renewal ---------------------------------------------------------------
def openssl(*args) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True).stdout


def test_renewal_keeps_the_ca_and_the_names_and_says_when_it_is_due(tmp_path):
    certs = tmp_path / "certs"
    assert script("gen-certs.sh", certs, "superlink.example.org", "203.0.113.7",
                  env={"CERT_DAYS": "20"}).returncode == 0
    ca_before = (certs / "ca.crt").read_bytes()
    names = openssl("x509", "-in", str(certs / "server.pem"), "-noout", "-ext",
                    "subjectAltName", "-subject")
    key_before = (certs / "server.key").read_bytes()
    due = script("renew-cert.sh", certs, "--check", "30")
    assert due.returncode == 1 and "expires within 30 days" in due.stderr
    assert script("renew-cert.sh", certs, "--check", "10").returncode == 0
    renewed = script("renew-cert.sh", certs, env={"CERT_DAYS": "400"})
    assert renewed.returncode == 0, renewed.stderr
    assert "sudo systemctl restart fedefc-superlink.service" in renewed.stdout
    assert (certs / "ca.crt").read_bytes() == ca_before  # nodes keep their ca.crt
    assert "server.pem: OK" in openssl("verify", "-CAfile", str(certs / "ca.crt"),
                                       str(certs / "server.pem"))
    assert openssl("x509", "-in", str(certs / "server.pem"), "-noout", "-ext",
                   "subjectAltName", "-subject") == names
    assert (certs / "server.key").read_bytes() != key_before
    assert (certs / "server.key.old").read_bytes() == key_before
    assert (certs / "server.key").stat().st_mode & 0o777 == 0o600
    assert script("renew-cert.sh", certs, "--check", "390").returncode == 0


def test_renewal_refuses_another_cas_key_and_warns_of_an_expiring_ca(tmp_path):
    certs, other = tmp_path / "certs", tmp_path / "other"
    assert script("gen-certs.sh", certs, "localhost", env={"CA_DAYS": "30"}).returncode == 0
    assert script("gen-certs.sh", other, "localhost").returncode == 0
    before = (certs / "server.pem").read_bytes()
    wrong = script("renew-cert.sh", certs, "--ca-key", other / "ca.key")
    assert wrong.returncode == 1 and "is not the key of the CA" in wrong.stderr
    assert (certs / "server.pem").read_bytes() == before
    assert not (certs / "server.pem.new").exists()
    (certs / "ca.key").rename(tmp_path / "offline-ca.key")  # moved offline, as advised
    missing = script("renew-cert.sh", certs)
    assert missing.returncode == 2 and "--ca-key FILE" in missing.stderr
    late = script("renew-cert.sh", certs, "--ca-key", tmp_path / "offline-ca.key")
    assert late.returncode == 0 and "WARNING: the CA expires" in late.stderr


# -- results to the operator ----------------------------------------------------------------
def results_folder(root: Path, summary: dict, files=("config.json", "metrics.jsonl",
                                                     "model.pt")) -> Path:
    root.mkdir(parents=True)
    for name in files:
        (root / name).write_text("{}")
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def test_fetch_copies_checks_and_summarizes_a_run(tmp_path, capsys):
    source = results_folder(tmp_path / "run", {"status": "completed", "final_acc": 0.9,
                                               "t_e": 3, "client_failures": 0})
    assert main(["deploy", "fetch", str(source), str(tmp_path / "here")]) == 0
    out = capsys.readouterr().out
    assert ": completed\n  accuracy (no evaluation): final 0.9000\n  T_e 3 " in out
    assert f"files: {tmp_path / 'here'} (summary.json, metrics.jsonl, model.pt" in out
    for name in ("config.json", "metrics.jsonl", "summary.json", "model.pt"):
        assert (tmp_path / "here" / name).read_bytes() == (source / name).read_bytes()
    assert main(["deploy", "fetch", str(source), str(tmp_path / "here")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_fetch_reports_a_failed_or_unfinished_run(tmp_path, capsys):
    failed = results_folder(tmp_path / "failed", {"status": "failed",
                                                  "failure": "no node trained in round 1"},
                            files=("config.json", "metrics.jsonl"))
    assert main(["deploy", "fetch", str(failed), str(tmp_path / "a")]) == 1
    assert "the run FAILED: no node trained in round 1" in capsys.readouterr().err
    unfinished = results_folder(tmp_path / "unfinished", {}, files=("config.json",))
    (unfinished / "summary.json").unlink()
    assert main(["deploy", "fetch", str(unfinished), str(tmp_path / "b")]) == 1
    assert "metrics.jsonl, summary.json, model.pt missing" in capsys.readouterr().err


def test_fetch_from_the_superlink_machine_uses_scp(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_scp(argv):
        calls.append(argv)
        results_folder(Path(argv[-1]), {"status": "completed"})
        return 0

    monkeypatch.setattr(deploy_export.subprocess, "call", fake_scp)
    monkeypatch.setattr(deploy_export.shutil, "which", lambda name: "/usr/bin/scp")
    dest = tmp_path / "here"
    assert main(["deploy", "fetch", "op@link.example.org:/srv/runs/r1", str(dest)]) == 0
    assert calls == [["scp", "-r", "-p", "-q", "op@link.example.org:/srv/runs/r1", str(dest)]]
    assert not deploy_export._is_remote("/abs/path:with-colon") and deploy_export._is_remote("h:/x")


def test_the_pinned_torch_admits_pytorchs_cpu_build():
    """docs/DEPLOYMENT.md, "Install": the CPU-only install puts torch 2.14.1+cpu from
    PyTorch's index first; pip keeps it only if the project's pins admit that build."""
    deps = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in ("torch", "torchvision"):
        req = next(Requirement(d) for d in deps if Requirement(d).name == name)
        version = next(iter(req.specifier)).version
        assert req.specifier.contains(f"{version}+cpu"), req
        assert f"{name}=={version}" in (APP_DIR / "docs" / "DEPLOYMENT.md").read_text()


def test_noop_app_pyproject_is_valid_toml_with_declared_keys():
    config = tomllib.loads((NOOP_APP / "pyproject.toml").read_text())
    assert {"mode", "rounds", "nodes", "floats", "marker-dir"} <= set(
        config["tool"]["flwr"]["app"]["config"])
    assert tomli_w.dumps(config)  # tomli_w (the signer's writer) can write it back


# -- the compose TLS variant's files ---------------------------------------------------------
CONTAINER_UID = 49999  # the flwr images' user "app"


def compose_block(title: str) -> list[str]:
    """The lines of the first bash block after ``title`` in docs/DEPLOYMENT.md, each
    continued line joined."""
    text = (APP_DIR / "docs" / "DEPLOYMENT.md").read_text()
    section = text[text.index(title):]
    block = section[section.index("```bash\n") + 8:section.index("```", section.index(
        "```bash\n") + 8)]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def compose_tls_block() -> list[str]:
    return compose_block("**TLS variant**")


def test_the_by_hand_compose_steps_are_those_of_the_demo_script():
    """Issue 49's trial: the doc's by-hand compose block said `docker compose` with
    Flower's registry images and the 20-round, 2-epoch demo config, where the machine
    needed Compose v1 and the local stand-in images, and deploy/compose-demo.sh runs 3
    rounds. The block now takes the script's steps: the CLI that is installed, the
    classic builder, the script's stand-in build and image settings, its run."""
    lines = compose_block("**By hand**, insecure")
    demo = (DEPLOY_DIR / "compose-demo.sh").read_text()
    assert 'compose="docker compose"; docker compose version >/dev/null 2>&1 || ' \
           "compose=docker-compose" in lines
    assert not [line for line in lines if line.startswith("docker compose ")]
    up = next(line for line in lines if " up --build" in line)
    assert up.startswith("DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0 $compose -p fedefc ")
    assert "DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0" in demo  # the script's build
    build = next(line for line in lines if line.startswith("DOCKER_BUILDKIT=0 docker build"))
    assert build.split()[:6] == ["DOCKER_BUILDKIT=0", "docker", "build", "-q", "--target",
                                 "$t"]
    assert '-t "local/flwr-$t:1.42.0" -f "$deploy_dir/flwr-standins.Dockerfile"' in demo
    assert "-t local/flwr-$t:1.42.0 -f deploy/flwr-standins.Dockerfile deploy" in build
    exports = " ".join(line for line in lines if line.startswith("export "))
    for name in ("superlink", "supernode", "superexec"):
        setting = f"FLWR_{name.upper()}_IMAGE=local/flwr-{name}:1.42.0"
        assert setting in exports and f"export {setting}" in demo
    assert "FLEET_FRONT_BASE_IMAGE=$base" in exports
    submit = " ".join(next(line for line in lines if line.startswith(
        "fedefc deploy submit")).split())
    script_sets = re.search(r'--set "rounds=\$rounds" \\\n\s*--set start-round=1 --set '
                            r"gamma-thr=1", demo)
    assert script_sets and re.search(r"^rounds=3\b|\brounds=3 ", demo, re.M)
    assert submit.endswith("deploy/demo-run-config.toml --set rounds=3 --set start-round=1 "
                           "--set gamma-thr=1")


def test_compose_tls_steps_leave_each_file_readable_by_who_needs_it_next(tmp_path):
    """The doc's TLS compose steps, up to and with its ``sudo chown``, as a non-root user
    (uid 1000 when the tests run as root, whose files are then given to it first): every
    file a container mounts is readable by uid 49999, every file the later steps read by
    the user, and the private files stay 0600."""
    demo = tmp_path / "demo"
    user = os.getuid() or 1000
    lines = compose_tls_block()
    expand = lambda words: subprocess.run(  # noqa: E731 - bash brace expansion
        ["bash", "-c", f"printf '%s\\0' {words}"], capture_output=True, text=True,
        check=True).stdout.split("\0")[:-1]
    chowned: list[Path] = []
    for line in lines:
        if line.startswith("deploy/gen-"):
            name, rest = line.split(" ", 1)
            args = [a.replace("deploy/demo", str(demo)) for a in expand(rest.split("#")[0])]
            assert script(name.removeprefix("deploy/"), *args).returncode == 0, line
        elif line.startswith("sudo chown"):
            words = expand(line.removeprefix("sudo chown "))
            assert words[0] == f"{CONTAINER_UID}:{CONTAINER_UID}" and "-R" not in words
            chowned = [Path(w.replace("deploy/demo", str(demo))) for w in words[1:]]
            break
    assert chowned, "the doc's TLS steps have no chown line"
    if os.getuid() == 0:  # as the user would own them, then the doc's chown
        for path in [demo, *demo.rglob("*")]:
            os.chown(path, user, user)
        for path in chowned:
            os.chown(path, CONTAINER_UID, CONTAINER_UID)
        owner = {p: p.stat().st_uid for p in demo.rglob("*")}
    else:  # the chown's effect, computed
        owner = {p: CONTAINER_UID if p in chowned else p.stat().st_uid for p in demo.rglob("*")}

    def can_read(path: Path, uid: int) -> bool:
        st = path.stat()
        return bool(st.st_mode & 0o004) or (owner[path] == uid and bool(st.st_mode & 0o400))

    mounted = set()
    for service in yaml.safe_load((DEPLOY_DIR / "compose.tls.yml").read_text())[
            "services"].values():
        for volume in service.get("volumes", []):
            source = volume.replace("${FEDEFC_DEMO_DIR:-./demo}", str(demo)).split(":")[0]
            mounted.add(Path(source))
    for path in mounted:  # single files (a file mount ignores its folders' modes)
        assert path.is_file(), path
        assert can_read(path, CONTAINER_UID), f"a container cannot read {path}"
    later = [Path(w.replace("deploy/demo", str(demo))) for line in lines
             if not line.startswith(("deploy/gen-", "sudo")) for w in expand(line)
             if w.startswith("deploy/demo/")]
    assert {p.name for p in later} == {"ca.crt", "node-0.pub", "node-1.pub", "node-2.pub"}
    for path in later:
        assert can_read(path, user), f"the user cannot read {path} after the chown"
        for folder in path.relative_to(demo).parents:
            assert (demo / folder).stat().st_mode & 0o100 and owner.get(demo / folder, user) \
                == user
    for path in chowned:
        assert path.stat().st_mode & 0o777 == 0o600 and path in mounted
    assert set(chowned) == {p for p in mounted if not can_read(p, user) or p in chowned}


def fake_simulation(tmp_path: Path, run):
    """A stand-in for :class:`fedefc_cli.flower.LocalSimulation` whose ``run`` returns
    ``run(log_path)``: (run id, Flower's status); its SuperLink log says it started."""

    class Fake:
        log_path = tmp_path / "superlink.log"

        def __init__(self, work, ray_address=None):
            self.log_path.write_text("uvicorn started\n")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def run(self, *args, log_path=None, **kwargs):
            return run(log_path)

    return Fake


def test_a_simulation_whose_summary_says_failed_is_not_returned_as_a_success(tmp_path,
                                                                              monkeypatch):
    """``fedefc run`` and the grids: Flower said completed, the summary says failed."""
    out = tmp_path / "run"
    results_folder(out, {"status": "failed", "failure": "every round failed"})

    monkeypatch.setattr(simulation, "LocalSimulation", fake_simulation(
        tmp_path, lambda log_path: (9, "finished:completed")))
    with pytest.raises(LaunchError, match="run 9 FAILED: every round failed"):
        simulation.run_simulation_job({"out-dir": str(out), "num-clients": 2}, checked=True)


def test_a_failed_simulation_names_flowers_reason_and_the_run_logs_tail(tmp_path, monkeypatch):
    """A run Flower ends ``finished:failed`` is reported with the reason Flower recorded
    (``flwr ls``'s status details: the simulation's exception, a task that sent no
    heartbeat) and the end of the run's own log, where the ServerApp's traceback is, not
    only the SuperLink's log (a CI failure once showed nothing else)."""
    from fedefc_cli import flower
    runs = [{"run-id": "7", "created-at": "2026-11-29T03:03:17", "status": "finished:failed",
             "status-details": "Simulation failed with exception: boom"},
            {"run-id": "6", "created-at": "2026-11-29T03:00:00",
             "status": "finished:completed", "status-details": ""}]
    monkeypatch.setattr(flower, "flwr_json", lambda args, env, cwd: {"runs": runs})
    sim = flower.LocalSimulation(tmp_path / "sim")
    assert sim.latest_status() == (7, "finished:failed (Simulation failed with exception: "
                                      "boom)")
    runs[0].update({"status": "finished:completed", "status-details": "ignored"})
    assert sim.latest_status() == (7, "finished:completed")

    run_log = tmp_path / "run.log"
    run_log.write_text("an earlier run's log\n")

    def failed(log_path):
        with open(log_path, "a") as log:
            log.write("round 1 ...\nTraceback (most recent call last):\nValueError: bad\n")
        return 7, "finished:failed (Simulation failed with exception: bad)"

    monkeypatch.setattr(simulation, "LocalSimulation", fake_simulation(tmp_path, failed))
    with pytest.raises(LaunchError) as err:
        simulation.run_simulation_job({"out-dir": str(tmp_path / "out"), "num-clients": 2},
                                      log_path=run_log, checked=True)
    text = str(err.value)
    assert "run 7 ended 'finished:failed (Simulation failed with exception: bad)'" in text
    assert f"Run log tail ({run_log}):" in text and "ValueError: bad" in text
    assert "an earlier run's log" not in text  # only this run's part of the file
    assert text.index("ValueError: bad") < text.index("SuperLink log tail:\nuvicorn started")


@pytest.mark.parametrize("recorded", [None, 0, 1],
                         ids=["nothing-recorded", "round-0-recorded", "after-a-round"])
def test_a_run_whose_ray_did_not_start_in_time_is_started_again(tmp_path, monkeypatch,
                                                                capsys, recorded):
    """Ray waits a fixed 30 s for its node to register; on a busy machine it may not (the
    suite's simulation job failed so, twice in a row, while the ServerApp had already
    recorded round 0). Before round 1 nothing is lost: the run starts again, in a folder
    cleared of what the failed attempt wrote, saying so; a run that recorded a round is
    never started again."""
    out, run_log = tmp_path / "out", tmp_path / "run.log"
    out.mkdir()
    if recorded is not None:
        (out / "config.json").write_text("{}")
        (out / "metrics.jsonl").write_text(json.dumps({"round": recorded}) + "\n")
    attempts = []

    def attempt(log_path):
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            with open(log_path, "a") as log:
                log.write(f"Exception: {simulation.RAY_START_TIMEOUT}. This could ...\n")
            return 5, "finished:failed (Simulation failed with exception: crashed)"
        check_output_dir(out)  # what the ServerApp checks before it writes
        (out / "summary.json").write_text(json.dumps({"final_acc": 0.5}))
        return 6, "finished:completed"

    monkeypatch.setattr(simulation, "LocalSimulation", fake_simulation(tmp_path, attempt))
    monkeypatch.setattr(simulation, "RAY_START_PAUSE_S", 0)
    job = {"out-dir": str(out), "num-clients": 2}
    if recorded == 1:
        with pytest.raises(LaunchError, match="run 5 ended 'finished:failed"):
            simulation.run_simulation_job(job, log_path=run_log, checked=True)
        assert attempts == [1] and (out / "metrics.jsonl").exists()
    else:
        assert simulation.run_simulation_job(job, log_path=run_log,
                                             checked=True)["final_acc"] == 0.5
        assert attempts == [1, 2]
        assert ("run 5: Ray's node did not start within Ray's 30 s (a busy machine), before "
                "round 1; starting the run again in 0 s (attempt 2 of 4)"
                in capsys.readouterr().err)


def test_a_run_whose_ray_never_starts_gives_up_after_four_attempts(tmp_path, monkeypatch):
    """Four attempts, 15, 30 and 60 s apart, then the error with the last attempt's log:
    a machine too busy for Ray is named, not waited on for ever."""
    out, run_log = tmp_path / "out", tmp_path / "run.log"
    out.mkdir()
    attempts = []

    def attempt(log_path):
        attempts.append(len(attempts) + 1)
        with open(log_path, "a") as log:
            log.write(f"attempt {len(attempts)}: {simulation.RAY_START_TIMEOUT}\n")
        return len(attempts), "finished:failed (Simulation failed with exception: crashed)"

    pauses = []
    monkeypatch.setattr(simulation, "LocalSimulation", fake_simulation(tmp_path, attempt))
    monkeypatch.setattr(simulation.time, "sleep", pauses.append)
    with pytest.raises(LaunchError, match="run 4 ended 'finished:failed") as err:
        simulation.run_simulation_job({"out-dir": str(out), "num-clients": 2},
                                      log_path=run_log, checked=True)
    assert attempts == [1, 2, 3, 4]
    assert pauses == [15, 30, 60]  # doubling: a busy machine gets longer to settle
    assert "attempt 4: The current node" in str(err.value)
    assert "attempt 3: The current node" not in str(err.value)  # only the last attempt's


# -- the compose demo's script (it runs Docker, so only its refusals run here) ---------------
@pytest.mark.parametrize("args, code, message", [
    (["--rounds", "1"], 1, "--rounds '1' is not a whole number >= 2 (prestopping starts "
                           "after round 1); e.g. --rounds 3"),
    (["--frobnicate"], 2, "unknown argument '--frobnicate'"),
], ids=["too-few-rounds", "unknown-flag"])
def test_compose_demo_refuses_bad_arguments_before_touching_docker(args, code, message):
    """deploy/compose-demo.sh (docs/DEPLOYMENT.md, "Docker Compose demo") names the bad
    value and the fix before it looks for Docker, and prints its usage for a flag it does
    not know."""
    out = script("compose-demo.sh", *args)
    assert out.returncode == code and message in out.stderr, out.stderr
    if code == 2:
        assert "usage: deploy/compose-demo.sh [--base-image IMAGE]" in out.stderr


# -- local accounts on the SuperLink machine: the documented nftables rule -------------------
def documented_block(doc: Path, starts: str) -> str:
    """The fenced block of ``doc`` whose first line starts with ``starts``."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", doc.read_text(), re.S | re.M)
    return next(b for b in blocks if b.startswith(starts))


def connects(port: int, user: str) -> bool:
    """Whether a process running as ``user`` can open a TCP connection to 127.0.0.1:port
    (bash's /dev/tcp: the account may not read this checkout's interpreter)."""
    return subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], user=user,
                          cwd="/", capture_output=True,
                          timeout=patience(120)).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None,
                    reason="needs root and nftables")
def test_the_documented_loopback_rule_keeps_other_accounts_off_the_port():
    """docs/DEPLOYMENT.md, "Local users": the nftables block, applied as written (its own
    table name and port; root standing in for the SuperLink's account ``fedefc``), lets
    the SuperLink's and nginx's accounts reach the port on the loopback and refuses any
    other account. The block as first written there was a syntax error to nft."""
    rule = documented_block(APP_DIR / "docs" / "DEPLOYMENT.md", "table inet superlink")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        table = f"fedefc_test_{os.getpid()}"
        rule = (rule.replace("table inet superlink", f"table inet {table}")
                .replace("dport 8000", f"dport {port}").replace('"fedefc"', '"root"'))
        assert connects(port, "nobody")  # open before the rule
        applied = subprocess.run(["nft", "-f", "-"], input=rule, text=True,
                                 capture_output=True)
        assert applied.returncode == 0, applied.stderr
        try:
            allowed = {user: connects(port, user) for user in ("root", "www-data", "nobody")}
        finally:
            subprocess.run(["nft", "delete", "table", "inet", table], check=True)
    assert allowed == {"root": True, "www-data": True, "nobody": False}


def test_a_private_simulation_superlink_keeps_its_state_in_memory_not_sqlite(
        monkeypatch, tmp_path):
    """Under load a SuperLink's sqlite file reported "database is locked" (issue 60):
    the private simulation SuperLink, never restarted, is started with Flower's
    in-memory state, which Flower's own factory serves without sqlite."""
    from flwr.server.superlink.linkstate import InMemoryLinkState, LinkStateFactory
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    from fedefc_cli import flower

    started = []
    sim = flower.LocalSimulation(tmp_path / "sim")
    monkeypatch.setattr(sim.procs, "start", lambda name, cmd, *a: started.append(cmd))
    monkeypatch.setattr(flower, "wait_for_port", lambda *a: None)
    sim._start()
    cmd = started[0]
    assert Path(cmd[0]).name == "flower-superlink"
    database = cmd[cmd.index("--database") + 1]
    assert database == flower.MEMORY_STATE and cmd.count("--database") == 1
    state = LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory()).state()
    assert isinstance(state, InMemoryLinkState)
    assert not list((tmp_path / "sim").glob("*.db"))
