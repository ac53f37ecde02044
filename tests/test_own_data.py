"""Own data and own models (docs/OWN-DATA.md), in process: data of any shape and any K,
models by import path, every malformed input, federated evaluation and a server that
holds no data. The Flower runs are in test_own_data_runs.py."""

from __future__ import annotations

import json
import math
import re
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from flwr.common import Code, Context, EvaluateRes, Status

from common.baselines.fedcorr import FedCorrMessages
from common.baselines.fednoro import FedNoRoMessages
from common.config import ConfigError
from common.data_files import DatasetError, read_header
from common.data_plan import data_plan
from common.datasets import fit_normalization, load_dataset, task_shape
from common.exchange import unpack_array
from common.methods import load_run_config
from common.models import ClassifierShape, ModelError, TaskShape, classifier_shape
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from common.sample_roles import SampleRoles
from common.training import BatchTransform, predict_logits
from fedefc_cli.main import main
from fedefc_client.client import MethodClient
from fedefc_client.client_app import app as client_app
from fedefc_client.local_data import node_data, partition_data
from fedefc_client.private_data import PrivateDataError, load_private_data
from fedefc_server import server_app
from fedefc_server.strategy import RoundStrategy
from tests.helpers import PARAMS, InProcessGrid, make_driver, partition_manager

CPU = torch.device("cpu")
NODE = "node 9 (partition-id 2)"


def features(n: int, d: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n float64 feature vectors, every class present, class-dependent means."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    x = rng.normal(size=(n, d)) + 3.0 * np.eye(k, d)[y] + 10.0
    return x, y


def images(n: int, shape: tuple[int, ...], k: int, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray]:
    """n uint8 images of ``shape`` (as stored), every class present."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), np.arange(n) % k


def npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def own(path: str, **keys):
    return load_run_config({"dataset": "npz", "data-path": path, **keys})


# -- data of any shape and any K ------------------------------------------------------------
def test_feature_vectors_get_k_from_the_labels_and_normalization_from_the_training_data(
        tmp_path):
    x, y = features(60, 5, 3)
    tx, ty = features(30, 5, 3, seed=1)
    cfg = own(npz(tmp_path / "train.npz", features=x, labels=y),
              **{"test-path": npz(tmp_path / "test.npz", features=tx, labels=ty)})
    data = load_dataset(cfg)
    assert data.train_x.dtype == torch.float32 and data.train_x.shape == (60, 5)
    np.testing.assert_array_equal(data.train_x.numpy(), x.astype(np.float32))
    np.testing.assert_array_equal(data.test_y.numpy(), ty)
    assert data.num_classes == 3 and data.spec.input_shape == (5,) and not data.spec.augment
    np.testing.assert_allclose(data.spec.mean, x.mean(axis=0))  # the TRAINING data's
    np.testing.assert_allclose(data.spec.std, x.std(axis=0))
    out = BatchTransform.of(data.spec, CPU)(data.test_x).numpy()
    np.testing.assert_allclose(out, (tx - x.mean(0)) / x.std(0), rtol=1e-5, atol=1e-5)
    assert cfg.evaluation_mode == "server" and not cfg.federated_evaluation
    assert initial_model(cfg, data.task)(torch.zeros(4, 5)).shape == (4, 3)  # auto: mlp


@pytest.mark.parametrize("stored,to_nchw", [
    ((12, 20), lambda a: a[:, None]),
    ((3, 12, 20), lambda a: a),
    ((12, 20, 3), lambda a: a.transpose(0, 3, 1, 2)),
    ((24, 24, 3), lambda a: a.transpose(0, 3, 1, 2)),
    ((9, 7), lambda a: a[:, None]),
    ((5, 9, 7), lambda a: a),
], ids=["gray-NHW-12x20", "rgb-NCHW-12x20", "rgb-NHWC-12x20", "rgb-NHWC-24x24", "gray-9x7",
        "5-channel-NCHW"])
def test_images_of_any_size_and_layout_become_uint8_nchw(tmp_path, stored, to_nchw):
    x, y = images(40, stored, 4)
    cfg = own(npz(tmp_path / "d.npz", images=x, labels=y), rho=0.0)
    data = load_dataset(cfg)
    expected = to_nchw(x)
    assert data.train_x.dtype == torch.uint8 and data.spec.input_shape == expected.shape[1:]
    np.testing.assert_array_equal(data.train_x.numpy(), expected)
    per_channel = expected.transpose(1, 0, 2, 3).reshape(expected.shape[1], -1) / 255.0
    np.testing.assert_allclose(data.spec.mean, per_channel.mean(1))
    np.testing.assert_allclose(data.spec.std, per_channel.std(1))
    model = initial_model(cfg, data.task)  # auto: the small CNN, any size
    assert model(torch.zeros(2, *data.spec.input_shape)).shape == (2, 4)
    assert read_header(cfg.data_path, "h") == (data.spec.input_shape, 4)


def test_an_rgb_image_folder_of_non_square_24x16_images(tmp_path):
    from PIL import Image  # only this test writes image files

    root = tmp_path / "folder"
    written = {}
    for cls in (0, 2, 5):  # K = 6: classes 1, 3, 4 have no image
        (root / str(cls)).mkdir(parents=True)
        for i in range(2):
            pixels = images(1, (16, 24, 3), 1, seed=10 * cls + i)[0][0]
            Image.fromarray(pixels).save(root / str(cls) / f"{i}.png")
            written[(cls, i)] = pixels
    cfg = load_run_config({"dataset": "imagefolder", "data-path": str(root), "rho": 0.0,
                           "num-clients": 2, "iid": True})
    data = load_dataset(cfg)
    assert data.spec.input_shape == (3, 16, 24) and data.num_classes == 6
    assert data.train_y.tolist() == [0, 0, 2, 2, 5, 5]
    np.testing.assert_array_equal(data.train_x[2].numpy(), written[(2, 0)].transpose(2, 0, 1))
    assert task_shape(cfg) == TaskShape((3, 16, 24), 6)  # from the folder, no decoding


CASES = {  # K -> (stored sample shape, kind, extra keys)
    2: ((6,), "features", {"zeta": 0.0}),
    3: ((12, 20, 3), "images", {"zeta": 0.5}),
    37: ((9,), "features", {}),
}


@pytest.mark.parametrize("k", sorted(CASES))
def test_k_classes_through_noise_partition_training_and_federated_evaluation(tmp_path, k):
    """K = 2, 3 and 37: the synthetic noise is K x K, the partition covers every sample,
    a client trains phase 1 and phase 2 and evaluates on its held-out samples; the
    evaluation's accuracy is recomputed here from the model's logits."""
    shape, kind, keys = CASES[k]
    x, y = (features(12 * k, shape[0], k) if kind == "features"
            else images(12 * k, shape, k))
    cfg = own(npz(tmp_path / "d.npz", **{kind: x, "labels": y}),
              **{"num-clients": 3, "iid": True, "local-epochs": 1, "rho": 0.2,
                 "start-round": 0, "gamma-thr": 1, **keys})
    assert cfg.evaluation_mode == "federated"  # no test-path
    fed = data_plan(cfg)
    assert fed.noise_matrices[0].shape == (k, k) and 0 < fed.realized_noise_rate < 0.5
    assert sorted(np.concatenate(fed.client_indices).tolist()) == list(range(12 * k))
    local = partition_data(cfg, 1, CPU)
    n = len(fed.client_indices[1])
    assert len(local.held_out) == round(0.2 * n) and len(local) + len(local.held_out) == n
    client = MethodClient(cfg, 1, lambda: local, RecordDict())
    model = initial_model(cfg, local.data.task)
    weights = get_weights(model)
    out1, n1, m1 = client.fit(weights, {"phase": 1, "round": 1, "seed": 1})
    out2, _, m2 = client.fit(out1, {"phase": 2, "round": 2, "seed": 2})
    assert n1 == len(local) and m2["loss"] == "forward-corrected" and 0 < m2["q-cos"] <= 1
    assert [a.shape for a in out2] == [w.shape for w in weights]
    loss, count, metrics = client.evaluate(out2, {"round": 2})
    assert count == len(local.held_out) and set(metrics) == {"partition-id", "accuracy",
                                                             "true-accuracy"}
    model.load_state_dict(dict(zip(model.state_dict(), map(torch.as_tensor, out2))))
    logits = predict_logits(model, local.held_out.x, BatchTransform.of(local.spec, CPU))
    pred = logits.argmax(1)
    assert metrics["accuracy"] == pytest.approx(float((pred == local.held_out.y).float().mean()))
    assert metrics["true-accuracy"] == pytest.approx(
        float((pred == local.held_out.true_y).float().mean()))
    expected_loss = torch.nn.functional.cross_entropy(logits, local.held_out.y).item()
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_held_out_samples_are_a_seeded_fraction_disjoint_from_training():
    cfg = load_run_config({"evaluation": "both", "local-test-fraction": 0.3})
    roles = SampleRoles.build(cfg, 4, 50, 10)
    train, held = roles.train, roles.held_out
    assert len(held) == 15 and sorted(np.concatenate([train, held]).tolist()) == list(range(50))
    assert np.array_equal(held, SampleRoles.build(cfg, 4, 50, 10).held_out)
    assert not np.array_equal(held, SampleRoles.build(cfg, 5, 50, 10).held_out)  # per partition
    assert SampleRoles.build(cfg, 4, 1, 10).held_out.size == 0  # a single sample is trained on
    assert SampleRoles.build(load_run_config({}), 4, 50, 10).held_out is None  # server only


def test_private_node_features_normalize_with_their_own_training_part(tmp_path):
    """A node holding its own file: checked against the run's shape and K, split, and
    normalized with its training part's statistics (the run config gives none)."""
    x, y = features(40, 4, 3, seed=3)
    path = npz(tmp_path / "node.npz", features=x, labels=y)
    cfg = load_run_config({"dataset": "npz", "evaluation": "federated", "num-classes": 3,
                           "input-shape": "4", "num-clients": 3})
    local = node_data(cfg, 2, {"data-path": path, "cache-dir": str(tmp_path / "c")}, NODE, CPU)
    roles = SampleRoles.build(cfg, 2, 40, 3)
    train, held = roles.train, roles.held_out
    np.testing.assert_array_equal(local.labels, y[train])
    np.testing.assert_allclose(local.spec.mean, x[train].mean(0))
    np.testing.assert_allclose(local.spec.std, x[train].std(0))
    assert len(local.held_out) == len(held) == 8 and local.held_out.true_y is None
    assert local.true_transition is None and local.test_split() is None
    fixed = load_run_config({**cfg.to_flat(), "normalization": "1,2,3,4;1,1,1,2"})
    again = node_data(fixed, 2, {"data-path": path}, NODE, CPU)
    assert again.spec.mean == (1.0, 2.0, 3.0, 4.0) and again.spec.std == (1.0, 1.0, 1.0, 2.0)


def test_fit_normalization_by_hand():
    x = np.array([[[[0, 255]], [[51, 51]]]], dtype=np.uint8)  # 1 image, 2 channels, 1x2
    mean, std = fit_normalization(x)
    assert mean == pytest.approx((0.5, 0.2)) and std == pytest.approx((0.5, 1.0))  # 0 -> 1


# -- models given by import path -------------------------------------------------------------
def test_a_model_by_import_path_is_called_with_k_and_the_input_shape():
    cfg = load_run_config({"model": "tests.own_models:tiny_cnn", "seed": 3})
    task = TaskShape((3, 12, 20), 3)
    model = initial_model(cfg, task)
    assert type(model).__name__ == "TinyConvNet"
    assert model(torch.zeros(5, 3, 12, 20)).shape == (5, 3)
    assert classifier_shape(model, task) == ClassifierShape(3, None)  # no features
    again = initial_model(cfg, task)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    other = initial_model(load_run_config({**cfg.to_flat(), "seed": 4}), task)
    assert not torch.equal(model.net[0].weight, other.net[0].weight)


def test_rofl_needs_features_and_says_so_other_methods_take_any_classifier():
    task = TaskShape((3, 12, 20), 3)
    with pytest.raises(ModelError) as err:
        initial_model(load_run_config({"method": "rofl", "model": "tests.own_models:tiny_cnn"}),
                      task)
    assert "method='rofl' needs the model's penultimate features" in str(err.value)
    assert "return_features=True" in str(err.value)
    model = initial_model(load_run_config({"method": "rofl",
                                           "model": "tests.own_models:featured"}), task)
    assert classifier_shape(model, task) == ClassifierShape(3, 6)


METHOD_CONFIGS = {  # one message of each method that does not need features
    "fedefc": {"phase": 2}, "fedavg": {}, "fedprox": {}, "fedditto": {},
    "forward-correction": {"phase": 2}, "confident-learning": {"phase": 2},
    "fedcorr": {FedCorrMessages.STAGE: 1, FedCorrMessages.MU: 0.1},
    "fednoro": {FedNoRoMessages.TASK: FedNoRoMessages.CLASS_LOSSES_TASK},
}


@pytest.mark.parametrize("method", sorted(METHOD_CONFIGS))
def test_every_method_but_rofl_trains_a_model_without_features_or_classifier(tmp_path,
                                                                            method):
    x, y = images(36, (3, 10, 14), 3)
    train, test = npz(tmp_path / "t.npz", images=x, labels=y), npz(tmp_path / "s.npz",
                                                                   images=x[:9], labels=y[:9])
    cfg = own(train, **{"method": method, "model": "tests.own_models:tiny_cnn",
                        "test-path": test, "num-clients": 2, "iid": True, "local-epochs": 1,
                        "rho": 0.2, "zeta": 0.5, "start-round": 0, "gamma-thr": 1})
    local = partition_data(cfg, 0, CPU)
    client = MethodClient(cfg, 0, lambda: local, RecordDict())
    weights = get_weights(initial_model(cfg, local.data.task))
    out, n, metrics = client.fit(weights, {"round": 1, "seed": 1, **METHOD_CONFIGS[method]})
    assert [a.shape for a in out] == [w.shape for w in weights]
    if method == "fednoro":  # the detection task: K per-class losses
        assert unpack_array(metrics[FedNoRoMessages.CLASS_LOSSES]).shape == (3,)
    else:
        assert n > 0 and math.isfinite(metrics["train-loss"])


# -- every malformed input names the value and the fix --------------------------------------
MALFORMED = [  # (arrays, extra run keys, what the message must contain)
    ({"X": np.zeros((4, 3)), "y": np.zeros(4, int)}, {},
     ["holds arrays ['X', 'y']", "it needs 'labels' and exactly one of 'images' or 'features'",
      "numpy.savez(path, features="]),
    ({"images": np.zeros((4, 8, 8), np.uint8), "features": np.zeros((4, 3)),
      "labels": np.zeros(4, int)}, {}, ["holds both images and features"]),
    ({"images": np.zeros((4, 8, 8), np.float32), "labels": np.zeros(4, int)}, {},
     ["images have dtype float32", "store uint8 pixel values 0..255"]),
    ({"features": np.array([["a"]] * 4), "labels": np.zeros(4, int)}, {},
     ["features have dtype <U1", "store real numbers"]),
    ({"features": np.zeros((4, 3)), "labels": np.zeros(4)}, {},
     ["labels have shape (4,) and dtype float64", "store a 1-D integer array"]),
    ({"features": np.zeros((4, 3)), "labels": np.array([0, 1, -1, 0])}, {},
     ["label -1 is negative"]),
    ({"features": np.array([[0.0, 1.0, np.nan]] * 4), "labels": np.zeros(4, int)}, {},
     ["feature 2 of sample 0 is nan", "replace missing or infinite values"]),
    ({"features": np.zeros((4, 3)), "labels": np.zeros(5, int)}, {},
     ["4 features but 5 labels"]),
    ({"features": np.zeros((4, 3)), "labels": np.array([0, 1, 2, 3])}, {"num-classes": 3},
     ["label 3 is outside 0..2 (num-classes=3)", "raise num-classes"]),
    ({"images": np.zeros((4, 5, 6, 5), np.uint8), "labels": np.zeros(4, int)}, {},
     ["shape (4, 5, 6, 5)", "channel axis is ambiguous", "set input-shape="]),
    ({"images": np.zeros((4, 3, 8, 8), np.uint8), "labels": np.zeros(4, int)},
     {"input-shape": "3x8x9"}, ["that is 3x8x8 (C x H x W) uint8 images",
                               "expected 3x8x9 (C x H x W) uint8 images"]),
]


@pytest.mark.parametrize("arrays,keys,expected", MALFORMED, ids=[
    "wrong-keys", "images-and-features", "float-images", "string-features", "float-labels",
    "negative-label", "nan-feature", "count-mismatch", "label-out-of-range",
    "ambiguous-layout", "shape-not-input-shape"])
def test_malformed_training_data_names_the_path_and_the_fix(tmp_path, arrays, keys, expected):
    path = npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError) as err:
        load_dataset(own(path, **keys))
    assert f"data-path='{path}'" in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_a_test_set_that_disagrees_with_the_training_data_is_refused(tmp_path):
    x, y = features(12, 4, 3)
    train = npz(tmp_path / "train.npz", features=x, labels=y)
    test = npz(tmp_path / "test.npz", features=x[:, :3], labels=y)
    with pytest.raises(DatasetError, match=r"test-path='.*test.npz': features have shape "
                                           r"\(12, 3\), that is 3 float features; expected 4"):
        load_dataset(own(train, **{"test-path": test}))
    test = npz(tmp_path / "test5.npz", features=x, labels=np.full(12, 5))
    with pytest.raises(DatasetError) as err:
        load_dataset(own(train, **{"test-path": test}))
    assert "label 5 is outside 0..2 (K=3)" in str(err.value)
    assert "set num-classes=6 if the training data lacks classes" in str(err.value)


@pytest.mark.parametrize("stored,labels,expected", [
    ((3, 10, 20), [0, 1, 2], ["images have shape (3, 3, 10, 20), that is 3x10x20",
                              "expected 3x12x20 (C x H x W) uint8 images"]),
    ((12, 20), [0, 1, 2], ["that is 1x12x20", "expected 3x12x20"]),
    ((3, 12, 20), [0, 4, 1], ["label 4 is outside 0..2", "K=3"]),
], ids=["other-size", "other-channels", "other-k"])
def test_a_node_whose_data_does_not_match_the_run_is_refused(tmp_path, stored, labels,
                                                             expected):
    """Mismatched shapes or K between nodes: each node's data is checked against the
    run's input shape and K, the error names node, path, what it found and expected."""
    path = npz(tmp_path / "node.npz", images=images(3, stored, 1)[0], labels=np.array(labels))
    with pytest.raises(PrivateDataError) as err:
        load_private_data(path, TaskShape((3, 12, 20), 3), NODE)
    message = str(err.value)
    assert message.startswith(f"{NODE}: data-path='{path}'")
    assert "the run expects 3x12x20 (C x H x W) uint8 images and labels 0..2 (K=3)" in message
    for text in expected:
        assert text in message
    assert astuple(load_private_data(npz(tmp_path / "ok.npz", images=images(3, (12, 20, 3), 1)[0],
                                         labels=np.arange(3)), TaskShape((3, 12, 20), 3),
                                     NODE))[0].shape == (3, 3, 12, 20)


@pytest.mark.parametrize("model,expected", [
    ("no_such_package.models:net", ["cannot import 'no_such_package.models'",
                                    "ModuleNotFoundError", "PYTHONPATH"]),
    ("tests.own_models:missing", ["module 'tests.own_models' has no callable 'missing'"]),
    ("tests.own_models:one_class_too_many", [
        "gives (2, 4) for a batch of 2 inputs of shape (3, 12, 20)",
        "logits shaped (N, K) = (2, 3)"]),
    ("tests.own_models:not_a_module", ["returned str, not a torch.nn.Module"]),
    ("lenet", ["model='lenet' needs images of at least 16x16 pixels", "model=\"cnn\""]),
], ids=["no-import", "no-callable", "wrong-output", "not-a-module", "too-small-for-lenet"])
def test_a_model_that_cannot_serve_names_the_value_and_the_fix(model, expected):
    with pytest.raises(ModelError) as err:
        initial_model(load_run_config({"model": model}), TaskShape((3, 12, 20), 3))
    assert f"model={model!r}" in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_a_bad_model_fails_the_cli_before_any_flower_process(tmp_path, capsys):
    x, y = features(12, 4, 3)
    path = npz(tmp_path / "d.npz", features=x, labels=y)
    out = tmp_path / "out"
    assert main(["run", "--set", "dataset=npz", "--set", f"data-path={path}", "--set", "rho=0",
                 "--set", "model=no_such_package.models:net", "--out-dir", str(out)]) == 2
    assert "cannot import 'no_such_package.models'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flat,expected", [
    ({"dataset": "npz"}, "dataset='npz' needs data-path"),
    ({"dataset": "npz", "data-path": "train.npz"}, "data-path='train.npz' is not absolute"),
    ({"dataset": "npz", "data-path": "/d.npz", "evaluation": "server"},
     "evaluation='server' needs a server test set"),
    ({"dataset": "npz", "data-path": "/d.npz", "data-dir": "/data"},
     "data-dir='/data' is the torchvision folder"),
    ({"test-path": "/t.npz"}, "test-path='/t.npz' is for dataset=\"npz\""),
    ({"dataset": "npz", "data-path": "/d.npz", "input-shape": "3x32"},
     "input-shape='3x32' is not 'CxHxW'"),
    ({"normalization": "0.5;"}, "normalization='0.5;' is not"),
    ({"dataset": "npz", "data-path": "/d.npz", "local-test-fraction": 0.0},
     "local-test-fraction=0.0: federated evaluation needs held-out data"),
    ({"model": "my model"}, "model='my model' is neither a built-in model"),
    ({"evaluation": "clients"}, "'evaluation'"),
], ids=["no-data-path", "relative", "server-without-test", "data-dir", "test-path-mnist",
        "input-shape", "normalization", "no-held-out", "model-name", "evaluation"])
def test_bad_own_data_keys_name_the_key_and_the_fix(flat, expected):
    with pytest.raises(ConfigError) as err:
        load_run_config(flat)
    assert expected in str(err.value)


def test_augmentation_and_normalization_must_fit_the_data(tmp_path):
    x, y = features(12, 4, 3)
    path = npz(tmp_path / "d.npz", features=x, labels=y)
    with pytest.raises(DatasetError, match="random crop and flip need images"):
        load_dataset(own(path, augment="crop-flip"))
    with pytest.raises(DatasetError, match="gives 2 means, but the data has 4 features"):
        load_dataset(own(path, normalization="0,0;1,1"))
    with pytest.raises(DatasetError, match="contradicts dataset 'mnist-embedded'"):
        load_dataset(load_run_config({"num-classes": 7}))


# -- federated evaluation on the server --------------------------------------------------------
def evaluate_reply(proxy, pid: int, n: int, loss: float, acc, **metrics):
    return proxy, EvaluateRes(
        Status(Code.OK, ""), loss, n, {"partition-id": pid, "accuracy": acc, **metrics})


def test_federated_evaluation_asks_every_partition_and_weights_by_held_out_samples():
    pipeline = make_driver(**{"method": "fedavg", "num-clients": 5,
                              "evaluation": "federated"}).pipeline
    strategy = RoundStrategy(pipeline, None)
    asked = strategy.configure_evaluate(3, PARAMS,
                                        partition_manager(5, held_out=[10, 0, 20, 30, 5]))
    assert [int(p.cid) for p, _ in asked] == [7_000_000 + 13 * pid for pid in range(5)]
    assert all(ins.config == {"round": 3} for _, ins in asked)
    node = {pid: proxy for pid, (proxy, _) in enumerate(asked)}
    replies = [evaluate_reply(node[3], 3, 30, 0.5, 0.9, **{"true-accuracy": 1.0}),
               evaluate_reply(node[0], 0, 10, 2.0, 0.1, **{"true-accuracy": 0.5}),
               evaluate_reply(node[1], 1, 0, 0.0, None),  # no held-out sample: not counted
               evaluate_reply(node[2], 2, 20, float("nan"), 0.5),  # rejected
               evaluate_reply(node[4], 4, 5, 1.0, 1.5),  # rejected
               evaluate_reply(node[4], 0, 5, 1.0, 0.5)]  # another node's partition: rejected
    loss, metrics = strategy.aggregate_evaluate(3, replies, [RuntimeError("timeout")])
    assert loss == pytest.approx((30 * 0.5 + 10 * 2.0) / 40)
    assert metrics == {"accuracy": pytest.approx((30 * 0.9 + 10 * 0.1) / 40),
                       "true_accuracy": pytest.approx((30 * 1.0 + 10 * 0.5) / 40)}
    fields = strategy.federated
    assert fields["federated_acc"] == metrics["accuracy"] and fields["federated_loss"] == loss
    assert (fields["federated_clients"], fields["federated_samples"]) == (2, 40)
    assert fields["federated_failures"] == 1 and fields["federated_rejected"] == 3
    reasons = [r["reason"] for r in fields["federated_rejected_reasons"]]
    assert reasons == ["held-out loss nan outside [0, inf]",
                       "held-out accuracy 1.5 outside [0, 1]",
                       "partition id 0 is not its node's registered partition 4"]
    server_only = RoundStrategy(make_driver(**{"num-clients": 5}).pipeline, None)
    assert server_only.configure_evaluate(3, PARAMS, partition_manager(5)) == []
    assert server_only.federated == {}


def test_the_summary_uses_the_federated_evaluation_when_there_is_no_test_set(tmp_path):
    recorder = RunRecorder(tmp_path, {})
    for rnd, acc in enumerate([0.1, 0.5, 0.7, 0.6]):
        recorder.write_round({"round": rnd, "federated_acc": acc, "federated_true_acc": acc / 2})
    summary = recorder.write_summary({})
    assert summary["accuracy_source"] == "federated held-out data"
    assert (summary["final_acc"], summary["best_acc"], summary["best_round"]) == (0.6, 0.7, 2)
    assert summary["mean_last10_acc"] == pytest.approx(0.6)
    assert summary["federated_final_acc"] == 0.6 and summary["federated_true_final_acc"] == 0.3


# -- the server holds no data ----------------------------------------------------------------
def server_context(tmp_path: Path, **keys) -> Context:
    """A deployment's ServerApp (no grid: not a simulation) without an allowlist."""
    flat = {"dataset": "npz", "evaluation": "federated", "num-clients": 3,
            "out-dir": str(tmp_path / "out"), "open-deployment": True,
            "max-client-samples": 1000, **keys}
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=flat)


def test_a_federated_only_server_reads_no_data(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the server read data")

    monkeypatch.setattr("common.datasets.read_samples", refuse)
    monkeypatch.setattr("common.datasets.read_header", refuse)
    loop, _ = server_app.build(server_context(
        tmp_path, **{"num-classes": 37, "input-shape": "3x12x20",
                     "model": "tests.own_models:tiny_cnn"}), None)
    assert loop.pipeline.evaluator is None
    assert loop.pipeline.server.model_shape.num_classes == 37
    assert loop.model(torch.zeros(2, 3, 12, 20)).shape == (2, 37)
    info = json.loads((tmp_path / "out" / "data.json").read_text())
    assert info == {"evaluation": "federated", "input_shape": [3, 12, 20], "num_classes": 37}


def test_a_server_with_the_file_reads_only_its_header_and_without_it_names_the_keys(
        tmp_path, monkeypatch):
    x, y = images(10, (12, 20, 3), 5)
    path = npz(tmp_path / "d.npz", images=x, labels=y)

    def refuse(*args, **kwargs):
        raise AssertionError("the server decoded the samples")

    monkeypatch.setattr("common.datasets.read_samples", refuse)
    loop, _ = server_app.build(server_context(tmp_path, **{"data-path": path}), None)
    assert loop.pipeline.server.model_shape.num_classes == 5
    assert loop.model(torch.zeros(2, 3, 12, 20)).shape == (2, 5)
    with pytest.raises(DatasetError) as err:
        task_shape(own(str(tmp_path / "elsewhere.npz"), evaluation="federated"), "the server")
    assert "the server: the run's input shape and number of classes are unknown" in \
        str(err.value)
    assert "Set input-shape" in str(err.value) and "num-classes" in str(err.value)


# -- the coordinator's clean test set, the sites' private data -------------------------------
def test_the_server_evaluates_on_the_coordinators_test_set_while_the_sites_hold_the_data(
        tmp_path):
    """evaluation = both, a server test-path and no data-path: the server reads only the
    coordinator's test file; three real ClientApps train on their own private files and
    evaluate on their held-out samples. Every round's test accuracy is the global model's
    on the test file under the shared normalization, computed here by hand."""
    sites = []
    for k in range(3):
        x, y = images(40, (8, 8), 4, seed=k)
        sites.append(npz(tmp_path / f"site-{k}.npz", images=x, labels=y))
    tx, ty = images(30, (8, 8), 4, seed=9)
    flat = {"dataset": "npz", "test-path": npz(tmp_path / "clean-test.npz", images=tx,
                                               labels=ty),
            "evaluation": "both", "num-classes": 4, "input-shape": "1x8x8",
            "normalization": "0.5;0.25", "model": "tests.own_models:tiny_cnn",
            "method": "fedavg", "prestopping": False, "num-clients": 3, "fraction": 1.0,
            "rounds": 2, "local-epochs": 1, "batch-size": 16, "client-threads": 1,
            "out-dir": str(tmp_path / "out"), "open-deployment": True,
            "max-client-samples": 40}
    loop, _ = server_app.build(Context(1, 0, {}, RecordDict(), flat), None)
    grid = InProcessGrid(client_app, flat, 3, {k: {"data-path": sites[k]} for k in range(3)})
    for proxy in grid.manager().all().values():
        loop.client_manager().register(proxy)
    loop.fit(2, None)
    info = json.loads((tmp_path / "out" / "data.json").read_text())
    assert info["test_samples"] == 30 and info["evaluation"] == "both"
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == [0, 1, 2]
    assert all(r["federated_clients"] == 3 for r in recs)  # the sites evaluated too
    assert recs[1]["declared"] == {str(k): 32 for k in range(3)}  # 40 less 20 % held out
    model = initial_model(load_run_config(flat), TaskShape((1, 8, 8), 4))
    model.load_state_dict(torch.load(tmp_path / "out" / "model.pt"))
    inputs = (torch.from_numpy(tx).float().unsqueeze(1) / 255.0 - 0.5) / 0.25
    with torch.no_grad():
        acc = (model(inputs).argmax(1) == torch.from_numpy(ty)).float().mean().item()
    assert recs[-1]["test_acc"] == pytest.approx(acc)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["accuracy_source"] == "server test set" and summary["final_acc"] == \
        pytest.approx(acc)


@pytest.mark.parametrize("keys, message", [
    ({"num-classes": 4, "input-shape": "1x8x8"}, "normalization=\"auto\""),
    ({"input-shape": "1x8x8", "normalization": "none"}, "needs data-path"),
    ({"num-classes": 4, "normalization": "none"}, "needs data-path"),
], ids=["no-normalization", "no-num-classes", "no-input-shape"])
def test_a_coordinator_test_set_without_what_the_sites_share_is_refused(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config({"dataset": "npz", "test-path": "/srv/clean-test.npz",
                         "evaluation": "both", **keys})
