"""The operator's side, on real Flower processes: failed runs reported as failed, one run at
a time, results not pullable through Flower, and outsiders' apps refused where they
would run (docs/DEPLOYMENT.md, "When a run fails", "Results", "Outsiders on the network"), and
the Fleet-only proxy in front of the SuperLink (deploy/nginx-fleet-only.conf; skipped
where nginx is not installed).

Two small federations on 127.0.0.1, started concurrently, run the message-only app
tests/flower_apps/noop (its ServerApp fails, or logs a failure and returns, or holds
the SuperLink busy, or exchanges messages; every app process it starts writes a marker
file, so the tests see which code ran where):

- ``nodes``: a SuperLink that checks nothing and one SuperNode started with
  ``--trusted-keys`` (the coordinator's key). An outsider who reaches the Control API
  with the CA certificate submits his own app, unsigned, signed with his own key, or the
  coordinator's signed app with another run config or a changed file: the ServerApp runs
  (this SuperLink does not check), the node refuses, and no ClientApp code runs.
- ``link``: a SuperLink started with ``--trusted-keys``, with one SuperNode started with
  Flower's own ``--trusted-entities``: an outsider's ServerApp never runs on the
  SuperLink machine; the coordinator's signed app runs, and Flower's own check refuses
  it on the node (in 1.42 a SuperLink attaches no verification to an app sent by
  ``flwr run``: why the project checks signatures itself, fedefc_cli/app_signing.py).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from fedefc_cli import deploy_submit, flower
from fedefc_cli.app_signing import stage_signed_app
from fedefc_cli.deploy_flags import TLSFiles
from fedefc_cli.deploy_local import DEPLOY_DIR, LocalDeployment, NodeSpec
from fedefc_cli.deploy_submit import refuse_a_busy_superlink, write_connection
from fedefc_cli.errors import UsageError
from fedefc_cli.flower import flower_bin, flwr_json, free_port, submit_run
from fedefc_cli.procs import wait_for_port
from fedefc_cli.run_configs import write_run_config
from tests.helpers import patience

pytestmark = pytest.mark.flower
NOOP_APP = Path(__file__).parent / "flower_apps" / "noop"
TIMEOUT = patience(1800)  # a run of the no-op app (one message)


def make_keys(folder: Path) -> Path:
    for name in ("coordinator", "outsider"):
        subprocess.run(["bash", str(DEPLOY_DIR / "gen-signing-key.sh"), str(folder), name],
                       check=True, capture_output=True)
    return folder


def markers(folder: Path) -> list[str]:
    """Which app processes ran: 'serverapp' / 'clientapp' per process."""
    return sorted(p.name.split("-")[0] for p in folder.iterdir() if p.name != "release")


def noop(marks: Path, **keys) -> dict:
    """A run config of the no-op app: one round of one message to the one node."""
    marks.mkdir(parents=True, exist_ok=True)
    return {"mode": "ok", "rounds": 1, "nodes": 1, "query": False, "marker-dir": str(marks),
            **keys}


def outsider_run(dep: LocalDeployment, run_config: dict, app: Path) -> dict:
    """``flwr run`` by someone who holds only the connection (the CA certificate): his
    app folder, his run config; returns the outcome and the replies his ServerApp got."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_run_config(Path(tmp) / "run.toml", run_config)
        res = flwr_json(["run", str(app), dep.CONNECTION, "--run-config", str(cfg)],
                        dep.cli_env, dep.cli_dir)
    run_id = str(res["run-id"])
    deadline = time.monotonic() + TIMEOUT
    while not (status := deployment_status(dep, run_id)).startswith("finished"):
        assert time.monotonic() < deadline, f"run {run_id} did not end"
        time.sleep(1)
    log = subprocess.run([flower_bin("flwr"), "log", run_id, dep.CONNECTION], env=dep.cli_env,
                         cwd=dep.cli_dir, capture_output=True, text=True).stdout
    return {"status": status, "log": log, "marks": markers(Path(run_config["marker-dir"]))}


def deployment_status(dep: LocalDeployment, run_id: str) -> str:
    res = flwr_json(["ls", dep.CONNECTION, "--run-id", run_id], dep.cli_env, dep.cli_dir)
    return str(res["runs"][0]["status"])


def staged(keys: Path, run_config: dict, work: Path, key: str = "coordinator") -> Path:
    """The signed app folder ``fedefc deploy submit --sign-key`` would send."""
    cfg = write_run_config(work / f"{key}.toml", run_config)
    return stage_signed_app(NOOP_APP, parse_config_args([str(cfg)]), keys / key, key,
                            work / f"app-{key}")


def nodes_federation(base: Path) -> dict:
    keys = make_keys(base / "keys")
    coordinator = (str(keys / "coordinator"), "coordinator")
    found: dict = {}
    node = NodeSpec({"partition-id": 0, "num-partitions": 1},
                    trusted_keys=str(keys / "coordinator.trusted.yaml"))
    with LocalDeployment(base / "federation", [node]) as dep:
        dep.wait_online(1)

        def submit(run_config, sign=coordinator):
            return submit_run(dep.CONNECTION, run_config, dep.cli_env, dep.cli_dir, NOOP_APP,
                              log=dep.cli_dir / "run.log", timeout=TIMEOUT, sign_key=sign)

        # the coordinator's runs: failed, hollow, held busy, good
        found["fail"] = submit(noop(base / "m-fail", mode="fail"))
        found["hollow"] = submit(noop(base / "m-hollow", mode="hollow"))
        hold = noop(base / "m-hold", mode="hold", **{"hold-s": TIMEOUT})
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(submit, hold)
            deadline = time.monotonic() + TIMEOUT
            while not flower.active_runs(dep.CONNECTION, dep.cli_env, dep.cli_dir):
                assert time.monotonic() < deadline and not held.done(), "no run became active"
                time.sleep(0.5)
            try:
                refuse_a_busy_superlink(dep.CONNECTION, dep.cli_env, dep.cli_dir)
            except UsageError as err:
                found["busy"] = str(err)
            (base / "m-hold" / "release").write_text("")
            found["held"] = held.result()
        found["ok"] = submit(noop(base / "m-ok"))
        found["ok-marks"] = markers(base / "m-ok")
        found["pull"] = subprocess.run([flower_bin("flwr"), "pull", found["ok"].run_id,
                                        dep.CONNECTION], env=dep.cli_env, cwd=dep.cli_dir,
                                       capture_output=True, text=True)
        # an outsider's runs
        work = base / "outsider"
        work.mkdir()
        found["unsigned"] = outsider_run(dep, noop(base / "m-unsigned"), NOOP_APP)
        own = noop(base / "m-own")
        found["own-key"] = outsider_run(dep, own, staged(keys, own, work, "outsider"))
        signed_config = noop(base / "m-replay")
        app = staged(keys, signed_config, work)
        found["replay"] = outsider_run(dep, {**signed_config, "query": True}, app)
        tampered = noop(base / "m-tampered")
        (work / "t").mkdir()
        app = staged(keys, tampered, work / "t")
        (app / "noop_app" / "client_app.py").write_text(
            (app / "noop_app" / "client_app.py").read_text() + "\nOUTSIDER = True\n")
        found["tampered"] = outsider_run(dep, tampered, app)
        found["node-log"] = (dep.work_dir / "node-0" / "superexec.log").read_text()
    return found


def link_federation(base: Path) -> dict:
    keys = make_keys(base / "keys")
    trusted = str(keys / "coordinator.trusted.yaml")
    found: dict = {}
    flower_check = NodeSpec({"partition-id": 0, "num-partitions": 1},
                            extra_flags=("--trusted-entities", trusted))
    with LocalDeployment(base / "federation", [flower_check], link_trusted_keys=trusted) as dep:
        dep.wait_online(1)
        found["unsigned"] = outsider_run(dep, noop(base / "m-unsigned"), NOOP_APP)
        found["forgot-key"] = submit_run(dep.CONNECTION, noop(base / "m-forgot"), dep.cli_env,
                                         dep.cli_dir, NOOP_APP, timeout=TIMEOUT)
        found["signed"] = submit_run(dep.CONNECTION, noop(base / "m-signed", **{
            "out-dir": str(base / "out-signed")}), dep.cli_env, dep.cli_dir, NOOP_APP,
            timeout=TIMEOUT, sign_key=(str(keys / "coordinator"), "coordinator"))
        found["signed-marks"] = markers(base / "m-signed")
        found["signed-metrics"] = (base / "out-signed" / "metrics.jsonl").read_text()
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    """Both federations, run concurrently (mostly waiting on Flower's polling)."""
    with ThreadPoolExecutor(2) as pool:
        yield {"nodes": pool.submit(nodes_federation, tmp_path_factory.mktemp("ops-nodes")),
               "link": pool.submit(link_federation, tmp_path_factory.mktemp("ops-link"))}


def test_a_run_that_trained_nothing_fails_with_its_reason(runs):
    found = runs["nodes"].result()
    fail = found["fail"]
    assert fail.status == "finished:failed" and not fail.completed
    assert fail.failure == "no node trained in round 1 (fail)"
    assert "no node trained in round 1 (fail)" in deploy_submit.explain_failure(
        fail, "/srv/r", "fedefc")


def test_a_hollow_run_is_never_reported_completed(runs):
    hollow = runs["nodes"].result()["hollow"]
    assert hollow.status == "finished:completed"  # what Flower says
    assert not hollow.completed and hollow.failure == "no node trained in round 1 (hollow)"
    assert hollow.verdict.startswith("finished:completed but RUN FAILED: no node trained")


def test_a_second_run_is_refused_while_one_runs(runs):
    found = runs["nodes"].result()
    assert "is running another run: " in found["busy"] and "nothing submitted" in found["busy"]
    assert found["held"].run_id in found["busy"]
    assert found["held"].completed and found["ok"].completed


def test_flwr_pull_has_no_artifacts_in_open_source_flower(runs):
    """Why ``fedefc deploy fetch`` copies the out-dir instead (docs/DEPLOYMENT.md)."""
    pull = runs["nodes"].result()["pull"]
    assert pull.returncode != 0
    assert "without artifact provider" in pull.stdout + pull.stderr


def test_the_coordinators_signed_app_runs_on_a_node_that_checks(runs):
    found = runs["nodes"].result()
    assert found["ok"].completed and found["ok-marks"] == ["clientapp", "serverapp"]
    assert "app signed by trusted key 'coordinator'" in found["node-log"]
    assert "torch, flwr.supernode.cli, flwr.superlink.cli imported in" in found["node-log"]


@pytest.mark.parametrize("attack,reason", [
    ("unsigned", "the app is not signed"),
    ("own-key", "signed by key 'outsider', which this machine does not trust"),
    ("replay", "the run config differs from the one key 'coordinator' signed, in query"),
    ("tampered", "files differ from what key 'coordinator' signed: noop_app/client_app.py"),
])
def test_an_outsider_with_the_ca_certificate_cannot_run_code_on_a_node(runs, attack, reason):
    """Fails on code without signed apps: the outsider's ClientApp ran on the node."""
    run = runs["nodes"].result()[attack]
    assert run["marks"] == ["serverapp"], "the outsider's ClientApp ran on the node"
    assert "UntrustedAppError" in run["log"] and reason in run["log"], run["log"][-2000:]


def test_an_outsiders_serverapp_never_runs_on_a_checking_superlink(runs):
    unsigned = runs["link"].result()["unsigned"]
    assert unsigned["status"] == "finished:failed" and unsigned["marks"] == []
    assert "refused: the app is not signed" in unsigned["log"]


def test_a_run_refused_as_unsigned_is_reported_with_the_refusal_not_an_exit_code(runs):
    """Issue 49's trial: a resume submitted without --sign-key to a SuperLink that runs
    signed apps only failed with `Reason: ERROR : Exit Code: 201`, Flower's code for
    any exception; the cause was only in `flwr log`. submit's reason is now the
    ServerApp's own exception."""
    forgot = runs["link"].result()["forgot-key"]
    assert forgot.status == "finished:failed" and not forgot.interrupted
    assert forgot.failure.startswith("UntrustedAppError: ") and "the app is not signed" in \
        forgot.failure, forgot.failure
    assert "Exit Code" not in deploy_submit.explain_failure(forgot, "/srv/r", "fedefc")


def test_flowers_own_trusted_entities_refuse_every_app_sent_by_flwr_run(runs):
    """Flower 1.42: a SuperNode with --trusted-entities (the coordinator's key) refuses
    even the coordinator's signed app: the SuperLink gives a FAB sent by ``flwr run`` no
    verification. This test fails the day Flower accepts it; then switch to Flower's."""
    found = runs["link"].result()
    assert found["signed"].completed and found["signed-marks"] == ["serverapp"]
    assert "The FAB could not be verified." in found["signed-metrics"]


class BehindNginx(LocalDeployment):
    """The SuperLink on loopback with TLS and SuperNode authentication, its SuperNodes
    dialling nginx with deploy/nginx-fleet-only.conf (paths and addresses filled in)."""

    def __init__(self, work: Path, nodes: list[NodeSpec], tls: TLSFiles):
        super().__init__(work / "federation", nodes, tls=tls)
        self.work, self.front_port, self.nginx = work, free_port(), None

    def start_node(self, name: str, node: NodeSpec):
        if self.nginx is None:
            conf = (DEPLOY_DIR / "nginx-fleet-only.conf").read_text()
            for old, new in (("203.0.113.7:8443", f"127.0.0.1:{self.front_port}"),
                             ("/etc/fedefc/certs", str(Path(self.tls.ca_cert).parent)),
                             ("127.0.0.1:8000", self.address)):
                assert old in conf
                conf = conf.replace(old, new)
            w = self.work
            (w / "nginx.conf").write_text(f"pid {w}/nginx.pid; error_log {w}/error.log; "
                                          f"events {{}} http {{ access_log {w}/access.log; "
                                          f"{conf} }}")
            self.nginx = self.procs.start("nginx", ["nginx", "-g", "daemon off;", "-c",
                                                    str(w / "nginx.conf"), "-p", str(w)],
                                          self.cli_env, w)
            wait_for_port("127.0.0.1", self.front_port, self.procs)
        link, self.address = self.address, f"localhost:{self.front_port}"
        try:
            return super().start_node(name, node)
        finally:
            self.address = link


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_behind_the_fleet_only_proxy_nodes_train_and_the_control_api_is_closed(tmp_path):
    """deploy/nginx-fleet-only.conf: an authenticated SuperNode trains through it (the
    messages of a 2-million-value model included); an outsider with the CA certificate
    who dials it gets 403 for every Control API call."""
    for name, args in (("gen-certs.sh", [tmp_path / "certs", "localhost"]),
                       ("gen-node-keys.sh", [tmp_path / "keys", "node-0"])):
        subprocess.run(["bash", str(DEPLOY_DIR / name), *map(str, args)], check=True,
                       capture_output=True)
    node = NodeSpec({"partition-id": 0, "num-partitions": 1},
                    auth_key=str(tmp_path / "keys" / "node-0"))
    with BehindNginx(tmp_path, [node], TLSFiles.in_dir(tmp_path / "certs")) as dep:
        outcome = dep.submit(noop(tmp_path / "marks", floats=2_000_000,
                                  **{"out-dir": str(tmp_path / "out")}),
                             app_dir=NOOP_APP, timeout=TIMEOUT)
        outside = tmp_path / "outsider-home"
        write_connection(outside, "front", f"localhost:{dep.front_port}", dep.ca_cert)
        env = {**dep.cli_env, "FLWR_HOME": str(outside)}
        listed = flwr_json(["ls", "front"], env, tmp_path)
        started = flwr_json(["run", str(NOOP_APP), "front"], env, tmp_path)
    assert outcome.completed
    assert '"replies": 1, "errors": []' in (tmp_path / "out" / "metrics.jsonl").read_text()
    for res, path in ((listed, "list-runs"), (started, "start-run")):
        assert res["success"] is False
        assert f"403 Forbidden' for url 'https://localhost:{dep.front_port}/v1/control/{path}" \
            in res["error-message"]
    access = (tmp_path / "access.log").read_text()
    assert '"POST /v1/fleet/pull-messages HTTP/1.1" 200' in access
