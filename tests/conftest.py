"""Shared fixtures: small real data written in torchvision's layouts (no network), the
guard that keeps the ``flower`` marker honest: a test without it that tries to start a
Flower executable fails, naming the marker (the fast lane, ``-m "not flower"``, must
never start one), and the suite's groups and order for pytest-xdist
(:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flwr.supercore.task_identity import TaskIdentity

from common.datasets import load_dataset
from common.methods import load_run_config

FLOWER_EXECUTABLES = {"flower-superlink", "flower-supernode", "flower-superexec", "flwr"}
_flower_allowed = {"now": False}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The Flower tests of a module form one ``xdist_group``, so that under ``--dist
    loadgroup`` (pyproject's addopts) one worker runs them and the Flower runs of their
    module-scoped fixtures once, and they go first, so that the long groups start at once
    and the short tests fill the other worker meanwhile (xdist hands out its largest
    groups first). Without ``-n``, the order is all this changes; every test passes in
    any order."""
    for item in items:
        if item.get_closest_marker("flower") is not None:
            item.add_marker(pytest.mark.xdist_group(f"flower-{item.module.__name__}"))
    items.sort(key=lambda item: item.get_closest_marker("flower") is None)  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` xdist names each grouped test ``ID@GROUP`` and sends a
    group to one worker. pytest 9.2 ignores the name xdist sets (pyproject pins pytest
    below it): every group was then split, and each shared Flower run ran once on each
    worker, doubling the suite's time. A Flower test fails at once, before its fixtures
    run, if that happens again."""
    flower = item.get_closest_marker("flower") is not None
    if flower and getattr(item.config.option, "loadgroup", False) \
            and "@flower-" not in item.nodeid:
        pytest.fail(f"pytest {pytest.__version__} with pytest-xdist did not group this "
                    "Flower test with its module's: its shared Flower runs would run on "
                    "every worker. Install the versions pyproject.toml allows "
                    "(pip install -e '.[dev]'), or run without -n.", pytrace=False)
    _flower_allowed["now"] = flower


@pytest.fixture(scope="session", autouse=True)
def _private_plan_cache(tmp_path_factory):
    """The data plans of the tests' runs go to a folder of this session, not ~/.cache
    (the Flower processes the tests start inherit the variable)."""
    old = os.environ.get("FEDEFC_CACHE_DIR")
    os.environ["FEDEFC_CACHE_DIR"] = str(tmp_path_factory.mktemp("fedefc-cache"))
    yield
    if old is None:
        os.environ.pop("FEDEFC_CACHE_DIR")
    else:
        os.environ["FEDEFC_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def _task_identity():
    """Flower's ``Message`` needs a run, node and task id, which Flower's own processes
    set: set them once, so a test that builds messages passes in any order (alone, or on
    any pytest-xdist worker)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


@pytest.fixture(scope="session", autouse=True)
def _flower_marker_guard():
    """Refuse to start a Flower executable from a test not marked ``flower``."""
    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        name = os.path.basename(str(argv[0])) if argv else ""
        if [str(a) for a in argv[1:3]] == ["-m", "fedefc_cli.flower_repairs"]:
            name = f"flower-{argv[3]}" if len(argv) > 3 else name  # Flower's, repaired
        if name in FLOWER_EXECUTABLES and not _flower_allowed["now"]:
            raise RuntimeError(f"this test starts {name} but is not marked "
                               "@pytest.mark.flower")
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded
    yield
    subprocess.Popen.__init__ = original


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an IDX file (the MNIST format) for a uint8 array."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist(root: Path, train_x, train_y, test_x, test_y) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_idx(raw / "train-images-idx3-ubyte", train_x)
    write_idx(raw / "train-labels-idx1-ubyte", train_y)
    write_idx(raw / "t10k-images-idx3-ubyte", test_x)
    write_idx(raw / "t10k-labels-idx1-ubyte", test_y)
    return root


@pytest.fixture(scope="session")
def embedded():
    return load_dataset(load_run_config({}))


def real_mnist_subset(root: Path, embedded, train_per_class: int, test_per_class: int) -> Path:
    """Real MNIST images (from the embedded subset) written in torchvision's layout."""
    x = embedded.train_x.numpy()[:, 0]
    y = embedded.train_y.numpy()
    tr = np.concatenate([np.flatnonzero(y == c)[:train_per_class] for c in range(10)])
    te = np.concatenate([np.flatnonzero(y == c)[-test_per_class:] for c in range(10)])
    return write_mnist(root, x[tr], y[tr].astype(np.uint8), x[te], y[te].astype(np.uint8))


@pytest.fixture(scope="session")
def tiny_mnist_dir(tmp_path_factory, embedded) -> Path:
    """60 train / 20 test images per class."""
    return real_mnist_subset(tmp_path_factory.mktemp("tiny-mnist"), embedded, 60, 20)


@pytest.fixture(scope="session")
def micro_mnist_dir(tmp_path_factory, embedded) -> Path:
    """8 train / 20 test images per class: clients small enough to memorize their labels,
    so the averaged accuracy A(t) plateaus within a few rounds and prestopping triggers."""
    return real_mnist_subset(tmp_path_factory.mktemp("micro-mnist"), embedded, 8, 20)


@pytest.fixture(scope="session")
def tiny_cifar10_dir(tmp_path_factory) -> Path:
    """A CIFAR-10 folder in the Toronto pickle layout with random images."""
    root = tmp_path_factory.mktemp("tiny-cifar")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)

    def batch(name, n):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = list(rng.integers(0, 10, size=n).tolist())
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": data, "labels": labels}, fh)

    for i in range(1, 6):
        batch(f"data_batch_{i}", 20)
    batch("test_batch", 10)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, fh)
    return root
