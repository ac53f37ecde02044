"""Reliability in deployment: a SuperNode that stops and comes back, a killed ServerApp,
and a SuperExec or SuperLink that crashes mid-run under the supervision of ``fedefc
deploy superlink|supernode``.

Real ``flower-superlink`` / ``flower-supernode`` / ``flower-superexec`` processes on
127.0.0.1 (:class:`fedefc_cli.deployment.LocalDeployment`, or the ``fedefc deploy``
commands themselves), every one stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fedefc_cli.deployment import LocalDeployment, NodeSpec, write_connection
from fedefc_cli.errors import EXIT_DEGRADED
from fedefc_cli.flower import flwr_env, flwr_json, free_port
from fedefc_cli.main import main
from fedefc_cli.procs import descendants, stop_tree
from fedefc_cli.run_configs import APP_DIR, write_run_config
from fedefc_cli.simulation import run_simulation_job
from fedefc_server import checkpoint
from tests.helpers import RUN_LIMIT_S, patience, records, small_job
from tests.test_quickstart import processes_with_home

pytestmark = pytest.mark.flower  # every test here runs a deployment
NODES = 3


def job(data_dir: Path, out: Path, **extra) -> dict:
    """No allowlist: open-deployment (ignored by the reference simulation)."""
    return small_job(data_dir, out, **{"num-clients": NODES, "open-deployment": "true",
                                       **extra})


def wait_for_round(out: Path, rnd: int, timeout: float | None = None) -> None:
    timeout = patience(1800) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["round"] >= rnd for r in records(out)):
            return
        time.sleep(0.5)
    raise TimeoutError(f"round {rnd} not recorded in {out} within {timeout:.0f} s")


def nodes(base: Path) -> list[NodeSpec]:
    return [NodeSpec({"partition-id": k, "num-partitions": NODES,
                      "cache-dir": str(base / f"cache-{k}")}) for k in range(NODES)]


def stop_node(dep: LocalDeployment, name: str) -> None:
    """Stop one SuperNode and its SuperExec (and whatever they started), by PID."""
    for label, proc, _ in dep.procs.running:
        if label.startswith(f"{name} "):
            stop_tree(proc)


# A round waits this long for its clients: far beyond any honest node's round on a loaded
# machine. The stopped node does not cost it: the SuperLink answers for a node that went
# offline (node_unavail) as soon as its heartbeat lapses (Flower 1.42: within 2 x 30 s).
ROUND_LIMIT_S = patience(900.0)


def test_a_supernode_that_stops_mid_run_and_returns_takes_part_again(tmp_path, tiny_mnist_dir):
    """The honest nodes take part in every round after the stop, however slow the machine
    (it used to fail on a loaded machine: with a 45 s client-timeout an honest node's
    round ran out); the stopped node is missing from the rounds while it is down and
    takes part again once back."""
    out = tmp_path / "out"
    cfg = job(tiny_mnist_dir, out, **{"client-timeout": ROUND_LIMIT_S, "rounds": 7})
    specs = nodes(tmp_path)
    with LocalDeployment(tmp_path / "federation", specs) as dep:
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(
            status=dep.run(cfg, timeout=patience(RUN_LIMIT_S))[1]))
        runner.start()
        wait_for_round(out, 2)
        stop_node(dep, "node-1")
        stopped_after = max(r["round"] for r in records(out))
        wait_for_round(out, stopped_after + 2)
        dep.start_node("node-1-back", specs[1])
        runner.join(timeout=patience(RUN_LIMIT_S) + 60)
    # the run completed without partition 1 for more rounds than max-missed-share allows
    assert result.get("status", "").startswith(
        "finished:completed but RUN DEGRADED: partition 1 missed ")
    recs = {r["round"]: r for r in records(out)}
    assert sorted(recs) == list(range(8))
    missing = [r for r in recs.values() if r["round"] > stopped_after and
               1 not in (r.get("partition_ids") or [])]
    assert missing, "the stopped node was still aggregated"
    for r in missing:  # the others carried on: both honest nodes in every such round
        assert {0, 2} <= set(r["partition_ids"]) and r["n_clients"] >= 2, r
    back = [r["round"] for r in recs.values() if r["round"] > missing[-1]["round"]
            and 1 in r["partition_ids"]]
    assert back, "the restarted node never took part again"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "degraded"  # each round it missed is named, node and why
    assert summary["missed_rounds"]["1"] == [r["round"] for r in recs.values() if r["round"]
                                             and 1 not in (r.get("partition_ids") or [])]


def kill_serverapp_after(dep: LocalDeployment, out: Path, rnd: int) -> None:
    """SIGKILL the ServerApp process (started by the SuperLink's SuperExec)."""
    wait_for_round(out, rnd)
    superexec = next(p for label, p, _ in dep.procs.running
                     if label == "superlink's flower-superexec")
    for pid in descendants(superexec.pid)[1:]:
        try:
            if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_killed_serverapp_resumes_to_the_uninterrupted_result(tmp_path, tiny_mnist_dir,
                                                              monkeypatch):
    """Killed after round 3, the run is resumed with the one documented command,
    ``fedefc deploy submit CONNECTION --resume OUT_DIR``, and ends as the simulation."""
    reference = run_simulation_job(job(tiny_mnist_dir, tmp_path / "simulated"))
    out = tmp_path / "out"
    with LocalDeployment(tmp_path / "federation", nodes(tmp_path)) as dep:
        killer = threading.Thread(target=kill_serverapp_after, args=(dep, out, 3))
        killer.start()
        _, status = dep.run(job(tiny_mnist_dir, out), timeout=patience(RUN_LIMIT_S))
        killer.join()
        assert status != "finished:completed"
        assert not (out / "summary.json").exists()
        assert 3 <= checkpoint.load(out).round < 6
        monkeypatch.setenv("FLWR_HOME", dep.cli_env["FLWR_HOME"])
        assert main(["deploy", "submit", dep.CONNECTION, "--resume", str(out)]) == 0
    a = torch.load(tmp_path / "simulated" / "model.pt")
    b = torch.load(out / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # client-threads=1: bitwise equal
    assert json.loads((out / "summary.json").read_text())["final_acc"] == reference["final_acc"]
    assert [r["round"] for r in records(out)] == list(range(7))


# -- a SuperExec or the SuperLink crashes mid-run: supervised, the run resumes itself -------
SUPERVISED_NODES = 2


def wait_until(done, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {timeout:.0f} s")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def named(pids: list[int], program: str) -> list[int]:
    """The processes among ``pids`` that run ``program`` (a Flower executable)."""
    return [p for p in pids if any(Path(word).name == program for word in cmdline(p)[:2])]


class Supervised:
    """A federation as an operator starts it: ``fedefc deploy superlink`` and one ``fedefc
    deploy supernode`` per node, each supervising its two processes in the foreground
    (docs/DEPLOYMENT.md, "Quick start"), every process with ``HOME`` in ``base/home`` (so
    whatever they leave behind is found); runs are submitted with ``fedefc deploy
    submit``, as the doc does."""

    CONNECTION = "fedefc"

    def __init__(self, base: Path):
        self.base = base
        self.home = base / "home"
        self.home.mkdir(parents=True)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
        self.env = {**env, "HOME": str(self.home), "FLWR_HOME": str(base / "cli"),
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                             env.get("PATH", "")])}
        self.foreground: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.base / f"{name}.out", "ab") as out:
            self.foreground[name] = subprocess.Popen(
                [sys.executable, "-m", "fedefc_cli", "deploy", *args], cwd=APP_DIR,
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def up(self) -> Supervised:
        self.start("superlink", "superlink", "--host", "127.0.0.1", "--port", str(self.port),
                   "--state-dir", str(self.base / "link"))
        for k in range(SUPERVISED_NODES):
            self.start(f"node-{k}", "supernode", "--superlink", f"127.0.0.1:{self.port}",
                       "--partition-id", str(k), "--num-partitions", str(SUPERVISED_NODES),
                       "--cache-dir", str(self.base / f"cache-{k}"),
                       "--state-dir", str(self.base / f"node-{k}"))
        write_connection(self.base / "cli", self.CONNECTION, f"127.0.0.1:{self.port}")
        wait_until(lambda: self.online() >= SUPERVISED_NODES, "the SuperNodes not online",
                   patience(600))
        return self

    def online(self) -> int:
        for name, proc in self.foreground.items():
            assert proc.poll() is None, f"fedefc deploy {name} exited:\n{self.output(name)}"
        res = flwr_json(["supernode", "ls", self.CONNECTION], flwr_env(self.base / "cli"),
                        self.base)
        return sum(1 for n in res.get("nodes", []) if n.get("status") == "online")

    def output(self, name: str) -> str:
        return (self.base / f"{name}.out").read_text(errors="replace")

    def superlink_machine(self, program: str) -> int:
        """The PID of ``program`` (flower-superlink or flower-superexec) that ``fedefc
        deploy superlink`` runs now."""
        found = named(descendants(self.foreground["superlink"].pid)[1:], program)
        assert len(found) == 1, (program, found)
        return found[0]

    def apps(self) -> list[int]:
        """Living ServerApp and ClientApp processes of this federation."""
        pids = processes_with_home(self.home)
        return named(pids, "flwr-serverapp") + named(pids, "flwr-clientapp")

    def submit(self, name: str, run_config: dict) -> subprocess.Popen:
        """``fedefc deploy submit``, waiting for a SuperLink that stopped answering as
        long as a slow machine may take to start it again."""
        preset = write_run_config(self.base / f"{name}.toml", run_config)
        with open(self.base / f"{name}.out", "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "fedefc_cli", "deploy", "submit",
                                     self.CONNECTION, str(preset), "--reconnect-wait",
                                     str(patience(600))], cwd=APP_DIR, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def down(self) -> list[int]:
        """Ctrl-C every foreground command (each stops what it started); what is left
        after they exited (then stopped by PID)."""
        for proc in self.foreground.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in self.foreground.values():
            try:
                proc.wait(timeout=patience(120))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        left = processes_with_home(self.home)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """One supervised federation for the crash tests; after them, Ctrl-C stops it all and
    nothing it started is left."""
    federation = Supervised(tmp_path_factory.mktemp("supervised"))
    try:
        yield federation.up()
    finally:
        left = federation.down()
    assert not left, f"left running after Ctrl-C: {[cmdline(p) for p in left]}"


@pytest.mark.parametrize("crash", ["flower-superexec", "flower-superlink"],
                         ids=["superexec", "superlink"])
def test_a_crash_mid_run_is_restarted_and_the_run_resumes_itself(supervised, tmp_path,
                                                                 tiny_mnist_dir, crash):
    """Issue 30: a SuperExec that exited took the SuperLink down, and nothing restarted
    it; submit gave up; a node's ClientApp hung for 34 minutes. Now the crashed process
    (SIGKILL after round 1) is started again by ``fedefc deploy superlink``, the run
    finishes or is resumed by ``fedefc deploy submit`` from its checkpoint, completing
    every round with both nodes, and no ServerApp or ClientApp process is left once it
    has ended."""
    out = tmp_path / "out"
    cfg = small_job(tiny_mnist_dir, out, **{"num-clients": SUPERVISED_NODES, "rounds": 3,
                                             "open-deployment": "true"})  # no allowlist
    submit = supervised.submit(f"submit-{crash}", cfg)
    try:
        wait_for_round(out, 1)
        victim = supervised.superlink_machine(crash)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: named(descendants(supervised.foreground["superlink"].pid)[1:],
                                 crash) not in ([], [victim]),
                   f"{crash} not started again", patience(600))
        code = submit.wait(timeout=patience(RUN_LIMIT_S))
    finally:
        if submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)
            submit.wait()
    said = supervised.output(f"submit-{crash}")
    assert (out / "summary.json").is_file(), (
        f"submit exited {code} with no summary.json.\nsubmit said:\n{said[-6000:]}\n"
        f"fedefc deploy superlink said:\n{supervised.output('superlink')[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    recs = records(out)
    assert sorted({r["round"] for r in recs}) == [0, 1, 2, 3]
    assert f"{crash} exited with code -9" in supervised.output("superlink")
    if crash == "flower-superexec":
        # A SuperExec takes its ServerApp with it (Flower's parent-process watch): the
        # run fails, and submit resumes it from its checkpoint.
        assert code == 0 and "resuming it from its checkpoint" in said, said[-4000:]
    else:
        # A ServerApp outlives a SuperLink that comes back in time (its Runtime API calls
        # retry) and the run goes on; submit's log stream ended with the SuperLink, so it
        # follows the log again to the run's end (or, had the ServerApp given up, resumes
        # the run from its checkpoint).
        assert any(way in said for way in ("following its log again",
                                           "resuming it from its checkpoint")), said[-4000:]
    if summary["status"] == "degraded":
        # Whether a node's reply was in flight when the SuperLink died is a matter of
        # timing: one that was is lost with it, its site misses that round, and the run
        # says so (issue 30, item 3) instead of reporting a complete federation.
        assert crash == "flower-superlink" and code == EXIT_DEGRADED, said[-4000:]
        assert "completed DEGRADED" in said, said[-4000:]
        missed = {r for rounds in summary["missed_rounds"].values() for r in rounds}
        assert missed and missed <= {2, 3}, summary["missed_rounds"]  # from the kill on
    else:
        assert code == 0 and summary["status"] == "completed", said[-4000:]
        assert all(r["n_clients"] == SUPERVISED_NODES for r in recs if r["round"] > 0), recs
    wait_until(lambda: not supervised.apps(), "ServerApp / ClientApp processes still "
               "running after the run ended", patience(300))
