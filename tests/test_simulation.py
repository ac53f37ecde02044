"""A real Flower simulation (flwr run + simulation SuperLink + Ray), end to end.

The job uses a learning rate of 1e-7 so that the global model's accuracy on the clients'
data, A(t), is the same in rounds 1 and 2: with start-round 0 and gamma_thr 1 the tie
makes round 2 the prestopping point by construction, and rounds 3-5 must run phase 2.
(Learning itself is tested in test_training.py and measured by the benchmarks.)
"""

import json

import pytest
import torch

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job
from tests.helpers import records

pytestmark = pytest.mark.flower  # one real simulation, shared by the tests


def job(data_dir, out_dir, **extra):
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist"', "data-dir": f'"{data_dir}"', "model": '"lenet"',
        "num-clients": 4, "fraction": 1.0, "rounds": 5, "local-epochs": 2, "batch-size": 8,
        "lr": 1e-7, "start-round": 0, "gamma-thr": 1, "rho": 0.4, "zeta": 0.4, "iid": "true",
        **extra,
    }.items()]
    return resolve_run_config(None, overrides, str(out_dir))


@pytest.fixture(scope="module")
def two_runs(micro_mnist_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("sim")
    outs = [base / "a", base / "b"]
    summaries = [run_simulation_job(job(micro_mnist_dir, out)) for out in outs]
    return outs, summaries


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
    config = json.loads((out / "config.json").read_text())
    assert config["rho"] == 0.4 and config["out-dir"] == str(out)


def test_same_seed_gives_identical_final_weights(two_runs):
    (a, b), (sa, sb) = two_runs
    wa = torch.load(a / "model.pt")
    wb = torch.load(b / "model.pt")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa["final_acc"] == sb["final_acc"] and sa["t_e"] == sb["t_e"]
    assert records(a)[-1]["test_loss"] == records(b)[-1]["test_loss"]
