"""Own data through real Flower simulations (docs/OWN-DATA.md): ``fedefc run`` on feature
vectors with K = 3, a test set, the built-in MLP and the coordinator's clean validation
set for the phase-2 guard (docs/FEDEFC.md §3.9); and a run with no test set, whose
server loads no data and whose summary reports the federated evaluation. The two runs
are tiny and overlap (their processes mostly wait on Flower's polling)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from common.data_plan import data_plan
from common.methods import load_run_config
from fedefc_cli.main import main
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job
from tests.helpers import records

pytestmark = pytest.mark.flower

TINY = {"num-clients": 3, "fraction": 1.0, "rounds": 3, "local-epochs": 1, "batch-size": 8,
        "iid": "true", "start-round": 1, "gamma-thr": 1, "rho": 0.2, "client-threads": 1,
        "accuracy-signal": '"global"'}


def write_features(path: Path, n: int, d: int, k: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % k
    np.savez(path, features=rng.normal(size=(n, d)) + 2.0 * np.eye(k, d)[labels],
             labels=labels)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("own-data-runs")
    train = write_features(base / "train.npz", 60, 6, 3, seed=0)
    test = write_features(base / "test.npz", 30, 6, 3, seed=1)
    binary = write_features(base / "binary.npz", 48, 4, 2, seed=2)
    with np.load(test) as held:  # the test set less its last sample, each value moved
        clean = base / "clean.npz"  # 1e-4: other samples (the server refuses a clean set
        np.savez(clean, features=held["features"][:29] + 1e-4,  # sharing the test set's),
                 labels=held["labels"][:29])  # read as the test set's (a margin this small)
    federated = resolve_run_config(None, [f"{k}={v}" for k, v in {
        **TINY, "dataset": '"npz"', "data-path": f'"{binary}"', "zeta": 0.0}.items()],
        str(base / "federated"))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_simulation_job, federated, log_path=base / "federated.log")
        # `fedefc run` in this (the main) thread: it installs signal handlers
        code = main(["run", "--set", "dataset=npz", "--set", f"data-path={train}", "--set",
                     f"test-path={test}", "--set", "model=mlp", "--set", "zeta=0.5",
                     *[f"--set={k}={v}" for k, v in TINY.items()],
                     "--set", "accuracy-signal=held-out", "--set",
                     f"clean-validation-path={clean}", "--out-dir", str(base / "features")])
        pending.result()
    return {"code": code, "features": base / "features", "federated": base / "federated",
            "federated_config": federated}


def test_fedefc_run_on_k3_feature_vectors_with_a_test_set_and_the_mlp(runs):
    assert runs["code"] == 0
    out = runs["features"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_source"] == "server test set" and summary["evaluation"] == "server"
    assert (summary["num_classes"], summary["input_shape"]) == (3, [6])
    recs = records(out)
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    assert summary["final_acc"] == recs[-1]["test_acc"] and "federated_acc" not in recs[-1]
    assert recs[1]["num_examples"] and sum(recs[1]["num_examples"]) == 60  # nothing held out
    model = torch.load(out / "model.pt")
    assert model["body.1.weight"].shape == (128, 6) and model["classifier.weight"].shape == (3, 64)
    config = json.loads((out / "config.json").read_text())
    assert (config["dataset"], config["model"], config["num-classes"]) == ("npz", "mlp", 0)


def test_the_guard_reads_the_coordinators_clean_set_the_model_each_round_received(runs):
    """The clean file is the test set's first 29 samples, each value moved 1e-4 (less
    than any of their margins: the run is a pure function of its seed, so a margin this
    small would fail here every time, not now and then): round t's clean-set accuracy
    reads the model round t - 1 made, whose test accuracy on the 30 counts the same
    correct samples, and the last one or not."""
    out = runs["features"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase_2_guard"] == "on" and summary["twin_model"] == "on"
    assert summary["guard_signal"].startswith(
        "the coordinator's clean validation set (29 samples, checked samples of /")
    recs = records(out)
    for before, now in zip(recs, recs[1:]):
        right_of_29, right_of_30 = round(29 * now["guard_acc"]), round(30 * before["test_acc"])
        assert right_of_30 - right_of_29 in (0, 1)
        assert now["guard_acc"] == pytest.approx(right_of_29 / 29)


def test_a_run_without_test_set_reports_the_federated_accuracy(runs):
    out = runs["federated"]
    cfg = load_run_config(runs["federated_config"])
    sizes = [len(ix) for ix in data_plan(cfg).client_indices]
    held_out = [round(0.2 * n) for n in sizes]
    recs = records(out)
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    for r in recs:  # every round, the initial model included, evaluated by every client
        assert "test_acc" not in r
        assert r["federated_clients"] == 3 and r["federated_samples"] == sum(held_out)
        assert 0.0 <= r["federated_acc"] <= 1.0 and 0.0 <= r["federated_true_acc"] <= 1.0
    for r in recs[1:]:  # the clients train on the rest
        assert r["num_examples"] == [n - h for n, h in zip(sizes, held_out)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_source"] == "federated held-out data"
    assert summary["final_acc"] == summary["federated_final_acc"] == recs[-1]["federated_acc"]
    assert summary["federated_true_final_acc"] == recs[-1]["federated_true_acc"]
    # its facts are the shape and K only (in a simulation the server reads the data plan
    # only to check the nodes' declarations: docs/THREAT-MODEL.md)
    assert json.loads((out / "data.json").read_text()) == {
        "evaluation": "federated", "input_shape": [4], "num_classes": 2}
    assert torch.load(out / "model.pt")["classifier.weight"].shape == (2, 64)
