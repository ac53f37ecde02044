"""docs/DEPLOYMENT.md as a newcomer walks it, and the deployment's secrets.

- :func:`run_quick_start` executes the quick start's bash block exactly as the doc
  writes it (read from the file, so the doc cannot drift from the code), changing only
  the port 8000 (to a free one) and ``/tmp/fedefc`` (to a temporary folder), with
  ``HOME`` in that folder; ``test_quick_start_runs_as_documented`` in
  test_deployment.py runs it beside the other deployment jobs.
- Every ``fedefc`` / ``deploy/start-*.sh`` command in the doc parses with the real
  argument parser; every private key or secret the doc has the scripts write lands
  outside the checkout or in a git-ignored place.
- The deploy/ scripts create owner-only files and refuse a place where ``git add -A``
  would take them; ``fedefc deploy`` refuses a private key or secret others can read.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.common.logger import ConsoleHandler

from common.methods import load_run_config
from fedefc_cli import deploy_flags, deploy_submit, flower
from fedefc_cli.deploy_local import DEPLOY_DIR
from fedefc_cli.deploy_submit import write_connection
from fedefc_cli.deploy_supervisor import supernode_exit_hint
from fedefc_cli.log_view import LogView
from fedefc_cli.errors import EXIT_DEGRADED, LaunchError
from fedefc_cli.flower import RunOutcome, degradation_reason, failure_reason, free_port
from fedefc_cli.main import build_parser, main
from fedefc_cli.run_configs import APP_DIR
from fedefc_server import checkpoint
from fedefc_server.summary import RunFacts, build_summary, summary_lines
from tests.helpers import RUN_LIMIT_S, patience

DOC = APP_DIR / "docs" / "DEPLOYMENT.md"


def section(title: str) -> str:
    """The text of the doc's ``## <title>...`` section."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def quick_start_script() -> str:
    blocks = bash_blocks(section("Quick start"))
    assert len(blocks) == 1, "the quick start is one bash block"
    return blocks[0]


def command_lines(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" # ")[0].strip() for line in joined.splitlines() if line.strip()]


# -- the quick start, run as written -----------------------------------------------------
def processes_with_home(home: Path) -> list[int]:
    """Living processes whose environment has HOME=home: everything the quick start
    started (Flower's processes inherit the environment)."""
    marker = b"HOME=" + bytes(home)
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in env.read_bytes().split(b"\0"):
                state = (env.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def _kill(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_block(script: str, base: Path, timeout: float | None = None) -> dict:
    """Run a bash block of the doc in the checkout (as the doc says: the environment
    active, from the checkout's root), with ``HOME`` in ``base``, for at most ``timeout``
    seconds (default: ``patience(RUN_LIMIT_S)``). Whatever it leaves running is reported in
    ``left`` and then stopped, also on a failure or a timeout."""
    home = base / "home"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env.update(HOME=str(home), VIRTUAL_ENV=sys.prefix,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    log = base / "block.log"
    with open(log, "wb") as out:
        shell = subprocess.Popen(["bash", "-c", script], cwd=APP_DIR, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = shell.wait(timeout=patience(RUN_LIMIT_S) if timeout is None else timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        left = processes_with_home(home)
        if shell.poll() is None:  # the block's own `kill $(jobs -p)` never ran
            os.killpg(shell.pid, signal.SIGTERM)
        _kill(left, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while processes_with_home(home) and time.monotonic() < deadline:
            time.sleep(0.5)
        _kill(processes_with_home(home), signal.SIGKILL)
        shell.wait()
    return {"code": code, "log": log.read_text(errors="replace"), "left": left, "home": home}


def run_quick_start(base: Path, timeout: float | None = None) -> dict:
    """The quick start's block, port 8000 and ``/tmp/fedefc`` replaced."""
    port = free_port()
    script = re.sub(r"\b8000\b", str(port), quick_start_script())
    script = script.replace("/tmp/fedefc", str(base / "qs"))
    return {**run_block(script, base, timeout), "out": base / "qs" / "runs" / "first",
            "state": base / "qs", "port": port}


def tls_walkthrough_script() -> str:
    """The one-machine block of "Across machines, with TLS and SuperNode authentication"."""
    blocks = bash_blocks(section("Across machines"))
    return blocks[0]


def run_tls_walkthrough(base: Path, timeout: float | None = None) -> dict:
    """That block as written, port 8000 replaced."""
    port = free_port()
    script = re.sub(r"\b8000\b", str(port), tls_walkthrough_script())
    return {**run_block(script, base, timeout), "port": port}


# -- the doc's commands ------------------------------------------------------------------
def expand(words: str, home: Path) -> list[str]:
    """Shell words as bash expands them (``~``, ``$HOME``, braces; the loop variable
    ``$k`` as 0)."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {words}"],
                         env={"HOME": str(home), "k": "0"}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split("\0")[:-1]


def documented_commands(home: Path) -> list[list[str]]:
    """Every ``fedefc ...`` and ``deploy/start-*.sh ...`` command of the doc's bash
    blocks, as ``fedefc`` arguments."""
    found = []
    for block in bash_blocks(DOC.read_text()):
        for line in command_lines(block):
            if not line.startswith(("fedefc ", "deploy/start-")):
                continue
            words = expand(line.rstrip("&").strip(), home)
            if words[0] == "fedefc":
                found.append(words[1:])
            elif words[0] in ("deploy/start-superlink.sh", "deploy/start-supernode.sh"):
                found.append(["deploy", words[0].split("-")[1].removesuffix(".sh"), *words[1:]])
    return found


def test_every_documented_command_parses(tmp_path):
    commands = documented_commands(tmp_path)
    kinds = {tuple(c[:2]) for c in commands}
    assert {("deploy", "superlink"), ("deploy", "supernode"), ("deploy", "connection"),
            ("deploy", "submit"), ("deploy", "export")} <= kinds
    parser = build_parser()
    for args in commands:
        parser.parse_args(args)  # an unknown or misspelt flag exits 2 here




def documented_private_files(home: Path) -> list[Path]:
    """The private keys and secrets the doc's deploy/gen-*.sh commands write."""
    files = []
    for block in bash_blocks(DOC.read_text()):
        for line in command_lines(block):
            script, _, rest = line.partition(" ")
            if not script.startswith("deploy/gen-"):
                continue
            args = expand(rest, home)
            if script == "deploy/gen-certs.sh":
                files += [Path(args[0]) / "ca.key", Path(args[0]) / "server.key"]
            elif script in ("deploy/gen-node-keys.sh", "deploy/gen-signing-key.sh"):
                files += [Path(args[0]) / name for name in args[1:]]
            elif script == "deploy/gen-secret.sh":
                files += [Path(a) for a in args]
    return files


def test_documented_keys_and_secrets_are_out_of_a_commits_reach(tmp_path):
    files = documented_private_files(tmp_path)
    names = {f.name for f in files}
    assert {"ca.key", "server.key", "node-0", "superlink.secret", "node-0.secret",
            "coordinator"} <= names
    for file in files:
        path = file if file.is_absolute() else APP_DIR / file
        if path.is_relative_to(APP_DIR):  # inside the checkout: must be git-ignored
            ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=APP_DIR)
            assert ignored.returncode == 0, f"{file} would be committed by git add -A"


# -- the scripts' files: owner-only, never where a commit takes them --------------------------
def script(name: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run deploy/NAME with a permissive umask (022), as a user's shell would."""
    return subprocess.run(["bash", "-c", 'umask 022 && exec bash "$0" "$@"',
                           str(DEPLOY_DIR / name), *map(str, args)],
                          cwd=cwd, capture_output=True, text=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_scripts_create_private_files_owner_only(tmp_path):
    certs, keys = tmp_path / "fedefc" / "certs", tmp_path / "fedefc" / "keys"
    assert script("gen-certs.sh", certs, "localhost").returncode == 0
    assert script("gen-node-keys.sh", keys, "node-0", "node-1").returncode == 0
    assert script("gen-secret.sh", tmp_path / "new" / "node-0.secret").returncode == 0
    for private in (certs / "ca.key", certs / "server.key", keys / "node-0", keys / "node-1",
                    tmp_path / "new" / "node-0.secret"):
        assert mode(private) == 0o600, private
    for folder in (certs, keys, tmp_path / "new"):
        assert mode(folder) == 0o700, folder
    for public in (certs / "ca.crt", certs / "server.pem", keys / "node-0.pub"):
        assert mode(public) == 0o644, public


def test_scripts_refuse_to_write_where_git_add_would_commit(tmp_path):
    repo = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for name, args, written in (
            ("gen-secret.sh", [repo / "node-0.secret"], repo / "node-0.secret"),
            ("gen-node-keys.sh", [repo / "keys", "node-0"], repo / "keys"),
            ("gen-certs.sh", [repo / "certs", "localhost"], repo / "certs")):
        out = script(name, *args)
        assert out.returncode == 2, out.stderr
        assert "git add -A' would commit it" in out.stderr and "nothing written" in out.stderr
        assert not written.exists()
    (repo / ".gitignore").write_text("*.secret\n/keys/\n")
    assert script("gen-secret.sh", repo / "node-0.secret").returncode == 0
    assert script("gen-node-keys.sh", repo / "keys", "node-0").returncode == 0
    assert mode(repo / "node-0.secret") == 0o600 and mode(repo / "keys" / "node-0") == 0o600


def test_register_refuses_a_private_key_before_registering_any(tmp_path, capsys):
    assert script("gen-node-keys.sh", tmp_path / "keys", "node-0").returncode == 0
    private, public = tmp_path / "keys" / "node-0", tmp_path / "keys" / "node-0.pub"
    assert main(["deploy", "register", "fedefc", str(public), str(private)]) == 2
    err = capsys.readouterr().err
    assert f"{private} is a private key: register its public key ({private}.pub)" in err
    assert main(["deploy", "register", "fedefc", str(tmp_path / "nope.pub")]) == 2
    assert "not found (nothing registered)" in capsys.readouterr().err


def test_scripts_name_the_missing_environment_and_the_fix(tmp_path):
    out = subprocess.run(["bash", str(DEPLOY_DIR / "start-superlink.sh")],
                         env={**os.environ, "PYTHON": str(tmp_path / "no-python")},
                         capture_output=True, text=True)
    assert out.returncode == 2 and "PYTHON=/path/to/.venv/bin/python" in out.stderr
    bare = tmp_path / "bare"  # a venv without the project's packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(["bash", str(DEPLOY_DIR / "start-supernode.sh")], cwd=APP_DIR,
                         env={**env, "PYTHON": str(bare / "bin" / "python")},
                         capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "No module named" in out.stderr and "Activate the environment" in out.stderr


# -- fedefc deploy refuses readable secrets, busy ports; explains failures -------------------
@pytest.fixture
def readable(tmp_path) -> Path:
    """A secret whose mode lets the group and others read it."""
    path = tmp_path / "node-0.secret"
    path.write_text("0" * 64)
    path.chmod(0o644)
    return path


def test_deploy_refuses_a_secret_or_key_others_can_read(tmp_path, readable, capsys):
    node = ["deploy", "supernode", "--superlink", "127.0.0.1:1", "--partition-id", "0",
            "--num-partitions", "1", "--state-dir", str(tmp_path / "state")]
    assert main([*node, "--superexec-secret", str(readable)]) == 2
    err = capsys.readouterr().err
    assert f"--superexec-secret {readable} is readable" in err and "mode 0644" in err
    assert f"chmod 600 {readable}" in err
    assert main([*node, "--ca-cert", str(readable), "--auth-key", str(readable)]) == 2
    assert f"--auth-key {readable} is readable" in capsys.readouterr().err
    assert main(["deploy", "superlink", "--host", "127.0.0.1", "--port", str(free_port()),
                 "--superexec-secret", str(readable), "--state-dir", str(tmp_path / "l")]) == 2
    assert f"chmod 600 {readable}" in capsys.readouterr().err
    assert not (tmp_path / "state").exists() and not (tmp_path / "l").exists()
    readable.chmod(0o600)  # the fix the error names is enough
    assert deploy_flags.check_private(readable, "x") == str(readable)


def test_superlink_refuses_a_readable_tls_key(tmp_path, capsys):
    certs = tmp_path / "certs"
    assert script("gen-certs.sh", certs, "localhost").returncode == 0
    (certs / "server.key").chmod(0o640)
    assert main(["deploy", "superlink", "--host", "127.0.0.1", "--certs", str(certs),
                 "--port", str(free_port()), "--state-dir", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert f"TLS private key {certs / 'server.key'} is readable" in err and "chmod 600" in err


def test_superlink_refuses_a_busy_port(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["deploy", "superlink", "--host", "127.0.0.1", "--port", str(port),
                     "--state-dir", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert f"--port {port} on 127.0.0.1 is in use" in err and "kill $(jobs -p)" in err


# Flower 1.42's own words when the SuperLink refuses a SuperNode's key (exit 305).
FLOWER_REFUSAL = """ERROR :     Exit Code: 305
Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.
"""


def test_supernode_exit_hint_names_the_unregistered_key():
    hint = supernode_exit_hint(FLOWER_REFUSAL, "", "/home/u/.fedefc/keys/node-0",
                               "link:8000")
    assert "/home/u/.fedefc/keys/node-0.pub is not registered" in hint
    assert "deploy/register-nodes.sh CONNECTION /home/u/.fedefc/keys/node-0.pub" in hint
    without_key = supernode_exit_hint(FLOWER_REFUSAL, "", None, "link:8000")
    assert "could not connect to the SuperLink at link:8000" in without_key
    assert supernode_exit_hint("INFO: SuperNode terminated gracefully.", "", None, "x") is None


@pytest.mark.parametrize("status,failure,code", [
    ("finished:failed", "no node trained in round 1", 1),
    ("finished:completed", "every round failed", 1),  # a hollow run: never a success
    ("finished:failed", None, 1),
    ("finished:completed", None, 0)], ids=["failed", "hollow", "no-reason", "completed"])
def test_submit_claims_results_only_after_a_completed_run(monkeypatch, capsys, tmp_path,
                                                          status, failure, code):
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(deploy_submit, "submit_run",
                        lambda *a, **k: RunOutcome("42", status, failure))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == code
    out, err = capsys.readouterr()
    assert ("results in" in out) == (code == 0)
    if code:
        assert f"run 42 ended {status}: it did not complete. Reason: " \
               f"{failure or 'its log names no reason'}" in err
        assert "flwr log 42 fedefc" in err
        assert f"if anything, is in {tmp_path}/r on the SuperLink machine" in err


def test_submit_exits_3_naming_the_site_of_a_degraded_run(monkeypatch, capsys, tmp_path):
    """The ServerApp's last lines for a run that lost partition 1 after round 1 of 3
    (told by fedefc_server/summary.py from the records) are what submit reads: Flower
    says completed, submit exits 3 with the reason, and does not claim a clean result."""
    cfg = load_run_config({"method": "fedavg", "prestopping": False, "rounds": 3,
                           "num-clients": 2,
                           "out-dir": str(tmp_path / "r")})
    gone = {"partition": 1, "node": "77", "reason": "its node is no longer connected"}
    rounds = [{"round": 0}, {"round": 1}, {"round": 2, "missing": [gone]},
              {"round": 3, "missing": [gone]}]
    summary = {**build_summary(cfg, rounds, RunFacts({}, {})), "out_dir": "/r"}
    log = [text for _, text in summary_lines(summary)]
    assert summary["status"] == "degraded" and log[-1].startswith("RUN DEGRADED: ")
    outcome = RunOutcome("9", "finished:completed", failure_reason(log, "finished:completed"),
                         degradation_reason(log))
    assert outcome.degraded and not outcome.completed
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(deploy_submit, "submit_run", lambda *a, **k: outcome)
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 3
    out, err = capsys.readouterr()
    assert "results in" not in out
    assert ("run 9 completed DEGRADED: partition 1 missed 2 of 3 rounds (rounds 2-3; last: "
            "node 77: its node is no longer connected)") in err
    assert "max-missed-share=0.1" in err and "flwr log 9 fedefc" in err


def submitted(monkeypatch) -> dict:
    """What ``fedefc deploy submit`` hands Flower (no SuperLink: submit_run captured)."""
    seen: dict = {}
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])

    def submit(connection, run_config, *a, **k):
        seen.update(run_config)
        return RunOutcome("5", "finished:completed", None)

    monkeypatch.setattr(deploy_submit, "submit_run", submit)
    return seen


def interrupted_run(folder: Path, **keys) -> Path:
    """An out-dir as a run stopped after round 2 leaves it: config.json, a checkpoint."""
    folder.mkdir()
    cfg = load_run_config({"method": "fedavg", "prestopping": False, "rounds": 5,
                           "num-clients": 3, "seed": 7, "out-dir": str(folder), **keys})
    (folder / "config.json").write_text(json.dumps(cfg.to_flat()))
    checkpoint.save(folder, checkpoint.Checkpoint(2, [np.zeros(3, np.float32)], {},
                                                  cfg.to_flat()))
    return folder


def test_submit_resume_continues_a_run_with_its_own_config(monkeypatch, capsys, tmp_path):
    """One command resumes a deployment run: its config.json, resume-from and out-dir
    its folder, a --set (rounds) on top; the ServerApp then accepts the checkpoint."""
    out = interrupted_run(tmp_path / "run1")
    seen = submitted(monkeypatch)
    assert main(["deploy", "submit", "fedefc", "--resume", str(out),
                 "--set", "rounds=8"]) == 0
    assert (seen["resume-from"], seen["out-dir"]) == (str(out), str(out))
    assert (seen["method"], seen["seed"], seen["num-clients"], seen["rounds"]) == \
        ("fedavg", 7, 3, 8)
    checkpoint.check_compatible(checkpoint.load(out), seen, out, [(3,)])  # what it checks
    assert f"resuming the run in {out} with its own config.json" in capsys.readouterr().out


def test_submit_resume_of_a_folder_elsewhere_takes_the_config_given(monkeypatch, capsys,
                                                                   tmp_path):
    """The out-dir is on the SuperLink machine only: the preset and --set make the config
    (the ServerApp compares them with the checkpoint's)."""
    seen = submitted(monkeypatch)
    remote = "/srv/fedefc/runs/elsewhere-1"
    assert main(["deploy", "submit", "fedefc", "--resume", remote, "--set", "seed=4"]) == 0
    assert (seen["resume-from"], seen["out-dir"], seen["seed"]) == (remote, remote, 4)
    assert "is not on this machine" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--resume", "runs/r1"], "--resume 'runs/r1' is not absolute"),
    (["configs-free", "--resume", "{out}"], "leave out the preset 'configs-free'"),
    (["--resume", "{empty}"], "no checkpoint.pt there; the run finished no round"),
], ids=["relative", "preset-and-config", "no-checkpoint"])
def test_submit_resume_refuses_what_it_cannot_resume(monkeypatch, capsys, tmp_path, args,
                                                      message):
    out = interrupted_run(tmp_path / "run1")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((out / "config.json").read_text())
    monkeypatch.setattr(deploy_submit, "submit_run", lambda *a, **k: pytest.fail("submitted"))
    argv = [a.format(out=out, empty=empty) for a in args]
    assert main(["deploy", "submit", "fedefc", *argv]) == 2
    assert message in capsys.readouterr().err


def test_submit_help_says_how_to_resume(capsys):
    with pytest.raises(SystemExit):
        main(["deploy", "submit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--resume OUT_DIR" in text and "resume the run whose out-dir is OUT_DIR" in text


def test_submit_says_each_step_before_the_log(monkeypatch, capsys, tmp_path):
    """Nothing is silent for minutes: the config check, the SuperLink, the packing and the
    run id are told on stderr as each starts, before the run's log."""
    events: list[str] = []
    monkeypatch.setattr(deploy_submit, "wait_for_superlink",
                        lambda *a, **k: events.append("superlink"))
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])

    def flwr(args, env, cwd):
        events.append(f"flwr {args[0]}")
        return {"success": True, "run-id": 77}

    monkeypatch.setattr(flower, "flwr_json", flwr)
    monkeypatch.setattr(flower, "_follow_log", lambda *a: events.append("log") or [])
    monkeypatch.setattr(flower, "run_row", lambda *a: {"status": "finished:completed"})
    real_progress = deploy_submit.progress
    monkeypatch.setattr(deploy_submit, "progress",
                        lambda text: events.append(text) or real_progress(text))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 0
    assert events[:2] == ["checking the run config",
                          "asking the SuperLink of connection 'fedefc' (flwr ls)"]
    assert events[2:] == ["superlink",
                          "packing the app and sending it to the SuperLink of 'fedefc' "
                          "(flwr run)", "flwr run",
                          "run 77 submitted; its log follows (flwr log 77 fedefc --stream)",
                          "log"]
    err = capsys.readouterr().err
    assert err.index("checking the run config ...") < err.index("run 77 submitted")


@pytest.mark.parametrize("back", [False, True], ids=["gone", "restarted"])
def test_submit_says_when_the_superlink_stopped_and_where_its_log_is(
        monkeypatch, capsys, tmp_path, back):
    """Issue 30: submit exited with "Connection to the SuperLink is unavailable", the
    cause only in the SuperLink's log. Now it says when it stopped, where that log is and
    how to go on, whether the SuperLink stays away or comes back (the run then failed)."""
    answers = iter([{"success": False, "error-message": "Connection to the SuperLink is "
                                                       "unavailable"}] * (2 if back else 99)
                   + [{"success": True, "runs": [{"status": "finished:failed"}]}] * 9)
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(flower, "flwr_json", lambda args, env, cwd: (
        {"success": True, "run-id": 12} if args[0] == "run" else next(answers)))
    monkeypatch.setattr(flower, "_follow_log", lambda *a: [
        "INFO : [round 3/7] 3 clients", "Connection to the SuperLink is unavailable"])
    monkeypatch.setattr(flower, "RECONNECT_S", 1e9)  # only --reconnect-wait ends the wait
    assert main(["deploy", "submit", "fedefc", "--max-resumes", "0", "--reconnect-wait",
                 "0.3", "--set", f"out-dir={tmp_path}/r"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"The SuperLink of connection 'fedefc' stopped answering at "
                     r"\d\d:\d\d:\d\d", err)
    assert "superlink.log in its state folder on the SuperLink machine" in err
    assert "journalctl -u fedefc-superlink" in err
    assert f"fedefc deploy submit fedefc --resume {tmp_path}/r" in err
    assert ("run 12 ended finished:failed" in err) == back


def test_the_printed_resume_command_is_complete_for_its_deployment(monkeypatch, capsys,
                                                                  tmp_path):
    """Issue 49's trial: after a lost SuperLink, submit printed a resume command without
    the deployment's --sign-key, and run as printed it failed on the signed SuperLink.
    The command now carries the signing key and key id, FLWR_HOME (where the connection
    lives) and, for an out-dir that is not on this machine, the submission's preset and
    --set; run as printed, it submits the same signed run."""
    key = tmp_path / "coordinator"
    key.write_text("key")
    key.chmod(0o600)
    home = tmp_path / "flwr home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    sent: list = []

    def gone(connection, run_config, env, cwd, sign_key=None, **kwargs):
        sent.append((connection, dict(run_config), sign_key, env["FLWR_HOME"]))
        raise flower.SuperLinkGone(connection, "02:24:31")

    monkeypatch.setattr(deploy_submit, "submit_run", gone)
    out = f"{tmp_path}/elsewhere/r"
    assert main(["deploy", "submit", "site", "--sign-key", str(key), "--key-id", "coord",
                 "--set", "rounds=8", "--set", f"out-dir={out}"]) == 1
    printed = capsys.readouterr().err.split("continue the run with: ", 1)[1].strip()
    words = shlex.split(printed)
    assert words[0] == f"FLWR_HOME={home}" and words[1:5] == ["fedefc", "deploy", "submit",
                                                               "site"]
    assert ["--sign-key", str(key)] == words[words.index("--sign-key"):][:2]
    assert ["--key-id", "coord"] == words[words.index("--key-id"):][:2]
    assert "rounds=8" in words and ["--resume", out] == words[words.index("--resume"):][:2]
    build_parser().parse_args(words[2:])  # every flag is the submit command's
    assert main(words[2:]) == 1  # run as printed: the same run, signed, resumed
    (_, first, first_key, _), (connection, again, again_key, again_home) = sent
    assert (connection, again_key, again_home) == ("site", first_key, str(home))
    assert first_key == (str(key), "coord")
    assert again == {**first, "resume-from": out}


def test_a_serverapp_that_raised_is_told_by_its_own_exception(monkeypatch, tmp_path):
    """Issue 49's trial: a ServerApp refused as unsigned gave `Reason: ERROR : Exit Code:
    201`, Flower's code for any exception; the cause was only in the log. The reason is
    now the exception's own line, and where the log did not come through, the exception
    text of Flower's status details."""
    lines = ["INFO : Starting", "ERROR : ServerApp raised an exception",
             "Traceback (most recent call last):", '  File "run_serverapp.py", line 170',
             "    install_from_fab(fab.content)",
             "fedefc_cli.app_signing.UntrustedAppError: refused: the app is not signed; "
             "sign it with fedefc deploy submit --sign-key",
             "ERROR : Exit Code: 201", "ServerApp raised an exception.",
             "ERROR : For more information, visit: <https://flower.ai/docs/ref-exit-codes>"]
    assert flower.failure_reason(lines, "finished:failed") == (
        "UntrustedAppError: refused: the app is not signed; sign it with fedefc deploy "
        "submit --sign-key")
    assert flower.failure_reason(["ERROR : Exit Code: 201"], "finished:failed") is None
    assert flower.flower_reason({
        "status": "finished:failed",
        "status-details": "ServerApp failed with exception: refused: the app is not signed"}
    ) == "the ServerApp raised: refused: the app is not signed"
    assert flower.flower_reason({"status": "running", "status-details": "N/A"}) is None


def site_connection(monkeypatch, home: Path) -> tuple[int, dict[str, str], list]:
    """A connection 'site' to a free local port in ``home``, its env, and the list of
    what flwr is asked (each ask answered as a SuperLink that is up)."""
    port = free_port()
    write_connection(home, "site", f"127.0.0.1:{port}")
    asked: list = []
    monkeypatch.setattr(deploy_submit, "flwr_json",
                        lambda args, env, cwd: asked.append(args) or {"success": True})
    return port, {"FLWR_HOME": str(home)}, asked


def test_a_port_that_refuses_is_reported_at_once_and_ends_the_wait(monkeypatch, capsys,
                                                                   tmp_path):
    """Issue 49's trial: a connection whose port refused waited 60 s and printed flwr's
    "configuration.. Is it running". Now the first refusal is said at once, the wait for
    a SuperLink to start there lasts ``refused_s`` (not the 60 s of one that does not
    answer yet), and flwr is not asked while nothing listens; once something listens,
    flwr is asked as before."""
    port, env, asked = site_connection(monkeypatch, tmp_path)
    with pytest.raises(LaunchError) as err:
        deploy_submit.wait_for_superlink("site", env, tmp_path, timeout=3600, refused_s=0.5)
    assert f"nothing listens on 127.0.0.1:{port}, the address of connection 'site'" in \
        str(err.value) and ".." not in str(err.value)
    assert f"nothing listens on 127.0.0.1:{port} (connection 'site' refused); waiting up " \
           "to 0 s" in capsys.readouterr().err
    assert asked == []
    with socket.socket() as listener:  # a SuperLink that starts listening
        listener.bind(("127.0.0.1", port))
        listener.listen()
        deploy_submit.wait_for_superlink("site", env, tmp_path, timeout=3600, refused_s=0.5)
    assert asked == [["ls", "site"]]
    said = ("Using SuperLink: x (127.0.0.1:1)\n Listing all runs...\n\nConnection to the "
            "SuperLink is unavailable. Please check your network connection and 'address' "
            "in the SuperLink connection configuration.")
    assert deploy_submit.flwr_words(said).endswith("connection configuration")


STAND_IN = """
import socket, sys, time
time.sleep(float(sys.argv[1]))
if sys.argv[2] == "listen":
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(sys.argv[-1])))
        s.listen()
        time.sleep(120)
"""


def stand_in(role: str, port: int, delay: float, then: str, *flags: str
             ) -> subprocess.Popen:
    """A process whose command line reads like a SuperLink's (``role`` ``--port PORT``):
    after ``delay`` s it listens on ``port`` (``then="listen"``) or exits. Returned once
    its command line is its own (a busy machine can take a while from fork to exec)."""
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(delay), then, role,
                             *flags, "--port", str(port)])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + patience(60)
    while role.encode() not in cmdline.read_bytes():
        assert time.monotonic() < deadline, f"the stand-in {role} did not start"
        time.sleep(0.05)
    return proc


def test_the_wait_lasts_while_a_superlink_on_this_machine_is_starting(monkeypatch, capsys,
                                                                       tmp_path):
    """CI's trial: under a full suite the quick start's SuperLink took more than the 30 s
    of ``refused_s`` to listen, and submit gave up beside it. A SuperLink process on this
    machine for that port now keeps the wait going while it lives (here it listens after
    3 s, six times ``refused_s``); one that exits ends the wait ``refused_s`` later; a
    SuperNode pointed at that port is no SuperLink."""
    port, env, asked = site_connection(monkeypatch, tmp_path)
    node = stand_in("flower-supernode", free_port(), 60, "exit", "--superlink",
                    f"127.0.0.1:{port}")
    link = stand_in("superlink", port, 3, "listen", "--host", "127.0.0.1")
    try:
        assert deploy_submit.starting_superlink(("127.0.0.1", port)) == link.pid
        assert deploy_submit.starting_superlink(("192.0.2.1", port)) is None
        deploy_submit.wait_for_superlink("site", env, tmp_path, timeout=3600, refused_s=0.5)
    finally:
        link.kill()
        link.wait()
    assert asked == [["ls", "site"]]
    assert f"the SuperLink on this machine (pid {link.pid}) is starting there: waiting " \
           "for it" in capsys.readouterr().err
    early = stand_in("superlink", port, 2, "exit")
    began = time.monotonic()
    try:
        with pytest.raises(LaunchError, match="refused for 0 s"):
            deploy_submit.wait_for_superlink("site", env, tmp_path, timeout=3600,
                                             refused_s=0.5)
    finally:
        node.kill()
        node.wait()
    assert early.wait() == 0 and time.monotonic() - began >= 2.0


def test_a_node_that_never_answered_is_named_with_what_to_do(tmp_path, capsys):
    """Issue 49's trial: the resumed run failed after 300 s naming node 0 as failed to
    declare, and neither the error nor the docs said that the node was stuck and that
    restarting it clears it. submit and fetch now say so for each such node."""
    reason = ("waited 300 s (wait-for-nodes) for a node of each of the run's 2 partitions "
              "(num-clients); 1 of 2 partitions served by 2 connected nodes; missing "
              "partitions 0; node 8127 failed to declare: no reply within 5 min 00 s")
    told = deploy_submit.explain_failure(RunOutcome("5", "finished:failed", reason), "/srv/r",
                                      "site")
    assert "Node 8127 never answered: if it is online (flwr supernode ls site lists" in told
    assert "restart it on its machine" in told and "fedefc-supernode-K" in told
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "failed", "failure": reason}))
    assert main(["deploy", "fetch", str(run), str(tmp_path / "here")]) == 1
    assert "Node 8127 never answered" in capsys.readouterr().err
    refused = reason.replace("no reply within 5 min 00 s", "error 0: ConfigError: mismatch")
    assert "never answered" not in deploy_submit.explain_failure(
        RunOutcome("5", "finished:failed", refused), "/srv/r", "site")


def attempts(monkeypatch, outcomes: list[RunOutcome]) -> list[dict]:
    """``fedefc deploy submit`` against a SuperLink whose attempts end as ``outcomes``, in
    turn; the run configs it submitted."""
    sent: list[dict] = []
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    ends = iter(outcomes)

    def submit(connection, run_config, *a, **k):
        sent.append(dict(run_config))
        return next(ends)

    monkeypatch.setattr(deploy_submit, "submit_run", submit)
    return sent


def stopped(run_id: str, rounds: int, **keys) -> RunOutcome:
    """A run whose ServerApp was stopped from outside after ``rounds`` recorded rounds."""
    return RunOutcome(run_id, "finished:failed", "ERROR : Task stopped by user.",
                      last_round=rounds, **keys)


def test_submit_resumes_a_run_stopped_from_outside_on_its_own(monkeypatch, capsys,
                                                             tmp_path):
    """Issue 30: a SuperExec or SuperLink that crashed (and was restarted by its
    supervisor) ended the run as failed. submit now resumes it from its checkpoint, as
    often as each attempt gets further, up to --max-resumes."""
    out = f"{tmp_path}/r"
    sent = attempts(monkeypatch, [stopped("7", 1), stopped("8", 2),
                                  RunOutcome("9", "finished:completed", None)])
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={out}"]) == 0
    assert [c.get("resume-from", "") for c in sent] == ["", out, out]
    assert all(c["out-dir"] == out for c in sent)
    err = " ".join(capsys.readouterr().err.split())
    assert (f"run 7 stopped unfinished after round 1 (ERROR : Task stopped by user.); "
            f"resuming it from its checkpoint in {out} (resume 1 of at most 3") in err
    assert "run 8 stopped unfinished after round 2" in err


@pytest.mark.parametrize("outcomes, args, tries", [
    ([stopped("7", 2), stopped("8", 2)], [], 2),  # the resumed attempt got no further
    ([stopped("7", 2)], ["--max-resumes", "0"], 1),
    ([stopped("7", 0)], [], 1),  # no round recorded: no checkpoint to resume from
    ([stopped("7", 2, app_failed=True)], [], 1),  # RUN FAILED: the app gave up itself
    ([RunOutcome("7", "finished:stopped", None, last_round=2)], [], 1),  # flwr stop
], ids=["no-progress", "turned-off", "no-round", "app-failed", "stopped-by-user"])
def test_submit_does_not_resume_what_resuming_cannot_fix(monkeypatch, capsys, tmp_path,
                                                         outcomes, args, tries):
    sent = attempts(monkeypatch, outcomes)
    assert main(["deploy", "submit", "fedefc", *args, "--set", f"out-dir={tmp_path}/r"]) == 1
    assert len(sent) == tries
    assert "did not complete" in capsys.readouterr().err


@pytest.mark.parametrize("outcomes, args, why", [
    ([stopped("7", 1), stopped("8", 2)], ["--max-resumes", "1"],
     "all 1 allowed (--max-resumes) are used"),
    ([stopped("7", 2), stopped("8", 2)], [],
     "this attempt got no further than round 2, as the one before")],
    ids=["used-up", "no-progress"])
def test_the_end_of_automatic_resumes_is_announced(monkeypatch, capsys, tmp_path, outcomes,
                                                   args, why):
    """Issue 60's trial: after the last automatic resume, submit said only "did not
    complete". Now it says that it resumes no more and why, and how to go on."""
    attempts(monkeypatch, outcomes)
    assert main(["deploy", "submit", "fedefc", *args, "--set", f"out-dir={tmp_path}/r"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (f"no more automatic resumes: {why}; run 8 stays stopped after round 2, its "
            f"checkpoint in {tmp_path}/r") in err
    assert f"continue the run with: fedefc deploy submit fedefc --resume {tmp_path}/r" in err


def test_submit_refuses_a_negative_max_resumes(capsys):
    with pytest.raises(SystemExit):
        main(["deploy", "submit", "fedefc", "--max-resumes", "-1"])
    assert "'-1' is not a whole number >= 0; e.g. 3, or 0 to turn it off" in \
        capsys.readouterr().err


def test_a_run_that_stopped_itself_to_be_resumed_is_resumed_with_its_reason():
    """The ServerApp stopped the run itself because a restarted SuperLink may have lost
    round 2's messages (fedefc_server/link_watch.py): its RUN INTERRUPTED reason, not
    the traceback Flower logs after it, is what submit says, and the run is resumable
    (it is not the app giving up: no RUN FAILED line)."""
    lines = ["INFO : [round 1/3] acc 0.3",
             "ERROR : RUN INTERRUPTED: round 2: the link to the SuperLink failed "
             "(ConnectError: refused) while 1 of 2 messages were out without a reply; ...",
             "ERROR : Exception in ServerApp thread", "LinkLost: round 2: the link ..."]
    reason = flower.failure_reason(lines, "finished:failed")
    assert reason.startswith("round 2: the link to the SuperLink failed (ConnectError")
    outcome = RunOutcome("7", "finished:failed", reason, last_round=flower.last_round(lines),
                         app_failed=any(flower.FAILED_LINE.search(x) for x in lines))
    assert outcome.interrupted
    assert flower.failure_reason(lines, "finished:completed") is None


def test_a_failed_run_whose_log_names_no_reason_gets_flowers(monkeypatch, tmp_path):
    """CI, 2026-11-29: a SuperLink killed mid-round came back after its ServerApp's
    heartbeat patience, so it ended the run itself and refused the ServerApp's last
    lines; submit resumed the run but said "its log names no reason". Flower's own
    status details are that reason now, read from the row that said the run finished
    (no second flwr ls); a completed run, or one whose log has a reason, keeps its own."""
    asked: list = []
    row = {"run-id": "12", "status": "finished:failed",
           "status-details": "No heartbeat received"}

    def flwr(args, env, cwd):
        asked.append(args[0])
        return {"success": True, "run-id": 12} if args[0] == "run" else \
            {"success": True, "runs": [row]}

    monkeypatch.setattr(flower, "flwr_json", flwr)
    monkeypatch.setattr(flower, "_follow_log", lambda *a: ["INFO : [round 1/3] acc 0.3"])
    outcome = flower.submit_run("fedefc", {"out-dir": str(tmp_path)}, {}, tmp_path)
    assert outcome.failure == "Flower says: No heartbeat received" and outcome.interrupted
    assert asked == ["run", "ls"]
    monkeypatch.setattr(flower, "_follow_log", lambda *a: [
        "INFO : [round 1/3] acc 0.3", "ERROR : RUN INTERRUPTED: round 2: the link failed"])
    assert flower.submit_run("fedefc", {"out-dir": str(tmp_path)}, {},
                             tmp_path).failure == "round 2: the link failed"
    row.update(status="finished:completed", **{"status-details": ""})
    assert flower.submit_run("fedefc", {"out-dir": str(tmp_path)}, {}, tmp_path).completed


def test_the_last_recorded_round_is_read_from_the_log():
    lines = ["INFO : [round 0/3] acc 0.1", "INFO : [round 2/3] acc 0.5",
             "WARNING : [round 2/3] missed by partition 1", "Task stopped by user."]
    assert flower.last_round(lines) == 2 and flower.last_round(["[round 0/3] x"]) == 0


def test_submit_follows_a_run_that_outlived_a_superlink_restart_to_its_end(monkeypatch,
                                                                           capsys, tmp_path):
    """A SuperLink killed and started again mid-run: its ServerApp retries and goes on, but
    the log stream ended with the old SuperLink, and submit reported the run "ended
    running". Now it follows the log again (without repeating what it showed) to the
    run's end."""
    first = ["INFO : [round 1/3] acc 0.3", "Connection to the SuperLink is unavailable"]
    again = ["INFO : [round 1/3] acc 0.3", "INFO : [round 2/3] acc 0.5",
             "INFO : [round 3/3] acc 0.6"]
    streams, statuses = iter([first, again]), iter([({"status": "running"}, "02:24:31"),
                                                   ({"status": "finished:completed"}, None)])
    shown: list = []
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(flower, "flwr_json", lambda *a: {"success": True, "run-id": 12})
    monkeypatch.setattr(flower, "_follow_log", lambda *a: shown.append(a[6:]) or next(streams))
    monkeypatch.setattr(flower, "final_row", lambda *a: next(statuses))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 0
    assert shown == [([],), (first,)]  # the second stream skips what the first showed
    assert "the SuperLink answers again and run 12 is running: following its log again" in \
        capsys.readouterr().err


@pytest.mark.parametrize("end, code", [
    ({"status": "finished:completed"}, 0),
    ({"status": "finished:failed", "status-details": "No heartbeat received"}, 1)],
    ids=["completed", "failed"])
def test_submit_never_reports_a_live_run_as_failed(monkeypatch, capsys, tmp_path, end, code):
    """Issue 60's trial: the log stream ended early twice (the SuperLink answered
    throughout), submit waited 60 s, found the run still running and exited 1 with
    "ended running ... Flower says: N/A" while the run went on. Now it follows the log
    again for as long as the run runs, and exits 1 only for a run Flower ended as
    failed, with Flower's reason."""
    streams = iter([["INFO : [round 1/3] acc 0.3"], ["INFO : [round 2/3] acc 0.5"],
                    ["INFO : [round 3/3] acc 0.6"]])
    rows = iter([({"status": "running", "status-details": "N/A"}, None)] * 2 + [(end, None)])
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(flower, "flwr_json", lambda *a: {"success": True, "run-id": 12})
    monkeypatch.setattr(flower, "_follow_log", lambda *a: next(streams))
    monkeypatch.setattr(flower, "final_row", lambda *a: next(rows))
    assert main(["deploy", "submit", "fedefc", "--max-resumes", "0",
                 "--set", f"out-dir={tmp_path}/r"]) == code
    err = capsys.readouterr().err
    assert err.count("its log stream ended early and run 12 is running: following its "
                     "log again") == 2
    assert "ended running" not in err and "N/A" not in err
    assert ("Reason: Flower says: No heartbeat received" in err) == (code == 1)


def test_submit_reads_the_end_of_a_run_that_finished_while_its_log_stream_was_gone(
        monkeypatch, capsys, tmp_path):
    """The SuperLink restarted mid-run and the run finished, degraded (a node was lost in
    a later round), before submit asked for its status: submit said
    "completed" and exited 0, because the RUN DEGRADED line came after the stream ended.
    Now it follows the log again whenever the stream was cut, finished or not, and reads
    the run's end."""
    first = ["INFO : [round 1/3] acc 0.3", "Connection to the SuperLink is unavailable"]
    again = ["INFO : [round 1/3] acc 0.3", "INFO : [round 3/3] acc 0.6",
             "WARNING :   RUN DEGRADED: partition 0 missed 1 of 3 rounds"]
    streams = iter([first, again])
    statuses = iter([({"status": "finished:completed"}, "02:24:31"),
                     ({"status": "finished:completed"}, None)])
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(flower, "flwr_json", lambda *a: {"success": True, "run-id": 12})
    monkeypatch.setattr(flower, "_follow_log", lambda *a: next(streams))
    monkeypatch.setattr(flower, "final_row", lambda *a: next(statuses))
    code = main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"])
    err = capsys.readouterr().err
    assert code == EXIT_DEGRADED, err
    assert "completed DEGRADED: partition 0 missed 1 of 3 rounds" in err


def test_a_run_whose_app_gave_up_is_reported_without_waiting_for_flowers_status(
        monkeypatch, capsys, tmp_path):
    """On a busy coordinator the log stream can end before Flower marks a run finished
    (a Control API call that failed): submit asked for SETTLE_S and then followed the
    log again until Flower caught up, although the ServerApp's RUN FAILED line had
    decided the outcome. Now a log holding it is neither waited on (its row is the
    first flwr ls gives) nor followed again."""
    stream = ["INFO : waiting for the federation",
              "ERROR : RUN FAILED: every node that connected was refused"]
    follows, settles = [], []
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(flower, "flwr_json", lambda *a: {"success": True, "run-id": 12})
    monkeypatch.setattr(flower, "_follow_log", lambda *a: follows.append(a) or stream)
    monkeypatch.setattr(flower, "final_row", lambda *a: settles.append(a[5]) or (
        {"status": "running", "status-details": "N/A"}, None))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 1
    assert len(follows) == 1 and settles == [0.0]
    err = capsys.readouterr().err
    assert ("run 12 failed (its ServerApp gave up; Flower still said running): it did not "
            "complete. Reason: every node that connected was refused") in err
    assert "following its log again" not in err


def test_a_run_not_yet_finished_is_asked_about_for_settle_s_before_following_again(
        monkeypatch, tmp_path):
    """The pause between two follows of a live run's log is final_row's SETTLE_S of
    asking flwr ls, no fixed sleep of submit's own; final_row gives the first row it
    gets when told to settle for 0 s, and a finished row at once otherwise."""
    rows = iter([{"status": "running"}, {"status": "finished:failed"}])
    asked = []
    monkeypatch.setattr(flower, "run_row", lambda *a: asked.append(a) or next(rows))
    monkeypatch.setattr(flower.time, "sleep", lambda s: pytest.fail(f"slept {s} s"))
    assert flower.final_row("c", "12", {}, tmp_path, None, 0.0) == ({"status": "running"},
                                                                    None)
    assert flower.final_row("c", "12", {}, tmp_path) == ({"status": "finished:failed"}, None)
    assert len(asked) == 2
    streams = iter([["INFO : [round 1/3] acc 0.3"], ["INFO : [round 3/3] acc 0.6"]])
    ends = iter([({"status": "running"}, None), ({"status": "finished:completed"}, None)])
    settles = []
    monkeypatch.setattr(flower, "_follow_log", lambda *a: next(streams))
    monkeypatch.setattr(flower, "final_row", lambda *a: settles.append(a[5]) or next(ends))
    lines, row, _ = flower.follow_to_end("c", "12", {}, tmp_path, None, None, print, None)
    assert row["status"] == "finished:completed" and lines[-1].endswith("acc 0.6")
    assert settles == [flower.SETTLE_S, flower.SETTLE_S]


def test_a_log_followed_again_shows_only_what_is_new():
    out = io.BytesIO()
    lines = flower.copy_lines(iter([b"a\n", b"b\n", b"c\n"]), out, False, ["a", "b"])
    assert lines == ["a", "b", "c"] and out.getvalue() == b"c\n"


def test_a_logs_colour_codes_reach_a_terminal_only():
    """Flower's logger colours every line; a file or a pipe gets the text alone."""
    raw = [b"\x1b[92mINFO \x1b[0m:      [round 1/2] 4 clients\n",
           b"\x1b[91mERROR \x1b[0m:     RUN FAILED: no node trained\n"]
    to_file, to_tty = io.BytesIO(), io.BytesIO()
    lines = flower.copy_lines(iter(raw), to_file, keep_colour=False)
    assert to_file.getvalue() == (b"INFO :      [round 1/2] 4 clients\n"
                                  b"ERROR :     RUN FAILED: no node trained\n")
    assert flower.copy_lines(iter(raw), to_tty, keep_colour=True) == lines
    assert to_tty.getvalue() == b"".join(raw)
    assert flower.failure_reason(lines, "finished:failed") == "no node trained"
    assert not flower.to_terminal(io.BytesIO())


# The end of a failed run's log as `flwr log` gives it (Flower 1.42's ServerApp process:
# the project's RUN FAILED line, Flower's traceback of the exception and its exit block),
# after an outage's reconnect chatter.
FAILED_RUN_LOG = [
    "INFO :      [round 1/3] phase 1 | 2 clients | test acc 0.31",
    *["WARNING :   Connection attempt failed, retrying in %.2f seconds" % (0.5 * k)
      for k in range(1, 23)],
    "INFO :      ",
    "ERROR :     RUN FAILED: round 2: no node trained (2 sampled)",
    "ERROR :     ServerApp raised an exception",
    "Traceback (most recent call last):",
    *[f'  File "/venv/lib/flwr/mod{k}.py", line {k}, in f{k}\n    call()'.split("\n")[j]
      for k in range(20) for j in (0, 1)],
    "fedefc_server.failures.RunFailed: round 2: no node trained (2 sampled)",
    "ERROR :     Exit Code: 201", "An unhandled exception occurred in the ServerApp.", "",
    "For more information, visit: <https://flower.ai/docs/framework/ref-exit-codes/201.html>",
    "INFO :      ", "INFO :      [SUMMARY]"]


def test_what_a_person_is_shown_of_a_log_folds_what_repeats():
    """Issue 60's trial: a 45-line traceback and Flower's Exit Code block between the
    real cause's copies, 20-25 "Connection attempt failed" lines per outage. Shown: each
    folded into one line (the chatter: its first line and a count), blank lines and
    Flower's empty history header left out; the whole text goes on to the log file."""
    raw = [f"{line}\n".encode() for line in FAILED_RUN_LOG]
    out, full = io.BytesIO(), io.BytesIO()
    lines = flower.copy_lines(iter(raw), out, False, view=LogView("flwr log 7 site"),
                              full=full)
    assert lines == FAILED_RUN_LOG and full.getvalue() == b"".join(raw)
    assert out.getvalue().decode().splitlines() == [
        "INFO :      [round 1/3] phase 1 | 2 clients | test acc 0.31",
        "WARNING :   Connection attempt failed, retrying in 0.50 seconds",
        "  [the line above 21 more times]",
        "ERROR :     RUN FAILED: round 2: no node trained (2 sampled)",
        "ERROR :     ServerApp raised an exception",
        "  [a traceback of 42 lines, folded (the whole text: flwr log 7 site)] "
        "fedefc_server.failures.RunFailed: round 2: no node trained (2 sampled)",
        "ERROR :     Exit Code: 201 An unhandled exception occurred in the ServerApp."]
    again = LogView("x")
    tb = ["Traceback (most recent call last):", '  File "a.py", line 1', "KeyError: 'k'"]
    assert [again.feed(line) for line in tb * 2][-1] == [
        "  [the same traceback again, 3 lines: KeyError: 'k']"]
    assert LogView("x").feed("INFO : client 1 round 2: noise") == [None]


def flower_stamped(lines: list[str]) -> list[str]:
    """``lines`` as Flower's own console handler writes them with its ``timestamps``
    option (common/flower_log.py), one second apart; a line without a level stays."""
    handler = ConsoleHandler(timestamps=True, colored=False)
    out = []
    for k, line in enumerate(lines):
        level = re.match(r"^(DEBUG|INFO|WARNING|ERROR) :\s*(.*)$", line)
        if level is None:
            out.append(line)
            continue
        record = logging.LogRecord("flwr", getattr(logging, level[1]), __file__, 1,
                                   level[2], None, None)
        record.created, record.msecs = 1_796_000_000.0 + k, 0.0
        out.append(handler.format(record))
    return out


def test_a_log_whose_lines_carry_flowers_time_folds_the_same():
    """Issue 60's stumble 9: Flower's lines now say when (every process the project starts
    turns on Flower's timestamps). The chatter's copies differ in their time only: still
    one line and a count; the exit block and the traceback fold as before."""
    stamped = flower_stamped(FAILED_RUN_LOG)
    assert re.match(r"INFO \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,000: +\[round 1/3\]", stamped[0])
    out = io.BytesIO()
    flower.copy_lines(iter(f"{line}\n".encode() for line in stamped), out, False,
                      view=LogView("flwr log 7 site"))
    assert out.getvalue().decode().splitlines() == [
        stamped[0], stamped[1], "  [the line above 21 more times]", stamped[24], stamped[25],
        "  [a traceback of 42 lines, folded (the whole text: flwr log 7 site)] "
        "fedefc_server.failures.RunFailed: round 2: no node trained (2 sampled)",
        f"{stamped[68]} An unhandled exception occurred in the ServerApp."]


def test_submit_names_an_out_dir_collision_as_the_other_runs_folder(monkeypatch, capsys,
                                                                    tmp_path):
    reason = (f"out-dir='{tmp_path}/r' already holds results (summary.json); choose a new "
              "folder so nothing is overwritten")
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(deploy_submit, "submit_run",
                        lambda *a, **k: RunOutcome("7", "finished:failed", reason))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 1
    err = capsys.readouterr().err
    assert f"Its out-dir {tmp_path}/r holds an earlier run's results, left untouched; this " \
           "run wrote nothing there" in err
    assert "whatever it wrote" not in err and "if anything" not in err


def test_submit_refuses_while_another_run_is_running(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [("5", "running")])
    monkeypatch.setattr(deploy_submit, "submit_run", lambda *a, **k: pytest.fail("submitted"))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "is running another run: 5 (running); nothing submitted" in err
    assert "flwr stop 5 fedefc" in err


def test_export_serves_a_two_node_federation_and_refuses_to_overwrite(tmp_path, capsys):
    """Two nodes at the default p = 0.5: every class has a holder (it used to fail with
    'class 5 is held by no client'); a second export into the same folder is refused."""
    assert main(["deploy", "export", str(tmp_path), "--set", "num-clients=2"]) == 0
    labels = [np.load(tmp_path / f"node-{k}" / "data.npz")["labels"] for k in range(2)]
    assert set(np.concatenate(labels).tolist()) == set(range(10))
    assert main(["deploy", "export", str(tmp_path), "--set", "num-clients=2"]) == 2
    assert "already exist; choose a new OUT_DIR (nothing overwritten)" in capsys.readouterr().err
    assert main(["deploy", "export", "/proc/no-such-dir", "--set", "num-clients=2"]) == 2
    assert "cannot write to OUT_DIR /proc/no-such-dir" in capsys.readouterr().err
