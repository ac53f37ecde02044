"""The baselines' distinctive steps against hand computations and direct library calls."""

import numpy as np
import pytest
import torch
from cleanlab.filter import find_label_issues
from flwr.app import RecordDict

from common.baselines.confident_learning import label_issue_mask
from common.baselines.forward_correction import patrini_transition
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from common.training import BatchTransform, predict_proba
from fedefc_client.baselines.fedprox import proximal_term
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data


def test_proximal_term_value_and_gradient():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    anchor = [torch.tensor([[0.0, 1.0]]), torch.tensor([1.5])]
    term = 1e-2 / 2 * 2 * proximal_term(model, anchor)  # mu/2 ||w - w_g||^2 with mu = 1e-2
    assert float(term.detach()) == pytest.approx(1e-2 / 2 * (1 + 1 + 1))
    term.backward()
    np.testing.assert_allclose(model.weight.grad.numpy(), 1e-2 * np.array([[1.0, 1.0]]))
    np.testing.assert_allclose(model.bias.grad.numpy(), 1e-2 * np.array([-1.0]))


def test_patrini_rows_on_a_constructed_prediction_matrix():
    # 100 samples; for class 0 the top 3% (>= 97th percentile) are rows 0-2.
    probs = np.full((100, 2), 0.5)
    probs[:3] = [[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]]
    probs[3:6] = [[0.2, 0.8], [0.1, 0.9], [0.3, 0.7]]
    t = patrini_transition(probs, 97.0)
    # 97th percentile of P[:,0] (linear interpolation) is 0.5 + 0.03*... -> rows with P0 >= cut
    cut0 = np.percentile(probs[:, 0], 97)
    cut1 = np.percentile(probs[:, 1], 97)
    np.testing.assert_allclose(t[0], probs[probs[:, 0] >= cut0].mean(0))
    np.testing.assert_allclose(t[1], probs[probs[:, 1] >= cut1].mean(0))
    np.testing.assert_allclose(t[0], [0.8, 0.2])
    np.testing.assert_allclose(t[1], [0.2, 0.8])
    np.testing.assert_allclose(t.sum(1), 1.0)


def test_patrini_rows_with_tied_top_predictions_are_finite():
    # 0.1 * 0.7 + 0.1 * 0.3 == 0.10000000000000002: the interpolated percentile can exceed
    # every (tied) value, which once left the selection empty and the row NaN.
    probs = np.full((50, 10), 0.1)
    t = patrini_transition(probs, 97.0)
    assert np.isfinite(t).all()
    np.testing.assert_allclose(t, np.full((10, 10), 0.1))


def test_confident_learning_mask_equals_direct_cleanlab_call():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 400)
    logits = rng.normal(size=(400, 5)) + 3 * np.eye(5)[labels] * (rng.random(400) < 0.8)[:, None]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    # n_jobs=1 as the product calls it: cleanlab's default forks a process pool, and a
    # forked child of this multi-threaded test process once hung on a lock in the suite
    expected = find_label_issues(labels, probs, filter_by="both", n_jobs=1)
    np.testing.assert_array_equal(label_issue_mask(labels, probs), expected)
    assert 0 < expected.sum() < 400


@pytest.mark.parametrize("labels", [[3] * 40, [3], []], ids=["one class", "one sample", "none"])
def test_confident_learning_keeps_every_sample_of_a_single_class_client(labels):
    labels = np.array(labels, dtype=np.int64)
    probs = np.random.default_rng(1).dirichlet(np.ones(5), len(labels))
    if len(labels):
        with pytest.raises(ValueError, match="at least 2 classes"):  # what cleanlab does
            find_label_issues(labels, probs, filter_by="both", n_jobs=1)
    mask = label_issue_mask(labels, probs)
    assert mask.dtype == bool and mask.shape == (len(labels),) and not mask.any()


def _client(method, state, **extra):
    cfg = load_run_config({"method": method, "num-clients": 20, "fraction": 0.5, "iid": True,
                           "local-epochs": 1, "start-round": 0, "gamma-thr": 1, **extra})
    local = partition_data(cfg, 1, torch.device("cpu"))
    return cfg, MethodClient(cfg, 1, lambda: local, state)


def test_ditto_personal_model_persists_in_client_state():
    state = RecordDict()
    cfg, client = _client("fedditto", state)
    model = initial_model(cfg, client.local.data.task)  # not the process cache: pure
    weights = get_weights(model)
    _, _, m1 = client.fit(weights, {"phase": 1, "round": 1, "seed": 1})
    v1 = {k: t.clone() for k, t in state["ditto-personal"].to_torch_state_dict().items()}
    _, _, m2 = client.fit(weights, {"phase": 1, "round": 2, "seed": 2})
    v2 = state["ditto-personal"].to_torch_state_dict()
    assert (m1["personal-updates"], m2["personal-updates"]) == (1, 2)
    # round 2 started from v1, not from the global weights: re-run round 2 from a fresh
    # state and compare.
    fresh = RecordDict()
    _, other = _client("fedditto", fresh)
    other.fit(weights, {"phase": 1, "round": 2, "seed": 2})
    v2_fresh = fresh["ditto-personal"].to_torch_state_dict()
    assert any(not torch.equal(v2[k], v2_fresh[k]) for k in v2)
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)
    assert 0.0 <= m2["personal-acc"] <= 1.0


def test_confident_learning_reports_the_kept_count():
    cfg, client = _client("confident-learning", RecordDict(), rho=0.4, zeta=0.4)
    model = initial_model(cfg, client.local.data.task)  # not the process cache: pure
    _, n, metrics = client.fit(get_weights(model), {"phase": 2, "round": 3, "seed": 3})
    share = client.local.validation  # held out of training (docs/FEDEFC.md §3.1), if any
    trainable = len(client.local) - (0 if share is None else len(share))
    assert n == metrics["kept"] and metrics["kept"] + metrics["removed"] == trainable


@pytest.mark.parametrize("method,phase,loss", [
    ("fedefc", 1, "cross-entropy"), ("fedefc", 2, "forward-corrected"),
    ("forward-correction", 2, "forward-corrected"), ("fedprox", None, "cross-entropy+prox"),
    ("fedavg", None, "cross-entropy")])
def test_each_method_uses_its_loss(method, phase, loss):
    """A client reports its accuracy only when the server's config says phase 1 (FedEFC's
    strategy); methods without phases get no phase key and send no accuracy."""
    cfg, client = _client(method, RecordDict())
    model = initial_model(cfg, client.local.data.task)  # not the process cache: pure
    config = {"round": 1, "seed": 1, **({} if phase is None else {"phase": phase})}
    _, _, metrics = client.fit(get_weights(model), config)
    assert metrics["loss"] == loss
    assert ("accuracy" in metrics) == (phase == 1)


@pytest.mark.parametrize("diagnostics", [False, True])
def test_fedefc_phase2_reply_carries_nothing_about_q(diagnostics):
    """Nothing about labels or matrices leaves a client (docs/FEDEFC.md §4.6): without the
    simulator's diagnostics the phase-2 reply holds the loss name, the partition id, the
    mean training loss and the timing; with them, Q's agreement with the true matrix and
    the true noise rate are added, all scalars."""
    cfg, client = _client("fedefc", RecordDict(), diagnostics=diagnostics, rho=0.4, zeta=0.4)
    model = initial_model(cfg, client.local.data.task)  # not the process cache: pure
    _, _, metrics = client.fit(get_weights(model), {"phase": 2, "round": 3, "seed": 3})
    expected = {"partition-id", "loss", "train-loss", "fit-s"}
    if diagnostics:
        expected |= {"q-cos", "q-l1", "noise-rate"}
    assert set(metrics) == expected
    assert all(isinstance(v, (int, float, str)) for v in metrics.values())


def test_accuracy_signal_global_is_the_received_models_accuracy_on_local_labels():
    """accuracy-signal (docs/FEDEFC.md §3.1): 'global' reports the received global
    model's accuracy on the client's observed labels, computed here independently;
    'local-train' reports the training accuracy of the local epochs, which differs."""
    reported = {}
    for signal in ("global", "local-train"):
        cfg, client = _client("fedefc", RecordDict(), **{"accuracy-signal": signal,
                                                          "local-epochs": 3})
        model = initial_model(cfg, client.local.data.task)
        _, _, metrics = client.fit(get_weights(model), {"phase": 1, "round": 1, "seed": 1})
        reported[signal] = metrics["accuracy"]
    local = client.local
    probs = predict_proba(model, local.x, BatchTransform(local.spec.mean, local.spec.std,
                                                         torch.device("cpu")))
    expected = float(np.mean(np.asarray(probs).argmax(1) == np.asarray(local.labels)))
    assert reported["global"] == pytest.approx(expected, abs=1e-12)
    assert reported["local-train"] > reported["global"] + 0.05  # it has trained 3 epochs
