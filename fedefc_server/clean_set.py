"""The coordinator's clean validation set (docs/FEDEFC.md §3.9): samples whose labels were
checked, held on the ServerApp's machine, on which the server measures every model the
phase-2 guard judges instead of reading the clients' held-out accuracy through Q (and,
for FedAvg and the other methods without server steps of their own, every round's
model, reported: the baseline a FedEFC run with the set pairs with).

Two sources, one per run:

- ``clean-validation-path``: a file of checked samples on the ServerApp's machine in the
  project's own-data format (an .npz of ``images`` or ``features`` and ``labels``, or an
  ImageFolder directory: docs/OWN-DATA.md), read with the run's normalization. Refused,
  naming the fix, when it is the server's test set or the run's training data (the same
  path, or the same samples with the same labels in any order: :func:`content_hash`),
  when its inputs are not the run's shape, or when a label is not one of the run's K
  classes.
- ``clean-validation-per-class = N`` (a simulation only): N samples of each true class
  drawn from the clients' samples with their TRUE labels and taken out of the clients
  (:func:`common.data_plan.coordinator_draw`), so that the coordinator holds no sample a
  client also holds.

The test set that reports the run's result is never read by the guard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log

from common.config import ConfigError, RunConfig
from common.data_files import DatasetError, read_samples
from common.data_plan import data_plan
from common.datasets import Dataset, load_dataset

from .evaluation import TestSetEvaluator


@dataclass(frozen=True)
class CleanSet:
    """The coordinator's checked samples, and where they came from (in words)."""

    x: torch.Tensor
    y: torch.Tensor
    source: str

    @property
    def summary(self) -> str:
        """What the summary's ``guard_signal`` says the guard read."""
        return f"the coordinator's clean validation set ({len(self.y)} samples, {self.source})"


def content_hash(x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor) -> str:
    """A digest of a set of labelled samples, whatever file or folder holds them and in
    whatever order: the same inputs (shape, dtype, values) with the same labels give the
    same digest, in another order too."""
    x, y = np.asarray(x), np.asarray(y, dtype=np.int64)
    rows = np.ascontiguousarray(x).reshape(len(x), -1).view(np.uint8).reshape(len(x), -1)
    each = sorted(hashlib.sha256(row.tobytes() + label.tobytes()).digest()
                  for row, label in zip(rows, y))
    digest = hashlib.sha256(f"{x.shape[1:]}{x.dtype}".encode())
    for item in each:
        digest.update(item)
    return digest.hexdigest()


def load_clean_set(cfg: RunConfig, simulation: bool) -> tuple[CleanSet, Dataset] | None:
    """The run's clean validation set with the dataset whose normalization reads it, or
    None without one; refused as the module docstring says."""
    if cfg.clean_validation_per_class:
        return _drawn(cfg, simulation)
    if cfg.clean_validation_path:
        return _from_file(cfg)
    return None


def _drawn(cfg: RunConfig, simulation: bool) -> tuple[CleanSet, Dataset]:
    n = cfg.clean_validation_per_class
    if not simulation:
        raise ConfigError(
            f"clean-validation-per-class={n} draws the coordinator's set from a "
            "simulation's training pool and takes it from the simulated clients; in a "
            "deployment each node holds its own data: give clean-validation-path, a file of "
            "checked samples on the ServerApp's machine (docs/DEPLOYMENT.md)")
    fed = data_plan(cfg)
    idx = fed.coordinator_indices
    return CleanSet(fed.data.train_x[torch.as_tensor(idx)], torch.as_tensor(fed.true_labels[idx]),
                    f"{n} per class drawn from the clients' samples with their true "
                    "labels, which the clients then do not hold"), fed.data


def _from_file(cfg: RunConfig) -> tuple[CleanSet, Dataset]:
    path = cfg.clean_validation_path
    where = f"clean-validation-path={path!r}"
    data = load_dataset(cfg)
    samples = read_samples(path, where, data.task.input_shape)
    k = data.num_classes
    if samples.y.min() < 0 or samples.y.max() >= k:
        raise DatasetError(
            f"{where}: labels {int(samples.y.min())}..{int(samples.y.max())} are not all "
            f"among the run's {k} classes 0..{k - 1}; check the file, or num-classes")
    digest = content_hash(samples.x, samples.y)
    for other_key, other_path, x, y, fix in (
            ("test-path" if cfg.test_path else "the dataset's test split", cfg.test_path,
             data.test_x, data.test_y,
             "the test set reports the run's result and the guard must not choose the "
             "model on it: give a set of other checked samples"),
            ("data-path", cfg.data_path, data.train_x, data.train_y,
             "those are the clients' samples: the coordinator's set must be samples no "
             "client holds")):
        same_path = bool(other_path) and Path(path).resolve() == Path(other_path).resolve()
        if same_path or (len(y) and content_hash(x, y) == digest):
            how = "the same file" if same_path else "the same samples and labels"
            raise ConfigError(f"{where} is {how} as {other_key}: {fix} (docs/FEDEFC.md §3.9)")
    return CleanSet(torch.from_numpy(samples.x), torch.from_numpy(samples.y),
                    f"checked samples of {path}"), data


def attach_clean_set(server, cfg: RunConfig, simulation: bool) -> None:
    """Load the run's clean validation set, if it has one, and hand it to ``server``:
    a prestopping method's phase-2 guard reads it (``PrestoppingServer.read_clean_set``),
    a method without server steps of its own reports each round's model on it
    (``MethodServer.read_clean_set``); the config check refuses it elsewhere."""
    loaded = load_clean_set(cfg, simulation)
    if loaded is None:
        return
    clean, data = loaded
    use = server.read_clean_set(TestSetEvaluator(cfg, data, (clean.x, clean.y)), clean)
    log(INFO, "%s (docs/FEDEFC.md §3.9)", use)
