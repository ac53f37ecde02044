"""A real Flower simulation (flwr run + simulation SuperLink + Ray), end to end.

The job uses a learning rate of 1e-7 so that the global model's accuracy on the clients'
data, A(t), is the same in rounds 1 and 2: with start-round 0 and gamma_thr 1 the tie
makes round 2 the prestopping point by construction, and rounds 3-5 must run phase 2.
(Learning itself is tested in test_training.py and measured by the benchmarks.)

The same job under secure aggregation (docs/PRIVACY.md), where A(t) is learnt from a
quantized sum (no exact ties): every client reports accuracy 0 in round 2 (``acc=0.0``
faults), so round 2 is T_e by construction; in phase 2 one client fails, then one
inflates its sample count, then one claims another's partition id. Every reply of
both jobs is audited.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job
from fedefc_server.curves import series
from tests.helpers import records

pytestmark = pytest.mark.flower  # one real simulation, shared by the tests


def job(data_dir, out_dir, **extra):
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist"', "data-dir": f'"{data_dir}"', "model": '"lenet"',
        "num-clients": 4, "fraction": 1.0, "rounds": 5, "local-epochs": 2, "batch-size": 8,
        "lr": 1e-7, "start-round": 0, "gamma-thr": 1, "rho": 0.4, "zeta": 0.4, "iid": "true",
        "accuracy-signal": '"global"', **extra,
    }.items()]
    return resolve_run_config(None, overrides, str(out_dir))


@pytest.fixture(scope="module")
def two_runs(micro_mnist_dir, tmp_path_factory):
    """The job twice; the second audited (which must change nothing)."""
    base = tmp_path_factory.mktemp("sim")
    outs = [base / "a", base / "b"]
    summaries = [run_simulation_job(job(micro_mnist_dir, out, **extra))
                 for out, extra in zip(outs, ({}, {"audit": "true"}))]
    return outs, summaries


SECURE_FAULTS = "acc=0.0@0-3@2;raise@3@3;samples=3@0@4;pid=1@2@5"


@pytest.fixture(scope="module")
def secure_run(micro_mnist_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim-secure") / "run"
    summary = run_simulation_job(job(micro_mnist_dir, out, **{
        "secure-aggregation": "true", "audit": "true", "faults": f'"{SECURE_FAULTS}"'}))
    return out, summary


def test_run_passes_through_phase_2_with_forward_corrected_clients(two_runs):
    (out, _), (summary, _) = two_runs
    recs = records(out)
    assert [r["round"] for r in recs] == list(range(6))
    assert recs[1]["A"] == recs[2]["A"]
    t_e = summary["t_e"]
    assert t_e == 2
    for r in recs[1:]:
        assert r["phase"] == (2 if r["round"] > t_e else 1)
        assert r["n_clients"] == 4 and sorted(r["partition_ids"]) == [0, 1, 2, 3]
        expected = "forward-corrected" if r["phase"] == 2 else "cross-entropy"
        assert r["client_loss"] == [expected] * 4
        if r["phase"] == 1:
            assert 0.0 <= r["A"] <= 1.0
        else:
            assert "A" not in r and 0 < r["q_cos"] <= 1.0
    assert {"final_acc", "best_acc", "mean_last10_acc", "wall_time_s"} <= set(summary)
    assert summary["rounds_run"] == 5
    # the ServerApp drew the run beside its summary, from these very records
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = series(recs)
    assert drawn.t_e == t_e and drawn.test_acc == [r["test_acc"] for r in recs]
    assert drawn.took_part == {t: [0, 1, 2, 3] for t in range(1, 6)}
    # the machine whose arithmetic made the run (fedefc grid report compares it)
    assert summary["machine"]["torch"] == torch.__version__
    assert summary["machine"]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert summary["machine"]["gpu"] == (torch.cuda.get_device_name(0)
                                         if torch.cuda.is_available() else "none")
    # every client in every round: phase 2 pools each client's counts in its node state
    assert summary["q_pooling"] == "cumulative"
    config = json.loads((out / "config.json").read_text())
    assert config["rho"] == 0.4 and config["out-dir"] == str(out)


def test_same_seed_gives_identical_final_weights_audited_or_not(two_runs):
    (a, b), (sa, sb) = two_runs
    wa = torch.load(a / "model.pt")
    wb = torch.load(b / "model.pt")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa["final_acc"] == sb["final_acc"] and sa["t_e"] == sb["t_e"]
    assert records(a)[-1]["test_loss"] == records(b)[-1]["test_loss"]


def test_secure_aggregation_runs_fedefc_end_to_end_and_hides_each_accuracy(two_runs,
                                                                           secure_run):
    (plain_out, _), _ = two_runs
    out, summary = secure_run
    plain, recs = records(plain_out), records(out)
    assert [r["round"] for r in recs] == list(range(6)) and summary["t_e"] == 2
    assert [r["phase"] for r in recs] == [1, 1, 1, 2, 2, 2]
    # round 1 trains the same clients on the same model: A(1) is their mean accuracy
    assert recs[1]["A"] == pytest.approx(plain[1]["A"], abs=1e-6)
    assert recs[2]["A"] == pytest.approx(0.0, abs=1e-6)  # the acc=0.0 round
    for r in recs[1:]:
        assert r.get("client_acc") is None
        assert r["server_saw"]["sum_only"] == ["weights", "accuracy", "guard-accuracy",
                                               "train-loss", "update-ratio"]
        assert "accuracy" not in r["server_saw"]["per_client"]
    for r, p in zip(recs[:3], plain[:3]):  # the model is FedAvg's up to quantization
        assert r["test_acc"] == pytest.approx(p["test_acc"], abs=0.02)
    assert recs[3]["failures"] == 1 and recs[3]["partition_ids"] == [0, 1, 2]
    assert recs[4]["partition_ids"] == [1, 2, 3] and recs[4]["failures"] == 0
    assert "sample count 3 differs" in recs[4]["rejected_reasons"][0]["reason"]
    assert recs[5]["partition_ids"] == [0, 1, 3] and recs[5]["failures"] == 0
    assert recs[5]["rejected_reasons"][0]["reason"] == (
        "partition id 1 is not its node's registered partition 2")
    sent = audited_keys(out)
    assert not any(key == "accuracy" for _, key in sent)
    assert ("secaggplus_configs", "masked_params") in sent


def audited_keys(out: Path) -> set[tuple[str, str]]:
    """Every (record, key) the clients of a run sent, from their audit logs (an array
    record counts as (record, "arrays"))."""
    sent = set()
    for path in (out / "audit").glob("partition-*.jsonl"):
        for line in path.read_text().splitlines():
            for name, rec in json.loads(line).get("records", {}).items():
                keys = rec["keys"] if rec["kind"] != "arrays" else {"arrays": None}
                sent.update((name, key) for key in keys)
    return sent


def documented_keys() -> set[tuple[str, str]]:
    """The table of docs/PRIVACY.md between the ``fedefc-keys`` markers: what a FedEFC
    client may send (first column the record, second the key)."""
    text = (Path(__file__).parent.parent / "docs" / "PRIVACY.md").read_text()
    table = text.split("<!-- fedefc-keys -->")[1].split("<!-- /fedefc-keys -->")[0]
    return set(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", table, re.M))


def test_a_fedefc_client_sends_only_the_documented_keys(two_runs, secure_run):
    (_, audited), _ = two_runs
    out, _ = secure_run
    documented = documented_keys()
    assert len(documented) > 10
    plain = audited_keys(audited)
    assert ("fitres.metrics", "accuracy") in plain and ("fitres.metrics", "q-cos") in plain
    for sent in (plain, audited_keys(out)):
        assert sent <= documented, sorted(sent - documented)
