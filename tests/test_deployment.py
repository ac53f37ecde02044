"""FedEFC on a real Flower deployment: SuperLink + SuperNodes on 127.0.0.1.

The end-to-end tests start real ``flower-superlink`` / ``flower-supernode`` /
``flower-superexec`` processes with ``--isolation process`` (the topology of
deploy/compose.yml) through :class:`fedefc_cli.deploy_local.LocalDeployment`, submit a
short job with ``flwr run``, read its status from ``flwr ls`` and stop every process by
PID. The job is test_simulation.py's: lr 1e-7 makes A(t) tie in rounds 1 and 2, so with
start-round 0 and gamma-thr 1 round 2 is T_e by construction and round 3 runs phase 2.

Its data is a run's own (docs/OWN-DATA.md), shaped like neither MNIST nor CIFAR: an .npz
of 3 x 12 x 20 RGB images stored channels-last, K = 5, with a test set; its model is
given by import path (tests/own_models.py, importable by every Flower process through
PYTHONPATH). The server evaluates on the test set and the clients on their held-out
data (``evaluation = both``), except in the TLS run: there every node holds its own
private file and the server holds no data at all (``evaluation = federated``).

Determinism: with ``client-threads=1`` the deployment's final weights are bitwise equal
to the simulation's (a Ray actor with 1 CPU runs torch on 1 thread; a SuperNode's
ClientApp would otherwise use every core, and a different thread count changes the
summation order inside conv/matmul kernels). Aggregation order, sampling and seeds are
already identical (the server sorts replies and samples by partition id).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from common.data_files import write_npz
from common.data_plan import data_plan
from common.disk_cache import DataCache
from common.methods import load_run_config
from common.models import TaskShape
from common.runtime import initial_model
from common.sample_roles import training_size
from common.training import BatchTransform, evaluate
from fedefc_cli.deploy_flags import TLSFiles, superexec_flags, superlink_flags, supernode_flags
from fedefc_cli.deploy_local import DEPLOY_DIR, LocalDeployment, NodeSpec
from fedefc_cli.flower import COLOUR, flower_bin
from fedefc_cli.main import main
from fedefc_cli.procs import stop_tree
from fedefc_cli.run_configs import (
    APP_DIR,
    read_app_defaults,
    read_preset,
    resolve_run_config,
    toml_value,
)
from fedefc_cli.simulation import run_simulation_job
from fedefc_client.cache import partition_key, private_key
from fedefc_client.local_data import check_node_config, node_data, partition_data
from fedefc_client.private_data import PrivateDataError, load_private_data
from tests.helpers import RUN_LIMIT_S, patience, processes, records, wait_for_round
from tests.test_quickstart import run_quick_start, run_tls_walkthrough, section

NODES = 3
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
TASK = TaskShape((3, 12, 20), 5)


@pytest.fixture(scope="module")
def own_data(tmp_path_factory) -> Path:
    """train.npz (16 images per class) and test.npz (8 per class): random uint8 RGB
    images of 12 x 20 pixels stored (N, H, W, C), labels 0..4."""
    root = tmp_path_factory.mktemp("own-data")
    rng = np.random.default_rng(0)
    for name, per_class in (("train", 16), ("test", 8)):
        labels = np.repeat(np.arange(TASK.num_classes), per_class)
        pixels = rng.integers(0, 256, size=(len(labels), 12, 20, 3), dtype=np.uint8)
        np.savez(root / f"{name}.npz", images=pixels, labels=labels)
    return root


def job(data: Path, out_dir: Path, **extra) -> dict:
    """The short phase-2 job (module docstring) for three clients."""
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"npz"', "data-path": f'"{data / "train.npz"}"',
        "test-path": f'"{data / "test.npz"}"', "num-classes": TASK.num_classes,
        "input-shape": '"3x12x20"', "normalization": '"0.5,0.5,0.5;0.25,0.25,0.25"',
        "model": '"tests.own_models:tiny_cnn"', "evaluation": '"both"',
        "num-clients": NODES, "fraction": 1.0, "rounds": 3, "local-epochs": 2,
        "batch-size": 8, "lr": 1e-7, "start-round": 0, "gamma-thr": 1, "rho": 0.4,
        "zeta": 0.4, "iid": "true", "accuracy-signal": '"global"',
        "open-deployment": "true", **extra,  # no allowlist (a simulation ignores the key)
    }.items()]
    return resolve_run_config(None, overrides, str(out_dir))


def group_members(pgids: list[int]) -> list[str]:
    """Live processes (not zombies) in any of the process groups ``pgids``."""
    return [str(pid) for pid, state, _, group in processes() if group in pgids and state != "Z"]


@dataclass
class DeployedRun:
    out: Path
    status: str
    pgids: list[int]
    work: Path
    extra: dict


def run_deployment(base: Path, nodes: list[NodeSpec], run_config: dict, before_run=None,
                   after_run=None, **kwargs) -> DeployedRun:
    """Start the federation, call ``before_run(dep)``, run the job, call
    ``after_run(dep)`` (a second job on the same federation), stop everything."""
    with LocalDeployment(base / "federation", nodes, **kwargs) as dep:
        extra = before_run(dep) if before_run else {}
        _, status = dep.run(run_config, timeout=patience(RUN_LIMIT_S))
        extra.update(after_run(dep) if after_run else {})
        pgids = [proc.pid for _, proc, _ in dep.procs.running]
    return DeployedRun(Path(run_config["out-dir"]), status, pgids, dep.work_dir, extra)


# -- end to end: insecure, TLS + authentication, equal to simulation -----------------------
# The second job on the insecure federation: secure aggregation (docs/PRIVACY.md), one
# more round; every client reports accuracy 0 in round 2 (a quantized sum has no exact
# ties, so this makes round 2 T_e), node 0 inflates its sample count in round 3 and
# node 1 claims partition 2 in round 4: both must be refused before the sum, and the
# round starts again with the two others (min-secure-clients = 2 allows a sum of two).
SECURE_FAULTS = "acc=0.0@0-2@2;samples=60@0@3;pid=2@1@4"


def secure_job(data_dir: Path, base: Path, dep: LocalDeployment) -> dict:
    run_config = job(data_dir, base / "out-secure", **{
        "client-threads": 1, "rounds": 4, "secure-aggregation": "true", "audit": "true",
        "min-secure-clients": 2, "evaluation": '"server"', "faults": f'"{SECURE_FAULTS}"',
        "max-missed-share": 0.25})  # each liar misses its one refused round: 1 of 4 allowed
    _, status = dep.run(run_config, timeout=patience(RUN_LIMIT_S))
    return {"secure": (Path(run_config["out-dir"]), status)}


def insecure_job(data_dir: Path, base: Path) -> DeployedRun:
    """Nodes holding partitions of the run's dataset, prepared data cached on disk, plus
    a fourth node whose private data is missing (it must fail, naming node and path);
    then :func:`secure_job` on the same federation."""
    nodes = [NodeSpec({"partition-id": k, "num-partitions": NODES,
                       "cache-dir": str(base / f"cache-{k}")}) for k in range(NODES)]
    nodes.append(NodeSpec({"partition-id": NODES - 1, "num-partitions": NODES,
                           "data-path": str(base / "no-such-data.npz")}))
    return run_deployment(base, nodes, job(data_dir, base / "out", **{"client-threads": 1}),
                          after_run=lambda dep: secure_job(data_dir, base, dep))


def refused_node(dep: LocalDeployment, key: Path) -> dict:
    """Start a SuperNode whose key was never registered, as a user does (``fedefc deploy
    supernode``); it must exit on its own, saying why."""
    dep.wait_online(NODES)
    folder = dep.work_dir / "intruder"
    proc = subprocess.Popen([sys.executable, "-m", "fedefc_cli", "deploy", "supernode",
                             "--superlink", dep.address, "--partition-id", "0",
                             "--num-partitions", str(NODES), "--ca-cert", dep.ca_cert,
                             "--auth-key", str(key), "--state-dir", str(folder),
                             "--cache-dir", str(folder / "cache")],
                            env=dep.cli_env, cwd=APP_DIR, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=patience(600))
    finally:
        stop_tree(proc)
    return {"code": proc.returncode, "log": out + (folder / "supernode.log").read_text(),
            "online": dep.online_nodes()}


def tls_job(data_dir: Path, base: Path) -> DeployedRun:
    """TLS, SuperNode authentication, SuperExec secrets (made by the deploy/ scripts),
    and nodes with PRIVATE data: .npz files exported from the partitions; the server
    holds no data (no data-path, no test-path) and evaluates through the clients."""
    certs, keys, secrets = base / "certs", base / "keys", base / "secrets"
    names = [f"node-{k}" for k in range(NODES)]
    for script, args in (("gen-certs.sh", [certs, "localhost"]),
                         ("gen-node-keys.sh", [keys, *names, "intruder"]),
                         ("gen-secret.sh", [secrets / "link", *(secrets / n for n in names)])):
        subprocess.run(["bash", str(DEPLOY_DIR / script), *map(str, args)], check=True,
                       capture_output=True)
    exported = job(data_dir, base / "out")
    sets = [f"--set={k}={toml_value(v)}" for k, v in exported.items() if k != "out-dir"]
    assert main(["deploy", "export", str(base / "data"), *sets]) == 0
    # the server holds no data: the bound on a node's declaration is the coordinator's
    largest = max(len(ix) for ix in data_plan(load_run_config(exported)).client_indices)
    run_config = load_run_config({**exported, "data-path": "", "test-path": "",
                                  "evaluation": "federated",
                                  "max-client-samples": largest}).to_flat()
    nodes = [NodeSpec({"partition-id": k, "num-partitions": NODES,
                       "data-path": str(base / "data" / f"node-{k}" / "data.npz"),
                       "cache-dir": str(base / f"cache-{k}")},
                      auth_key=str(keys / names[k]), superexec_secret=str(secrets / names[k]))
             for k in range(NODES)]
    return run_deployment(base, nodes, run_config, tls=TLSFiles.in_dir(certs),
                          link_secret=str(secrets / "link"),
                          before_run=lambda dep: refused_node(dep, keys / "intruder"))


def simulation_job(data_dir: Path, base: Path) -> Path:
    run_simulation_job(job(data_dir, base / "out", **{"client-threads": 1}),
                       log_path=base / "run.log")
    return base / "out"


def quick_start_job(data_dir: Path, base: Path) -> dict:  # noqa: ARG001 - its own data
    return run_quick_start(base)


def tls_walkthrough_job(data_dir: Path, base: Path) -> dict:  # noqa: ARG001 - its own data
    return run_tls_walkthrough(base)


@pytest.fixture(scope="module")
def runs(own_data, tmp_path_factory) -> dict[str, Future]:
    """The five jobs, run concurrently: their processes spend most of their time waiting
    on Flower's polling intervals, so overlapping them saves wall time. The simulation
    goes first, and the deployments start once its clients have answered round 1: Ray
    waits a fixed 30 s for its node, which four deployments starting beside it made it
    miss three times in a row (docs/RELIABILITY.md, "A simulation whose Ray did not start
    in time"). Each test takes the result it needs, so a failing job fails its own tests
    only. The repository root goes on the processes' PYTHONPATH, so that they import the
    model (tests/own_models.py)."""
    jobs = {"insecure": insecure_job, "tls": tls_job, "quickstart": quick_start_job,
            "tls-walkthrough": tls_walkthrough_job}
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(len(jobs) + 1) as pool:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT),
                                                                 os.environ.get("PYTHONPATH")])))
        base = tmp_path_factory.mktemp("run-simulation")
        started = {"simulation": pool.submit(simulation_job, own_data, base)}
        wait_for_round(base / "out", 1, ended=started["simulation"].done)
        yield started | {name: pool.submit(fn, own_data, tmp_path_factory.mktemp(f"run-{name}"))
                         for name, fn in jobs.items()}


def held_out_total(data: Path) -> int:
    """The held-out samples of all clients of the job: round(0.2 n_k) each."""
    cfg = load_run_config(job(data, data / "unused-out"))
    return sum(round(cfg.local_test_fraction * len(ix))
               for ix in data_plan(cfg).client_indices)


def check_phase_2_job(out: Path, diagnostics: bool, held_out: int) -> None:
    assert {p.name for p in out.iterdir()} >= {"config.json", "metrics.jsonl",
                                               "summary.json", "model.pt"}
    model = torch.load(out / "model.pt")
    assert model["net.4.weight"].shape == (TASK.num_classes, 32)  # tests/own_models.py
    recs = records(out)
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["t_e"] == 2
    assert [r["phase"] for r in recs] == [1, 1, 1, 2]
    for r in recs[1:]:
        assert r["partition_ids"] == [0, 1, 2] and r["failures"] == 0
    assert recs[3]["client_loss"] == ["forward-corrected"] * NODES
    # diagnostics need the true labels: partitions have them, private data does not
    assert (recs[3]["q_cos"] is not None) == diagnostics
    assert (recs[1]["noise_rate"] is not None) == diagnostics
    assert (recs[3].get("federated_true_acc") is not None) == diagnostics
    # every node evaluated every round (round 0 included) on its held-out samples
    cfg = load_run_config(json.loads((out / "config.json").read_text()))
    for r in recs:
        assert r["federated_clients"] == NODES and r["federated_samples"] == held_out
        assert 0.0 <= r["federated_acc"] <= 1.0 and r["federated_failures"] == 0
    assert cfg.out_dir == str(out)


@pytest.mark.flower
def test_insecure_deployment_reaches_phase_2_and_stops_every_process(runs, own_data):
    insecure_run = runs["insecure"].result()
    assert insecure_run.status == "finished:completed"
    check_phase_2_job(insecure_run.out, diagnostics=True, held_out=held_out_total(own_data))
    cfg = load_run_config(json.loads((insecure_run.out / "config.json").read_text()))
    for k in range(NODES):  # each node prepared its partition once, on disk
        cache = insecure_run.out.parent / f"cache-{k}"
        assert [p.name for p in cache.iterdir()] == [f"{partition_key(cfg, k)}.npz"]
    assert len(insecure_run.pgids) == 2 + 2 * (NODES + 1)
    assert group_members(insecure_run.pgids) == []
    # the node without data failed when asked for its partition id, so it was never
    # sampled; the error names it and the path in its own log, and reaches the server's
    # without the path (docs/PRIVACY.md, "Data at rest and in the clear")
    path = insecure_run.out.parent / "no-such-data.npz"
    missing = "(partition-id {}): data-path='{}' does not exist"
    work = insecure_run.work
    node_log = (work / f"node-{NODES}" / "superexec.log").read_text()
    assert missing.format(NODES - 1, path) in node_log
    server_log = (work / "cli" / "run.log").read_text()
    assert missing.format(NODES - 1, "<node-config:data-path>") in server_log
    assert str(path) not in server_log
    # Flower's lines say when they were written (common/flower_log.py): the ServerApp's
    # stream, a SuperNode's log and its SuperExec's
    stamp = r"(?m)^INFO \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: +"
    assert re.search(stamp + r"\[round 1/3\]", server_log), server_log[-2000:]
    for name in ("supernode.log", "superexec.log"):  # Flower colours them: COLOUR
        assert re.search(stamp, COLOUR.sub(b"", (work / "node-0" / name).read_bytes()
                                           ).decode()), name
    # every SuperExec forked its app processes from its zygote (fedefc_cli/app_zygote.py)
    execs = sorted(work.glob("*/superexec.log"))
    assert len(execs) == NODES + 2
    assert all(" torch, flwr.supernode.cli, flwr.superlink.cli imported in " in p.read_text()
               for p in execs), execs
    # each node declared its partition's size once, when first seen
    sizes = {str(k): len(partition_data(cfg, k, CPU)) for k in range(NODES)}
    recs = records(insecure_run.out)
    assert recs[1]["declared"] == sizes and all("declared" not in r for r in recs[2:])


@pytest.mark.flower
def test_secure_aggregation_deployment_refuses_lies_before_the_sum(runs):
    insecure_run = runs["insecure"].result()
    out, status = insecure_run.extra["secure"]
    assert status == "finished:completed"
    recs = records(out)
    assert [r["phase"] for r in recs] == [1, 1, 1, 2, 2]
    assert json.loads((out / "summary.json").read_text())["t_e"] == 2
    # A(1) from the secure sum is the plain mean of the clients' accuracies of the initial
    # model on their observed labels, computed here from the same partitions
    cfg = load_run_config(json.loads((out / "config.json").read_text()))
    locals_ = [partition_data(cfg, k, CPU) for k in range(NODES)]
    model = initial_model(cfg, locals_[0].data.task)
    accuracies = [evaluate(model, d.x, d.y, BatchTransform.of(d.spec, CPU))[1] for d in locals_]
    assert recs[1]["A"] == pytest.approx(float(np.mean(accuracies)), abs=1e-5)
    assert all(r.get("client_acc") is None for r in recs)
    assert recs[3]["partition_ids"] == [1, 2] and recs[4]["partition_ids"] == [0, 2]
    assert recs[3]["rejected_reasons"][0]["reason"].startswith("sample count 60 outside 1..")
    assert recs[4]["rejected_reasons"][0]["reason"] == (
        "partition id 2 is not its node's registered partition 1")
    assert all(r["failures"] == 0 for r in recs[1:])
    for k in range(NODES):  # each node audited what it sent: never an accuracy
        lines = (out / "audit" / f"partition-{k}.jsonl").read_text().splitlines()
        keys = {key for line in lines for rec in json.loads(line).get("records", {}).values()
                for key in rec.get("keys", {})}
        assert "masked_params" in keys and "accuracy" not in keys


@pytest.mark.flower
def test_tls_authenticated_deployment_with_private_data_refuses_unregistered_node(runs,
                                                                                  own_data):
    tls_run = runs["tls"].result()
    refused = tls_run.extra
    assert refused["code"] == 1, refused["log"][-2000:]
    assert "Exit Code: 305" in refused["log"] and "code: 2004" in refused["log"]
    key = tls_run.work.parent / "keys" / "intruder"
    assert f"its public key {key}.pub is not registered there" in refused["log"]
    assert refused["online"] == NODES  # the registered nodes, not the intruder
    assert tls_run.status == "finished:completed"
    check_phase_2_job(tls_run.out, diagnostics=False, held_out=held_out_total(own_data))
    # the server held no data: it read neither a training nor a test set
    assert json.loads((tls_run.out / "data.json").read_text()) == {
        "evaluation": "federated", "input_shape": list(TASK.input_shape),
        "num_classes": TASK.num_classes}
    summary = json.loads((tls_run.out / "summary.json").read_text())
    assert summary["admission"]["mode"] == "open-deployment"  # no allowlist, opened
    assert summary["admission"]["bound"] == "max-client-samples"
    assert summary["accuracy_source"] == "federated held-out data"
    assert summary["final_acc"] == records(tls_run.out)[-1]["federated_acc"]
    assert "test_acc" not in records(tls_run.out)[-1]
    cfg = load_run_config(json.loads((tls_run.out / "config.json").read_text()))
    files = [tls_run.work.parent / "data" / f"node-{k}" / "data.npz" for k in range(NODES)]
    assert records(tls_run.out)[1]["declared"] == {  # private data: what each node trains on
        str(k): training_size(cfg, len(np.load(f)["labels"])) for k, f in enumerate(files)}
    assert group_members(tls_run.pgids) == []
    link_log = (tls_run.work / "superlink" / "superlink.log").read_text()
    assert "SuperNode authentication is disabled" not in link_log


@pytest.mark.flower
def test_quick_start_runs_as_documented(runs):
    """docs/DEPLOYMENT.md's quick start, its commands read from the doc: the run completes
    and reaches the phase 2 the doc announces; the doc's last line stops every process."""
    qs = runs["quickstart"].result()
    assert qs["code"] == 0, qs["log"][-3000:]
    out = qs["out"]
    assert f"; results in {out} on the SuperLink machine" in qs["log"], qs["log"][-3000:]
    # submit ends with the run in a few lines (issue 49), its picture beside the summary
    assert f"  files: {out} (summary.json, metrics.jsonl, curves.png, model.pt" in qs["log"]
    assert re.search(r"run \d+: finished:completed", qs["log"])
    documented = int(re.search(r"PRESTOPPING POINT T_e = (\d+)",
                               section("Quick start")).group(1))
    assert f"PRESTOPPING POINT T_e = {documented}" in qs["log"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["t_e"] == documented and summary["rounds"] > documented
    assert (f": completed after {summary['rounds_run']} of {summary['rounds']} rounds in "
            in qs["log"])
    assert summary["client_failures"] == 0 and summary["rejected_replies"] == 0
    assert [r["phase"] for r in records(out)][-1] == 2
    assert qs["left"] == [], "the quick start's own stop line left processes running"
    assert f"SuperLink on 127.0.0.1:{qs['port']}" in qs["log"]
    for folder, logs in (("link", "superlink.log"), ("node-0", "supernode.log")):
        for name in (logs, "superexec.log"):  # --state-dir holds the logs, as promised
            assert (qs["state"] / folder / name).stat().st_size > 0, (folder, name)


@pytest.mark.flower
def test_tls_walkthrough_runs_as_documented(runs):
    """docs/DEPLOYMENT.md's one-machine TLS block, read from the doc and run as written:
    certificates, secrets, the signing key, node keys registered, each node's data
    prepared with ``fedefc data`` from a folder of PNG files, three authenticated
    SuperNodes with that data that run only signed apps, a signed run that completes,
    its results fetched; the block's last line stops every process."""
    walk = runs["tls-walkthrough"].result()
    log, home = walk["log"], walk["home"]
    assert walk["code"] == 0, log[-3000:]
    # every node trained on exactly its partition of the run dataset (noisy labels
    # included), read back from the image files through the shared class map
    fed = data_plan(load_run_config({"num-clients": NODES}))
    for k, idx in enumerate(fed.client_indices):
        prepared = np.load(home / "fedefc-data" / f"node-{k}" / "data.npz")
        assert sorted(zip(prepared["labels"].tolist(), map(bytes, prepared["images"]))) == \
            sorted(zip(fed.noisy_labels[idx].tolist(),
                       map(bytes, fed.data.train_x[torch.as_tensor(idx)].numpy())))
    assert f"SuperLink on 127.0.0.1:{walk['port']} (TLS, SuperNode authentication, signed " \
           "apps only)" in log
    assert re.search(r"run \d+: finished:completed; results in ", log), log[-3000:]
    fetched = home / "fedefc-results" / "tls-1"
    assert f"fetched {home}/fedefc-runs/tls-1 -> {fetched}" in log
    assert (fetched / "model.pt").read_bytes() == \
        (home / "fedefc-runs" / "tls-1" / "model.pt").read_bytes()
    assert (fetched / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"  files: {fetched} (summary.json, metrics.jsonl, curves.png, model.pt" in log
    summary = json.loads((fetched / "summary.json").read_text())
    assert summary["client_failures"] == 0 and summary["rejected_replies"] == 0
    # the ServerApp (its output is the run's log) and every node's ClientApps ran the
    # signed app after checking it
    assert "fedefc: app signed by trusted key 'coordinator'" in log
    for folder in ("supernode-0", "supernode-1", "supernode-2"):
        text = (home / ".fedefc" / folder / "superexec.log").read_text()
        assert "app signed by trusted key 'coordinator'" in text, folder
    assert walk["left"] == [], "the block's own stop line left processes running"


@pytest.mark.flower
def test_deployment_result_equals_simulation(runs):
    insecure_run, tls_run = runs["insecure"].result(), runs["tls"].result()
    simulation_run = runs["simulation"].result()
    sim = records(simulation_run)
    # client-threads=1 on both sides: bitwise the same model and the same curves
    dep = records(insecure_run.out)
    wa = torch.load(simulation_run / "model.pt")
    wb = torch.load(insecure_run.out / "model.pt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for key in ("test_acc", "test_loss", "A", "t_e", "phase", "partition_ids",
                "federated_acc", "federated_loss", "federated_true_acc", "federated_samples"):
        assert [r.get(key) for r in sim] == [r.get(key) for r in dep], key
    # default threads (ClientApp: all cores, Ray actor: 1), private data exported from the
    # same partitions, held out by the same seeds: the same T_e and held-out samples, the
    # same federated accuracy within 0.5 points
    tls = records(tls_run.out)
    assert [r["t_e"] for r in tls] == [r["t_e"] for r in sim]
    assert [r["federated_samples"] for r in tls] == [r["federated_samples"] for r in sim]
    assert abs(tls[-1]["federated_acc"] - sim[-1]["federated_acc"]) <= 0.005


# -- docker compose: parsed, flags valid for 1.42, same topology as the native runs ----------
COMPOSE_NODE_CONFIG = {"data-path": "/node-data/data.npz", "cache-dir": "/cache"}


def defaults(value: str) -> str:
    """A compose value with every ``${VAR:-default}`` read as its default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def compose_services(tls: bool) -> dict[str, dict]:
    """deploy/compose.yml, with compose.tls.yml's commands and volumes merged in."""
    services = yaml.safe_load((DEPLOY_DIR / "compose.yml").read_text())["services"]
    if tls:
        override = yaml.safe_load((DEPLOY_DIR / "compose.tls.yml").read_text())["services"]
        assert override.keys() <= services.keys()
        for name, extra in override.items():
            services[name] = {**services[name], "command": extra["command"],
                              "volumes": services[name].get("volumes", []) + extra["volumes"]}
    return services


def compose_runtime_host(k: int) -> str:
    """Where SuperNode k serves its Runtime API: its address on its own network node-k."""
    return f"10.250.{k}.2"


FRONT = {False: "fleet-front:8000", True: "fleet-front:8443"}  # where SuperNodes dial


def expected_commands(tls: bool) -> dict[str, list[str]]:
    """What fedefc_cli.deploy_flags (the native runs) gives for the compose services."""
    ca = "/certs/ca.crt" if tls else None
    secret = "/secrets/superexec" if tls else None
    files = TLSFiles(ca, "/certs/server.pem", "/certs/server.key") if tls else None
    cmds = {"superlink": superlink_flags("0.0.0.0", 8000, "/app/state.db", files, tls, secret),
            "superexec-serverapp": superexec_flags("superlink:8000", ca, secret)}
    for k in range(NODES):
        node_config = {"partition-id": k, "num-partitions": NODES, **COMPOSE_NODE_CONFIG}
        cmds[f"supernode-{k}"] = supernode_flags(FRONT[tls], node_config,
                                                 compose_runtime_host(k), 9094, ca,
                                                 "/keys/node" if tls else None, secret)
        cmds[f"superexec-clientapp-{k}"] = superexec_flags(f"supernode-{k}:9094", None, secret)
    return cmds


def accepted_flags(binary: str) -> set[str]:
    """The flags in ``binary --help`` whose help text does not call them deprecated."""
    text = subprocess.run([flower_bin(binary), "--help"], capture_output=True, text=True,
                          timeout=patience(600)).stdout
    options = text.split("options:", 1)[1]
    flags = set()
    for block in re.split(r"\n(?=  -)", options):  # one block per option
        head = block.strip().split("  ", 1)[0]  # e.g. "--port PORT" or "-h, --help"
        if head.startswith("-") and "deprecated" not in block.lower():
            flags.update(re.findall(r"--[a-z][a-z0-9-]*", head))
    return flags


@pytest.fixture(scope="module")
def help_flags() -> dict[str, set[str]]:
    return {b: accepted_flags(b) for b in ("flower-superlink", "flower-supernode",
                                           "flower-superexec")}


@pytest.mark.flower
@pytest.mark.parametrize("tls", [False, True], ids=["insecure", "tls"])
def test_compose_matches_native_topology_and_1_42_flags(tls, help_flags):
    services = compose_services(tls)
    assert services.keys() == {*expected_commands(tls), "fleet-front"}
    for name, cmd in expected_commands(tls).items():
        assert services[name]["command"] == cmd, name
        binary = ("flower-superlink" if name == "superlink" else "flower-supernode"
                  if name.startswith("supernode") else "flower-superexec")
        image = defaults(services[name]["image"])
        assert image.endswith(":1.42.0"), image
        if binary != "flower-superexec":
            assert image.startswith(f"flwr/{binary.removeprefix('flower-')}:")
        unknown = {f for f in cmd if f.startswith("--")} - help_flags[binary]
        assert not unknown, f"{name}: flags not accepted by {binary} 1.42: {unknown}"
    networks = yaml.safe_load((DEPLOY_DIR / "compose.yml").read_text())["networks"]
    for k in range(NODES):  # own data, own cache, own network per node
        # the Runtime API binds the node's address on its own internal network only, so
        # nothing on the shared network `fleet` (other nodes, the SuperLink) reaches it
        node_net = networks[f"node-{k}"]
        assert node_net["internal"] is True
        subnet = ipaddress.ip_network(node_net["ipam"]["config"][0]["subnet"])
        host = compose_runtime_host(k)
        assert services[f"supernode-{k}"]["networks"][f"node-{k}"] == {"ipv4_address": host}
        assert ipaddress.ip_address(host) in subnet
        assert set(services[f"supernode-{k}"]["networks"]) == {"fleet", f"node-{k}"}
        volumes = services[f"superexec-clientapp-{k}"]["volumes"]
        assert any(v.endswith(f"/data/node-{k}:/node-data:ro") for v in volumes)
        assert f"node-{k}-cache:/cache" in volumes
        assert services[f"superexec-clientapp-{k}"]["networks"] == [f"node-{k}"]
    # the SuperLink's SuperExec (and its ServerApps) share an internal network with the
    # SuperLink alone: no SuperNode, no route out
    assert services["superexec-serverapp"]["networks"] == ["runtime"]
    assert networks["runtime"] == {"internal": True}
    # the SuperNodes reach the SuperLink through the Fleet-only front alone: the
    # SuperLink is not on their network `fleet` (its port serves the Control API too)
    assert set(services["superlink"]["networks"]) == {"control", "runtime"}
    assert set(services["fleet-front"]["networks"]) == {"fleet", "control"}
    front = services["fleet-front"]
    conf = "tls.conf" if tls else "insecure.conf"
    assert front.get("command", ["/etc/fedefc/insecure.conf"]) == [f"/etc/fedefc/{conf}"]
    assert "./fleet-front:/etc/fedefc:ro" in front["volumes"]
    text = (DEPLOY_DIR / "fleet-front" / conf).read_text()
    assert re.findall(r"^\s*listen (\d+)", text, re.M) == [FRONT[tls].split(":")[1]]
    assert fleet_only_rule(text) == {"/v1/fleet/": f"proxy_pass http{'s' * tls}://superlink:8000",
                                     "/": "return 403"}
    assert "results:/results" in services["superexec-serverapp"]["volumes"]
    assert [defaults(p) for p in services["superlink"]["ports"]] == ["127.0.0.1:8000:8000"]
    # the Flower images and the torch index are settings, so that Flower's images and
    # stand-ins built without a registry both work (deploy/compose-demo.sh --base-image)
    build = services["superexec-serverapp"]["build"]
    assert defaults(build["args"]["SUPEREXEC_IMAGE"]) == "flwr/superexec:1.42.0"
    assert services["superlink"]["image"].startswith("${FLWR_SUPERLINK_IMAGE:-")
    dockerfile = (DEPLOY_DIR / "Dockerfile").read_text()
    assert re.search(r"^ARG SUPEREXEC_IMAGE=flwr/superexec:1\.42\.0$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{SUPEREXEC_IMAGE\}$", dockerfile, re.M)
    assert "--index-url \"${TORCH_INDEX_URL}\"" in dockerfile


def fleet_only_rule(conf: str) -> dict[str, str]:
    """{location: its first directive} of an nginx configuration's server block."""
    plain = re.sub(r"#[^\n]*", "", conf)
    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"location (\S+) \{\s*([^;]*);", plain)}


def test_the_fleet_only_fronts_pass_the_same_locations_as_the_tested_one():
    """The compose demo's fronts and deploy/nginx-fleet-only.conf (which
    tests/test_deployment_ops.py runs with real nginx) pass /v1/fleet/ alone."""
    tested = fleet_only_rule((DEPLOY_DIR / "nginx-fleet-only.conf").read_text())
    for conf in ("insecure.conf", "tls.conf"):
        rule = fleet_only_rule((DEPLOY_DIR / "fleet-front" / conf).read_text())
        assert rule.keys() == tested.keys() == {"/v1/fleet/", "/"}
        assert rule["/"] == tested["/"] == "return 403"


@pytest.mark.flower
def test_help_parsing_rejects_removed_and_deprecated_flags(help_flags):
    assert "--isolation" in help_flags["flower-superlink"]
    assert "--fleet-api-address" not in help_flags["flower-superlink"]  # deprecated
    assert "--auth-list-public-keys" not in help_flags["flower-superlink"]
    assert "--plugin-type" not in help_flags["flower-superexec"]  # hidden, ignored


def test_compose_demo_run_config_is_valid():
    cfg = load_run_config({**read_app_defaults(),
                           **read_preset(str(DEPLOY_DIR / "demo-run-config.toml"))})
    assert cfg.num_clients == NODES and cfg.dataset == "mnist-embedded"  # no data-dir
    assert cfg.out_dir.startswith("/results/")  # on the results volume


# -- private data and the disk cache ---------------------------------------------------------
NODE = "node 7 (partition-id 1)"
MNIST = TaskShape((1, 28, 28), 10)
CIFAR = TaskShape((3, 32, 32), 10)


def images(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


@pytest.mark.parametrize("spec,shape,to_nchw", [
    (MNIST, (28, 28), lambda a: a[:, None]),
    (MNIST, (1, 28, 28), lambda a: a),
    (MNIST, (28, 28, 1), lambda a: a.transpose(0, 3, 1, 2)),
    (CIFAR, (3, 32, 32), lambda a: a),
    (CIFAR, (32, 32, 3), lambda a: a.transpose(0, 3, 1, 2)),
], ids=["mnist-NHW", "mnist-NCHW", "mnist-NHWC", "cifar-NCHW", "cifar-NHWC"])
def test_npz_layouts_decode_to_nchw(tmp_path, spec, shape, to_nchw):
    raw = images(5, shape)
    np.savez(tmp_path / "d.npz", images=raw, labels=np.array([0, 1, 2, 3, 9], dtype=np.uint8))
    samples = load_private_data(str(tmp_path / "d.npz"), spec, NODE)
    x, y = samples.x, samples.y
    assert x.dtype == np.uint8 and x.shape == (5, *spec.input_shape)
    np.testing.assert_array_equal(x, to_nchw(raw))
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2, 3, 9]


def write_image_folder(root: Path, mode: str, size: int, per_class: dict[str, int]
                       ) -> dict[str, list[np.ndarray]]:
    from PIL import Image

    written = {}
    for cls, count in per_class.items():
        (root / cls).mkdir(parents=True)
        shape = (size, size) if mode == "L" else (size, size, 3)
        written[cls] = [images(1, shape, seed=i + 10 * int(cls))[0] for i in range(count)]
        for i, pixels in enumerate(written[cls]):
            Image.fromarray(pixels).save(root / cls / f"img{i}.png")  # L or RGB by shape
    (root / "3" / "notes.txt").write_text("not an image, skipped")
    return written


@pytest.mark.parametrize("spec,mode", [(MNIST, "L"), (CIFAR, "RGB")], ids=["gray", "rgb"])
def test_image_folder_labels_are_class_folder_indices(tmp_path, spec, mode):
    written = write_image_folder(tmp_path / "data", mode, spec.input_shape[1], {"3": 2, "7": 1})
    samples = load_private_data(str(tmp_path / "data"), spec, NODE)
    x, y = samples.x, samples.y
    assert y.tolist() == [3, 3, 7] and x.shape == (3, *spec.input_shape)
    first = written["3"][0]
    np.testing.assert_array_equal(x[0], first[None] if mode == "L" else first.transpose(2, 0, 1))


def bad_npz(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("make,problem", [
    (lambda t: t / "missing.npz", "does not exist"),
    (lambda t: (t / "x.npz").write_bytes(b"not a zip") and t / "x.npz", "not a readable .npz"),
    (lambda t: bad_npz(t, images=images(2, (28, 28))), "it needs 'labels'"),
    (lambda t: bad_npz(t, images=images(2, (28, 28)).astype(np.float32),
                       labels=np.zeros(2, int)), "dtype float32"),
    (lambda t: bad_npz(t, images=images(2, (32, 32, 3)), labels=np.zeros(2, int)),
     "shape (2, 32, 32, 3)"),
    (lambda t: bad_npz(t, images=images(2, (28, 28)), labels=np.array([0, 10])),
     "label 10 is outside 0..9"),
    (lambda t: bad_npz(t, images=images(2, (28, 28)), labels=np.zeros(3, int)),
     "2 images but 3 labels"),
], ids=["missing", "not-npz", "no-labels", "float", "wrong-shape", "label-range", "count"])
def test_malformed_npz_names_node_and_path(tmp_path, make, problem):
    path = make(tmp_path)
    with pytest.raises(PrivateDataError) as err:
        load_private_data(str(path), MNIST, NODE)
    assert NODE in str(err.value) and str(path) in str(err.value)
    assert problem in str(err.value)


def test_malformed_image_folder_names_node_and_path(tmp_path):
    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    with pytest.raises(PrivateDataError, match=r"class folder 'cat' is not a class index") as e:
        load_private_data(str(root), MNIST, NODE)
    assert NODE in str(e.value) and str(root) in str(e.value)
    (root / "cat").rmdir()
    write_image_folder(root, "L", 14, {"3": 1})
    with pytest.raises(PrivateDataError, match=r"is 14x14 pixels, but the run expects 28x28") as e:
        load_private_data(str(root), MNIST, NODE)
    assert str(root / "3" / "img0.png") in str(e.value)


def test_node_config_paths_must_be_absolute_and_exist(tmp_path):
    with pytest.raises(PrivateDataError, match="cache-dir='cache' is not an absolute"):
        check_node_config({"cache-dir": "cache"}, NODE)
    with pytest.raises(PrivateDataError, match=re.escape(f"{NODE}: data-path='{tmp_path}/nope'")):
        check_node_config({"data-path": str(tmp_path / "nope")}, NODE)


def test_partition_cache_hits_on_second_load_and_equals_partition_data(
        own_data, tmp_path, monkeypatch):
    cfg = load_run_config(job(own_data, tmp_path / "out"))
    node_config = {"partition-id": 1, "num-partitions": NODES, "cache-dir": str(tmp_path)}
    first = node_data(cfg, 1, node_config, NODE, CPU)
    assert [p.name for p in tmp_path.glob("*.npz")] == [f"{partition_key(cfg, 1)}.npz"]

    def rebuild(*args):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr("fedefc_client.local_data._partition_arrays", rebuild)
    second = node_data(cfg, 1, node_config, NODE, CPU)
    ref = partition_data(cfg, 1, CPU)
    for local in (first, second):
        assert torch.equal(local.x, ref.x) and np.array_equal(local.labels, ref.labels)
        np.testing.assert_array_equal(local.true_transition, ref.true_transition)
        assert local.noise_rate == ref.noise_rate
        assert torch.equal(local.data.test_x, ref.data.test_x)
        assert torch.equal(local.held_out.x, ref.held_out.x)
        assert torch.equal(local.held_out.true_y, ref.held_out.true_y)
        assert local.spec == ref.spec
    other = load_run_config({**cfg.to_flat(), "seed": 1})
    assert partition_key(other, 1) != partition_key(cfg, 1) != partition_key(cfg, 2)


def test_private_cache_key_follows_the_data_and_export_round_trips(own_data, tmp_path):
    """``fedefc deploy export`` writes partition 2 as a private file; the node holding it
    trains on and holds out exactly what partition 2 of the simulation does."""
    out = tmp_path / "export"
    cfg = load_run_config(job(own_data, tmp_path / "out"))
    sets = [f"--set={k}={toml_value(v)}" for k, v in cfg.to_flat().items() if k != "out-dir"]
    assert main(["deploy", "export", str(out), *sets]) == 0
    ref = partition_data(cfg, 2, CPU)
    path = out / "node-2" / "data.npz"
    assert path.stat().st_mode & 0o777 == 0o644
    key = private_key(TASK, str(path))
    cache = DataCache(tmp_path / "cache")
    local = node_data(cfg, 2, {"data-path": str(path), "cache-dir": str(cache.root)}, NODE, CPU)
    assert cache.path(key).is_file()
    assert torch.equal(local.x, ref.x) and np.array_equal(local.labels, ref.labels)
    assert torch.equal(local.held_out.x, ref.held_out.x)
    assert torch.equal(local.held_out.y, ref.held_out.y) and local.held_out.true_y is None
    assert local.true_transition is None and local.test_split() is None
    assert private_key(TaskShape(TASK.input_shape, 6), str(path)) != key
    write_npz(path, ref.x.numpy()[:5], ref.labels[:5])
    os.utime(path, ns=(1, 1))  # new size and mtime: a new entry
    assert private_key(TASK, str(path)) != key
    assert len(node_data(cfg, 2, {"data-path": str(path), "cache-dir": str(cache.root)},
                         NODE, CPU)) == 4  # 5 samples, 1 held out


# -- the command line ------------------------------------------------------------------------
def test_cli_refuses_a_public_insecure_superlink_and_a_submit_without_out_dir(tmp_path, capsys):
    assert main(["deploy", "superlink", "--host", "0.0.0.0", "--state-dir", str(tmp_path)]) == 2
    assert "refusing to serve the SuperLink without TLS" in capsys.readouterr().err
    assert not (tmp_path / "state.db").exists()  # nothing was started
    assert main(["deploy", "submit", "fedefc", "--set", "rounds=2"]) == 2
    assert "out-dir is required" in capsys.readouterr().err


def test_cli_connection_keeps_other_connections(tmp_path):
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\noptions.num-supernodes = 10\n')
    ca = tmp_path / "ca.crt"
    ca.write_text("-")
    assert main(["deploy", "connection", "prod", "link.example.org:8000", "--ca-cert", str(ca),
                 "--flwr-home", str(tmp_path)]) == 0
    links = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert links["default"] == "local" and links["local"]["options"]["num-supernodes"] == 10
    assert links["prod"] == {"address": "link.example.org:8000", "root-certificates": str(ca)}
