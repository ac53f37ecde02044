"""A validation share of verified labels (``validation-labels = "verified"``,
docs/FEDEFC.md §3.7): where the share's labels are checked ones, A(t) and the phase-2
guard read the model's accuracy on true labels, and Q is counted on the noisy samples
the client trains on, never on the checked ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.data_files import DatasetError
from common.data_plan import data_plan
from common.methods import load_run_config
from common.runtime import initial_model
from common.sample_roles import SampleRoles
from common.training import BatchTransform, predict_proba
from common.transition import estimate_transition
from fedefc_cli.main import main
from fedefc_cli.run_configs import toml_value
from fedefc_client.job import LocalJob
from fedefc_client.local_data import node_data, partition_data
from fedefc_client.local_update import fedefc
from fedefc_client.private_data import PrivateDataError

CPU = torch.device("cpu")
NODE = "node 7 (partition-id 1)"


def silo(**keys):
    """5 clients of the embedded data, all of them every round, heavy noise, verified
    labels on a share of at most 5 samples per class."""
    return load_run_config({"num-clients": 5, "fraction": 1.0, "rho": 0.4, "zeta": 0.8,
                            "validation-labels": "verified", "validation-max-per-class": 5,
                            **keys})


def test_a_partitions_share_carries_its_true_labels_and_nothing_else_changes():
    """The share is the seeded one of observed labels (same positions); on it the labels
    are the true ones, and every other sample keeps its observed (noisy) label."""
    cfg = silo()
    observed = partition_data(load_run_config({**cfg.to_flat(),
                                               "validation-labels": "observed"}), 2, CPU)
    local = partition_data(cfg, 2, CPU)
    plan = data_plan(cfg)
    idx = plan.client_indices[2]
    val = local.validation
    assert len(val) == 50
    np.testing.assert_array_equal(val, observed.validation)
    np.testing.assert_array_equal(val, SampleRoles.build(cfg, 2, len(idx), 10).share)
    np.testing.assert_array_equal(local.labels[val], plan.true_labels[idx][val])
    assert np.any(observed.labels[val] != plan.true_labels[idx][val])  # there was noise
    rest = np.setdiff1d(np.arange(len(idx)), val)
    np.testing.assert_array_equal(local.labels[rest], plan.noisy_labels[idx][rest])
    np.testing.assert_array_equal(local.y.numpy(), local.labels)


def test_phase_2_counts_q_on_the_samples_trained_on_not_on_the_verified_share():
    """Q from the received model's predictions on every sample but the share (the
    samples with observed labels), and training leaves the share out."""
    cfg = silo(**{"local-epochs": 1, "q-pooling": "none", "q-estimator": "counted"})
    local = partition_data(cfg, 1, CPU)
    model = initial_model(cfg, local.data.task)
    probs = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU))
    job = LocalJob(cfg, local, model, 2, 3, 3)
    rest = np.setdiff1d(np.arange(len(local)), local.validation)
    np.testing.assert_array_equal(job.estimation_positions(), rest)
    trained = job.training_set()
    fedefc(job)
    np.testing.assert_allclose(job.last_q, estimate_transition(probs[rest], local.labels[rest]))
    assert torch.equal(trained.x, local.x[torch.as_tensor(rest)])


def test_an_estimation_share_counts_q_where_the_model_did_not_train():
    """``estimation-share = 0.3``: a seeded 30 % of the samples outside the verified
    share, disjoint from it; Q is counted on the received model's predictions there
    (against ``estimate_transition`` recomputed), and training leaves out both shares,
    in phase 1 as in phase 2. The verified share and its labels are those without it."""
    cfg = silo(**{"local-epochs": 1, "q-pooling": "none", "q-estimator": "counted",
                  "estimation-share": 0.3})
    local = partition_data(cfg, 1, CPU)
    plain = partition_data(silo(), 1, CPU)
    np.testing.assert_array_equal(local.validation, plain.validation)
    np.testing.assert_array_equal(local.labels, plain.labels)
    est = local.estimation
    rest = np.setdiff1d(np.arange(len(local)), local.validation)
    assert len(est) == round(0.3 * len(rest)) and np.all(np.isin(est, rest))
    assert not np.array_equal(est, partition_data(cfg, 2, CPU).estimation[:len(est)])
    trained_on = np.setdiff1d(rest, est)
    model = initial_model(cfg, local.data.task)
    probs = predict_proba(model, local.x, BatchTransform.of(local.spec, CPU))
    for phase in (1, 2):
        job = LocalJob(cfg, local, model, phase, 3, 3)
        assert torch.equal(job.training_set().x, local.x[torch.as_tensor(trained_on)])
    np.testing.assert_array_equal(job.estimation_positions(), est)
    fedefc(job)
    np.testing.assert_allclose(job.last_q, estimate_transition(probs[est], local.labels[est]))


def test_a_nodes_estimation_share_is_drawn_outside_its_verified_samples(tmp_path):
    verified = np.zeros(60, dtype=bool)
    verified[::7] = True
    path = write_node(tmp_path, verified)
    cfg = load_run_config({**NODE_RUN, "estimation-share": 0.5})
    local = node_data(cfg, 1, {"data-path": str(path)}, NODE, CPU)
    rest = np.setdiff1d(np.arange(len(local)), local.validation)
    assert len(local.estimation) == round(0.5 * len(rest))
    assert not np.isin(local.estimation, local.validation).any()


def test_an_estimation_share_without_verified_labels_is_refused():
    with pytest.raises(ValueError, match="estimation-share=0.4 with validation-labels="
                                         "'observed'") as err:
        silo(**{"validation-labels": "observed", "estimation-share": 0.4})
    assert "set estimation-share=0" in str(err.value)


def test_the_verified_accuracy_scores_the_models_own_prediction_not_q_p():
    """A phase-2 client's A_k, from predictions set by hand (right on the share's labels
    but for 10 samples): through the Q it trained with where labels are observed (a Q
    that maps each class j to j + 1 turns every right prediction wrong), the model's own
    argmax where they are verified."""
    for labels, expected in (("observed", 10 / 50), ("verified", 40 / 50)):
        cfg = silo(**{"validation-labels": labels})
        local = partition_data(cfg, 0, CPU)
        job = LocalJob(cfg, local, initial_model(cfg, local.data.task), 2, 3, 3)
        predicted = local.labels.copy()
        wrong = local.validation[:10]
        predicted[wrong] = (predicted[wrong] + 9) % 10  # off by one the other way
        job._probs = np.eye(10)[predicted]
        job.prior_q = np.roll(np.eye(10), 1, axis=0)  # Q[(j + 1) % K, j] = 1
        assert job.validation_accuracy() == pytest.approx(expected)


def write_node(tmp_path, verified=None, n=60):
    rng = np.random.default_rng(3)
    arrays = {"features": rng.normal(size=(n, 4)), "labels": np.arange(n) % 3}
    if verified is not None:
        arrays["verified"] = verified
    path = tmp_path / "node.npz"
    np.savez(path, **arrays)
    return path


NODE_RUN = {"dataset": "npz", "num-classes": 3, "input-shape": "4", "num-clients": 3,
            "fraction": 1.0, "validation-labels": "verified", "evaluation": "federated"}


def test_a_nodes_share_is_the_samples_its_file_marks_verified(tmp_path):
    """Own data: the share is exactly the marked samples among those the node trains on
    (the federated-evaluation hold-out takes its seeded part first), whatever
    validation-fraction says; the same from the node's disk cache."""
    verified = np.zeros(60, dtype=bool)
    verified[::7] = True
    path = write_node(tmp_path, verified)
    cfg = load_run_config(NODE_RUN)
    node = {"data-path": str(path), "cache-dir": str(tmp_path / "cache")}
    built, local = (node_data(cfg, 1, node, NODE, CPU) for _ in range(2))  # then cached
    np.testing.assert_array_equal(built.validation, local.validation)
    x = np.load(path)["features"].astype(np.float32)
    marked = {x[i].tobytes() for i in np.flatnonzero(verified)}
    trained = local.x.numpy()
    share = {trained[i].tobytes() for i in local.validation}
    assert share == marked - {row.tobytes() for row in local.held_out.x.numpy()}
    assert len(share) >= 5
    assert {trained[i].tobytes() for i in range(len(local))} - share  # some left to train


@pytest.mark.parametrize("verified, problem", [
    (None, "names no verified sample"),
    (np.zeros(60, dtype=bool), "names no verified sample"),
    (np.ones(60, dtype=bool), "none is left to train on"),
])
def test_a_node_without_a_usable_verified_mask_is_told_how_to_mark_one(tmp_path, verified,
                                                                          problem):
    path = write_node(tmp_path, verified)
    with pytest.raises(PrivateDataError) as err:
        node_data(load_run_config(NODE_RUN), 1, {"data-path": str(path)}, NODE, CPU)
    assert NODE in str(err.value) and str(path) in str(err.value) and problem in str(err.value)
    assert "Verified labels" in str(err.value)


@pytest.mark.parametrize("verified", [np.ones(60, dtype=np.int64), np.ones(59, dtype=bool)])
def test_a_malformed_verified_mask_names_the_array_and_its_shape(tmp_path, verified):
    path = write_node(tmp_path, verified)
    with pytest.raises(DatasetError, match=r"'verified' has shape .* store a boolean array "
                                           r"of 60 entries"):
        node_data(load_run_config(NODE_RUN), 1, {"data-path": str(path)}, NODE, CPU)


@pytest.mark.parametrize("keys, fix", [
    ({"accuracy-signal": "global"}, 'set accuracy-signal="held-out"'),
    ({"fraction": 0.4}, 'set accuracy-signal="held-out"'),  # auto: the paper's signal
    ({"validation-phase-2": "train"}, 'set validation-phase-2="estimate"'),
])
def test_verified_labels_need_a_share_kept_out_of_training(keys, fix):
    with pytest.raises(ValueError, match="validation-labels=\"verified\"") as err:
        silo(**keys)
    assert fix in str(err.value)


@pytest.mark.parametrize("evaluation", ["server", "both"])
def test_an_exported_partition_gives_its_node_the_simulations_verified_share(tmp_path,
                                                                             evaluation):
    """``fedefc deploy export`` with verified labels: each node's file holds the
    simulation's share with its true labels, marked verified, so the node (own data,
    ``data-path``) trains on, holds out, counts Q on and is scored on exactly what the
    simulated client is, with or without a federated-evaluation hold-out taken first."""
    keys = {"num-clients": 5, "fraction": 1.0, "rho": 0.4, "zeta": 0.8,
            "validation-labels": "verified", "validation-max-per-class": 5,
            "estimation-share": 0.4, "evaluation": evaluation}
    assert main(["deploy", "export", str(tmp_path / "out"),
                 *(f"--set={k}={toml_value(v)}" for k, v in keys.items())]) == 0
    cfg = load_run_config(keys)
    for pid in (0, 3):
        sim = partition_data(cfg, pid, CPU)
        path = tmp_path / "out" / f"node-{pid}" / "data.npz"
        assert np.load(path)["verified"].sum() == len(sim.validation) == 50
        node = node_data(cfg, pid, {"data-path": str(path)}, NODE, CPU)
        np.testing.assert_array_equal(node.validation, sim.validation)
        assert len(sim.estimation) == round(0.4 * (len(sim) - 50))
        np.testing.assert_array_equal(node.estimation, sim.estimation)
        np.testing.assert_array_equal(node.labels, sim.labels)
        assert torch.equal(node.x, sim.x)


def test_an_export_as_image_folders_cannot_mark_verified_samples(tmp_path, capsys):
    code = main(["deploy", "export", str(tmp_path / "out"), "--images",
                 "--set=validation-labels=\"verified\"", "--set=num-clients=5",
                 "--set=fraction=1.0"])
    assert code == 2
    assert "--images: an image folder cannot mark verified samples" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


def own_file(tmp_path, marked: bool):
    """A table of 240 samples (K = 3) with a test file; every 8th sample marked checked
    in a ``verified`` array when ``marked``."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(240, 5)).astype(np.float32), rng.integers(0, 3, 240)
    extra = {"verified": np.arange(240) % 8 == 0} if marked else {}
    np.savez(tmp_path / "train.npz", features=x, labels=y, **extra)
    np.savez(tmp_path / "test.npz", features=x[:30], labels=y[:30])
    return {"dataset": "npz", "data-path": str(tmp_path / "train.npz"),
            "test-path": str(tmp_path / "test.npz"), "num-clients": 3, "fraction": 1.0,
            "iid": True, "validation-labels": "verified"}


@pytest.mark.parametrize("rho", [0.0, 0.3])
def test_a_simulation_of_a_file_that_marks_its_checked_samples_reads_them(tmp_path, rho):
    """The steward's work reaches a simulation (docs/FEDEFC.md §3.7): each client's share
    is exactly its samples the file marks verified, with the file's (checked) labels,
    whatever synthetic noise the rest gets."""
    cfg = load_run_config({**own_file(tmp_path, marked=True), "rho": rho, "zeta": 0.0})
    fed = data_plan(cfg)
    mask = np.load(tmp_path / "train.npz")["verified"]
    for pid in range(3):
        local = partition_data(cfg, pid, CPU)
        idx = fed.client_indices[pid]
        np.testing.assert_array_equal(local.validation, np.flatnonzero(mask[idx]))
        np.testing.assert_array_equal(local.labels[local.validation],
                                      fed.true_labels[idx][mask[idx]])


def test_verified_labels_on_a_file_of_observed_labels_without_a_mask_are_refused(tmp_path):
    """rho = 0 takes the file's labels as observed: without a ``verified`` array nothing
    says which are checked, and the run is refused rather than treat observed labels as
    checked ones; with synthetic noise the file's labels are the truth, and a simulated
    check of the seeded share stands."""
    keys = own_file(tmp_path, marked=False)
    with pytest.raises(DatasetError, match="its observed labels would be treated as verified"):
        data_plan(load_run_config({**keys, "rho": 0.0}))
    assert partition_data(load_run_config({**keys, "rho": 0.3, "zeta": 0.0}), 0,
                          CPU).validation is not None
