"""Reliability in deployment: a SuperNode that stops and comes back, and a killed ServerApp.

Real ``flower-superlink`` / ``flower-supernode`` / ``flower-superexec`` processes on
127.0.0.1 (:class:`fedefc_cli.deployment.LocalDeployment`), every one stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fedefc_cli.deployment import LocalDeployment, NodeSpec
from fedefc_cli.main import main
from fedefc_cli.procs import descendants, stop_tree
from fedefc_cli.simulation import run_simulation_job
from fedefc_server import checkpoint
from tests.helpers import RUN_LIMIT_S, patience, records, small_job

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
