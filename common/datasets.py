"""Datasets: the paper's (MNIST, CIFAR-10/100) and the user's own (an .npz or an
ImageFolder directory), each with the description the model and the batch transform need.

A :class:`DataSpec` holds the input shape ((C, H, W) for images, (D,) for feature
vectors), the number of classes K, the per-channel / per-feature normalization and
whether training augments. A :class:`Dataset` adds the train and test samples: images
stay uint8 (N, C, H, W), features float32 (N, D); batches are normalized (and, where
asked, augmented) on the fly by :class:`common.training.BatchTransform`.

- The datasets known by name (:mod:`common.named_datasets`: the paper's MNIST,
  CIFAR-10/100 and the embedded MNIST subset; docs/FEDEFC.md §2): their registration
  fixes K, the input shape, the normalization constants and whether ``augment = "auto"``
  augments (random crop + flip on CIFAR).
- Own data (docs/OWN-DATA.md): ``dataset = "npz" | "imagefolder"`` reads ``data-path``
  (training data) and ``test-path`` (optional server test set) with
  :mod:`common.data_files`; K is ``num-classes`` or the largest label + 1; the
  normalization is computed from the training data unless ``normalization`` gives it;
  no augmentation unless ``augment = "crop-flip"``.

Loaded once per process and shared by its clients.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .config import OWN_DATASETS, RunConfig, parse_input_shape, parse_normalization
from .data_files import DatasetError, describe_shape, read_header, read_samples
from .models import TaskShape
from .named_datasets import DATASETS, NamedDataset


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
    # own data: the training file's ``verified`` mask, where it has one (docs/OWN-DATA.md,
    # "Verified labels"): a simulation of that file takes those samples as checked
    train_verified: np.ndarray | None = None

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
        if cfg.dataset in DATASETS:
            mean, std = DATASETS[cfg.dataset].mean, DATASETS[cfg.dataset].std
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
    """Whether training augments: ``crop-flip``, or ``auto`` on a named dataset
    registered to augment (CIFAR; docs/FEDEFC.md §2.4); never for feature vectors."""
    named = DATASETS.get(cfg.dataset)
    augment = cfg.augment == "crop-flip" or (cfg.augment == "auto" and named is not None
                                              and named.augment)
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
        return TaskShape(DATASETS[cfg.dataset].input_shape, _named_classes(cfg))
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
    k = DATASETS[cfg.dataset].num_classes
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
    key = (cfg.dataset, cfg.data_dir if _reads_data_dir(cfg) else "",
           cfg.data_path, cfg.test_path, cfg.num_classes, cfg.input_shape,
           cfg.normalization, cfg.augment)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _build(cfg)
        data = _CACHE[key]
    check_checked_labels(cfg, data)
    return data


def check_checked_labels(cfg: RunConfig, data: Dataset) -> None:
    """A simulation of one's own training file with ``validation-labels = "verified"``
    and no synthetic noise (rho 0): the file's labels are its observed ones, so only its
    ``verified`` mask can say which are checked (docs/FEDEFC.md §3.7); without one the
    run is refused rather than take observed labels for checked ones."""
    if (cfg.validation_labels != "verified" or cfg.dataset not in OWN_DATASETS
            or not cfg.data_path or data.train_verified is not None
            or any(group.rho > 0 for group in cfg.noise_group_list())):
        return
    raise DatasetError(
        f"data-path={cfg.data_path!r}: validation-labels=\"verified\" with rho=0 takes the "
        "file's labels as they are, and the file names no checked sample: its observed "
        "labels would be treated as verified. Mark the checked samples in a boolean "
        "'verified' array (fedefc labels writes it: docs/OWN-DATA.md, \"Verified "
        "labels\"), or set rho > 0 to simulate noise on labels taken as true, or "
        "validation-labels=\"observed\"")


def _build(cfg: RunConfig) -> Dataset:
    if cfg.dataset in OWN_DATASETS:
        return _load_own(cfg)
    named = DATASETS[cfg.dataset]
    source = (cfg.dataset, cfg.data_dir if named.reads_data_dir else "")
    if source not in _RAW:
        _RAW[source] = _load(named, cfg.data_dir, cfg.download)
    train_x, train_y, test_x, test_y = _RAW[source]
    task = TaskShape(named.input_shape, _named_classes(cfg))
    return Dataset(cfg.dataset, make_spec(cfg, task), train_x, train_y, test_x, test_y)


def _load_own(cfg: RunConfig) -> Dataset:
    """``data-path`` (and ``test-path``) read and checked against each other and the
    keys: same input shape, labels within K. Without ``data-path`` (the nodes hold the
    training data) only the coordinator's test set: :func:`_load_test_only`."""
    if not cfg.data_path:
        return _load_test_only(cfg)
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
                   torch.from_numpy(test_x), torch.from_numpy(test_y), train.verified)


def _load_test_only(cfg: RunConfig) -> Dataset:
    """The coordinator's clean test set (``test-path``) of a run whose nodes hold the
    training data: checked against ``input-shape`` and ``num-classes`` (which the config
    requires then, with an explicit ``normalization``); an empty training split."""
    where = f"test-path={cfg.test_path!r}"
    shape = parse_input_shape(cfg.input_shape)
    test = read_samples(cfg.test_path, where, shape)
    k = cfg.num_classes
    if test.y.max() >= k:
        raise DatasetError(f"{where}: label {int(test.y.max())} is outside 0..{k - 1} "
                           f"(num-classes={k}); raise num-classes or fix the labels")
    spec = make_spec(cfg, TaskShape(test.input_shape, k))
    return Dataset(cfg.dataset, spec, torch.from_numpy(test.x[:0].copy()),
                   torch.zeros(0, dtype=torch.int64),
                   torch.from_numpy(test.x), torch.from_numpy(test.y))


def _reads_data_dir(cfg: RunConfig) -> bool:
    return cfg.dataset in DATASETS and DATASETS[cfg.dataset].reads_data_dir


def _load(named: NamedDataset, data_dir: str, download: bool) -> tuple[torch.Tensor, ...]:
    """(train_x, train_y, test_x, test_y) of a named dataset as tensors sharing its
    loader's arrays, its folder checked first."""
    if named.reads_data_dir:
        if not os.path.isabs(data_dir):
            raise DatasetError(f"data-dir={data_dir!r} must be an absolute folder for "
                               f"{named.name}")
        if not download and not os.path.isdir(data_dir):
            raise DatasetError(
                f"data-dir={data_dir!r} does not exist; point it at the folder that holds "
                f"{named.layout}, or set download=true")
    return tuple(torch.as_tensor(a).contiguous() for a in named.load(data_dir, download))
