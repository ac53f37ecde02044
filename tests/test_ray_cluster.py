"""A simulation whose clients run on the nodes of a Ray cluster (docs/BENCHMARKS.md, "Past
one box: a Ray cluster"): a two-node cluster started on loopback, each node a raylet of
its own with its own address (127.0.0.2, 127.0.0.3), as ``ray start`` starts them on two
machines. The test reads where Flower's client actors ran from the cluster's own actor
table (its GCS: each actor's node, by actor id, so that a worker process Ray replaced while
it created an actor is still the one actor), and checks the run's model against the same
job on a private Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fedefc_cli.flower import free_port
from fedefc_cli.main import main
from fedefc_cli.procs import Processes, wait_for_port
from fedefc_cli.simulation import run_simulation_job

from .helpers import patience, records, small_job

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
CPUS_PER_NODE = 2
RAY = str(Path(sys.executable).parent / "ray")
WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + float(sys.argv[2])
while sum(n["Alive"] for n in ray.nodes()) < 2:
    if time.monotonic() > deadline:
        sys.exit("the Ray cluster has fewer than 2 live nodes: " + repr(ray.nodes()))
    time.sleep(0.5)
"""
# Every ClientAppActor the cluster's GCS knows (alive or dead) as JSON: actor id -> its
# node's address, its worker's pid and how often Ray restarted it
CLIENT_ACTORS = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR")
print(json.dumps({a["ActorID"]: [a["Address"]["IPAddress"], a["Pid"], a["NumRestarts"]]
                  for a in state.actors().values() if a["ActorClassName"] == "ClientAppActor"}))
"""


def _ray_start(procs: Processes, name: str, args: list[str], temp: Path) -> None:
    """``ray start --block`` as one of ``procs`` (a session of its own, stopped with all
    it started: the node's GCS, raylet and workers)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    procs.start(name, [RAY, "start", "--block", "--disable-usage-stats",
                       f"--num-cpus={CPUS_PER_NODE}", *args], env, temp, temp / f"{name}.log")


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a running two-node Ray cluster. Its temp dir is a short private
    path: Ray's socket paths must fit 107 bytes, and a private one keeps this cluster out
    of every other ``ray.init()`` on the machine."""
    temp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    port = free_port()
    address = f"{HEAD}:{port}"
    procs = Processes()
    try:
        _ray_start(procs, "head", ["--head", f"--node-ip-address={HEAD}", f"--port={port}",
                                   f"--temp-dir={temp}", "--include-dashboard=false",
                                   f"--ray-client-server-port={free_port()}",
                                   f"--dashboard-agent-listen-port={free_port()}"], temp)
        wait_for_port(HEAD, port, procs, timeout=patience(300))
        _ray_start(procs, "worker", [f"--address={address}", f"--node-ip-address={WORKER}",
                                     f"--dashboard-agent-listen-port={free_port()}"], temp)
        waited = subprocess.run([sys.executable, "-c", WAIT_FOR_NODES, address,
                                 str(patience(300))], capture_output=True, text=True,
                                timeout=patience(400))
        assert waited.returncode == 0, waited.stderr[-3000:] + "".join(
            p.read_text(errors="replace")[-2000:] for p in temp.glob("*.log"))
        yield address
    finally:
        procs.stop()
        shutil.rmtree(temp, ignore_errors=True)


def client_actors(address: str) -> dict[str, list]:
    """Ray's actor table of the cluster at ``address``: every ``ClientAppActor`` by actor
    id -> [node address, pid, restarts] (read in a process of its own: this one never
    joins the cluster)."""
    read = subprocess.run([sys.executable, "-c", CLIENT_ACTORS, address],
                          capture_output=True, text=True, timeout=patience(300))
    assert read.returncode == 0, read.stderr[-3000:]
    return json.loads(read.stdout.strip().splitlines()[-1])


def job(data_dir: Path, out: Path) -> dict:
    return small_job(data_dir, out, **{"rounds": 4, "start-round": 0,
                                       "faults": '"acc=0.0@0-3@2"'})


@pytest.fixture(scope="module")
def cluster_and_local_runs(ray_cluster, tiny_mnist_dir, tmp_path_factory):
    """The same FedEFC job run on the cluster, one CPU per client, and on a private Ray;
    (outs, summaries, the cluster's client actors). 4 clients, 4 rounds; every client
    reports accuracy 0 in round 2 (an ``acc=0.0`` fault), which makes round 2 the
    prestopping point, so rounds 3 and 4 run phase 2."""
    address = ray_cluster
    root = tmp_path_factory.mktemp("ray-cluster")
    outs = {"cluster": root / "cluster", "local": root / "local"}
    summaries = {"cluster": run_simulation_job(job(tiny_mnist_dir, outs["cluster"]),
                                               client_cpus=1, ray_address=address)}
    actors = client_actors(address)
    summaries["local"] = run_simulation_job(job(tiny_mnist_dir, outs["local"]), client_cpus=1)
    return outs, summaries, actors


@pytest.mark.flower
def test_a_simulation_on_a_two_node_ray_cluster_serves_clients_on_both_nodes(
        cluster_and_local_runs):
    outs, summaries, actors = cluster_and_local_runs
    # Flower sizes its actor pool from the whole cluster: one actor per CPU of each node
    nodes = [node for node, _, _ in actors.values()]
    assert nodes.count(HEAD) == CPUS_PER_NODE, actors
    assert nodes.count(WORKER) == CPUS_PER_NODE, actors
    recs = records(outs["cluster"])
    assert [r["round"] for r in recs] == list(range(5))
    assert summaries["cluster"]["t_e"] == 2
    assert [r["phase"] for r in recs] == [1, 1, 1, 2, 2]


@pytest.mark.flower
def test_where_a_client_runs_does_not_change_the_model(cluster_and_local_runs):
    outs, summaries, _ = cluster_and_local_runs
    cluster, local = torch.load(outs["cluster"] / "model.pt"), torch.load(
        outs["local"] / "model.pt")
    assert cluster.keys() == local.keys()
    assert all(torch.equal(cluster[k], local[k]) for k in cluster)
    assert summaries["cluster"]["t_e"] == summaries["local"]["t_e"]
    assert [r["test_acc"] for r in records(outs["cluster"])] == [
        r["test_acc"] for r in records(outs["local"])]


def test_an_address_where_no_ray_cluster_answers_fails_before_the_run(tmp_path, capsys):
    address = f"127.0.0.1:{free_port()}"
    code = main(["run", "--out-dir", str(tmp_path / "out"),
                 "--ray-address", address])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--ray-address {address}: no Ray cluster answers there" in err
    assert "ray start --head" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["6379", "head", "ray://10.0.0.5:10001", "10.0.0.5:99999"])
def test_a_ray_address_that_is_not_host_and_port_is_refused_naming_it(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--ray-address", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert repr(bad) in err and "e.g. 10.0.0.5:6379" in err
