"""The SuperExec's zygote (fedefc_cli/app_zygote.py): a task forked from it runs its entry
point as its executable would (its arguments, its output or none, its name, the
interpreter's normal end), with torch already imported; its children are reaped; it ends
with its SuperExec's pipe and is started again if it died; only Flower's own scripts are
forked. Real processes, no Flower executable (the deployments of test_deployment*.py run
every app process through it)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fedefc_cli.app_zygote import ENTRIES, TRUSTED_ENTRY, Zygote, task_of
from fedefc_cli.deploy_local import DEPLOY_DIR
from fedefc_cli.trusted_apps import launcher_text, write_launchers
from tests.helpers import patience, processes

TASK = f"{__name__}:task"  # what the zygote's child runs, in place of Flower's entry point


def task() -> int:
    """A task: records what it finds, prints a line, leaves a file at the interpreter's
    end, and exits with the status its argv asks for."""
    record = Path(sys.argv[1])
    record.with_suffix(".json").write_text(json.dumps({
        "argv": sys.argv, "torch_before": "torch" in sys.modules, "pid": os.getpid(),
        "ppid": os.getppid(), "comm": Path("/proc/self/comm").read_text().strip(),
        "stdin": os.read(0, 16).decode()}))
    print(f"task output {record.name}", flush=True)
    atexit.register(record.with_suffix(".end").write_text, "atexit ran")
    if sys.argv[2] == "raise":
        raise RuntimeError(f"task failed {record.name}")
    return int(sys.argv[2])


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + patience(300)
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the living or defunct children of ``pid``."""
    return [(child, state) for child, state, parent, _ in processes() if parent == pid]


def test_a_forked_task_runs_as_its_executable_would_and_is_reaped(tmp_path, capfd):
    zygote = Zygote()
    try:
        zygote.start(TASK, ["/x/flwr-clientapp", str(tmp_path / "a"), "0"], quiet=False)
        zygote.start(TASK, ["flwr-serverapp", str(tmp_path / "b"), "raise"], quiet=False)
        zygote.start(TASK, ["flwr-clientapp", str(tmp_path / "c"), "3"], quiet=True)
        for name in "abc":
            wait_for(tmp_path / f"{name}.end")
        a, b, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "abc")
        assert a["argv"] == ["/x/flwr-clientapp", str(tmp_path / "a"), "0"]
        assert a["torch_before"] and a["ppid"] == zygote.proc.pid != os.getpid()
        assert (a["comm"], b["comm"]) == ("flwr-clientapp", "flwr-serverapp")
        assert a["stdin"] == "" and len({a["pid"], b["pid"], c["pid"]}) == 3
        deadline = time.monotonic() + patience(120)
        while children(zygote.proc.pid):  # exited, and reaped by the zygote
            assert time.monotonic() < deadline, children(zygote.proc.pid)
            time.sleep(0.05)
        out, err = capfd.readouterr()
        assert "task output a" in out and "task output b" in out
        assert "task output c" not in out + err  # quiet: Flower's suppress_output
        assert "RuntimeError: task failed b" in err and "app zygote" in err
    finally:
        zygote.proc.stdin.close()
    assert zygote.proc.wait(patience(60)) == 0  # its SuperExec's pipe closed: it ends


def test_a_zygote_that_died_is_started_again(tmp_path):
    zygote = Zygote()
    try:
        zygote.start(TASK, ["flwr-clientapp", str(tmp_path / "a"), "0"], quiet=True)
        wait_for(tmp_path / "a.end")
        first = zygote.proc
        os.kill(first.pid, signal.SIGKILL)
        first.wait(patience(60))
        zygote.start(TASK, ["flwr-clientapp", str(tmp_path / "b"), "0"], quiet=True)
        wait_for(tmp_path / "b.end")
        assert zygote.proc.pid != first.pid
        assert json.loads((tmp_path / "b.json").read_text())["ppid"] == zygote.proc.pid
    finally:
        zygote.proc.stdin.close()
        zygote.proc.wait(patience(60))


def test_only_flowers_own_scripts_and_their_trusted_launchers_are_forked(tmp_path,
                                                                         monkeypatch):
    subprocess.run(["bash", str(DEPLOY_DIR / "gen-signing-key.sh"), str(tmp_path / "keys"),
                    "coordinator"], check=True, capture_output=True)
    own = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", own)
    assert {name: task_of([name, "--token", "t"]) for name in ENTRIES} == {
        name: (entry, [name, "--token", "t"]) for name, entry in ENTRIES.items()}
    assert task_of(["flwr-simulation", "--token", "t"]) is None
    assert task_of([]) is None
    # --trusted-keys: fedefc_cli/trusted_apps.py's launchers first on PATH
    keys = str(tmp_path / "keys" / "coordinator.trusted.yaml")
    bin_dir = write_launchers(tmp_path / "exec", keys)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), own]))
    launcher = str(bin_dir / "flwr-clientapp")
    assert task_of(["flwr-clientapp", "--token", "t"]) == (
        TRUSTED_ENTRY, [launcher, "clientapp", keys, "--token", "t"])
    # a launcher this project did not write (or wrote for another interpreter) runs itself
    other = tmp_path / "other"
    other.mkdir()
    (other / "flwr-clientapp").write_text(launcher_text("clientapp", keys, "/usr/bin/python3"))
    (other / "flwr-serverapp").write_text("#!/bin/sh\nexec true\n")
    for path in other.iterdir():
        path.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), own]))
    assert task_of(["flwr-clientapp"]) is None and task_of(["flwr-serverapp"]) is None


def test_a_trusted_launcher_forked_by_the_zygote_runs_the_launchers_check(tmp_path, capfd):
    """The forked task is fedefc_cli/trusted_apps.py's, as the launcher runs it: a trusted
    keys file that is gone stops it with its message before Flower's process starts (the
    refusal of unsigned apps through it: tests/test_deployment_ops.py)."""
    zygote = Zygote()
    try:
        zygote.start(TRUSTED_ENTRY, ["/x/flwr-clientapp", "clientapp",
                                     str(tmp_path / "no-such-keys.yaml"), "--insecure"], False)
        deadline = time.monotonic() + patience(300)
        while "fedefc: " not in (err := capfd.readouterr().err):
            assert time.monotonic() < deadline, err
            time.sleep(0.1)
        assert "no-such-keys.yaml" in err
    finally:
        zygote.proc.stdin.close()
        zygote.proc.wait(patience(60))


def test_a_zygote_whose_preload_fails_still_runs_every_task(tmp_path):
    """A module the zygote could not import (a broken torch, a missing package) is said
    in its log, and each task imports it itself: tasks are never lost."""
    serve = ("import sys; from fedefc_cli import app_zygote as z; "
             "z.PRELOAD = ('no_such_module_fedefc', 'json'); sys.exit(z.serve())")
    request = json.dumps({"entry": TASK, "argv": ["flwr-clientapp", str(tmp_path / "a"), "0"],
                          "quiet": False})
    out = subprocess.run([sys.executable, "-c", serve], input=request + "\n", text=True,
                         capture_output=True, timeout=patience(300),
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    wait_for(tmp_path / "a.end")
    assert "no_such_module_fedefc not imported (ModuleNotFoundError(" in out.stderr
    assert ": json imported in " in out.stderr and "task output a" in out.stdout
