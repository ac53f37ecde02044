"""The coordinator's clean validation set (docs/FEDEFC.md §3.9): samples whose labels were
checked, held on the ServerApp's machine, on which the server measures every model the
phase-2 guard judges instead of reading the clients' held-out accuracy through Q (and,
for FedAvg and the other methods without server steps of their own, every round's
model, reported: the baseline a FedEFC run with the set pairs with).

Two sources, one per run:

- ``clean-validation-path``: a file of checked samples on the ServerApp's machine in the
  project's own-data format (an .npz of ``images`` or ``features`` and ``labels``, or an
  ImageFolder directory: docs/OWN-DATA.md), read with the run's normalization. Refused,
  naming the fix, when it shares a sample with the server's test set or the run's
  training data (the same path, or one input the same, whatever its label:
  :func:`shared_samples`; before, only the whole set in any order was refused, and the
  test set less one sample, half of it or with one label changed went through), when
  its inputs are not the run's shape, or when a label is not one of the run's K
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


def _rows(x: np.ndarray | torch.Tensor) -> list[bytes]:
    x = np.ascontiguousarray(np.asarray(x))
    return [hashlib.sha256(row.tobytes()).digest() for row in x.reshape(len(x), -1)]


def shared_samples(x: np.ndarray | torch.Tensor, other: np.ndarray | torch.Tensor
                   ) -> list[int]:
    """The positions of the samples of ``x`` whose input (its values, compared in
    ``other``'s dtype) is one of ``other``'s, whatever their labels."""
    x, other = np.asarray(x), np.asarray(other)
    if x.shape[1:] != other.shape[1:] or not len(other):
        return []
    cast = x.astype(other.dtype)
    same = np.array_equal(cast.astype(x.dtype), x)  # x's values hold in other's dtype
    seen = set(_rows(other)) if same else set()
    return [i for i, row in enumerate(_rows(cast)) if row in seen]


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
    for other_key, other_path, x, fix in (
            ("test-path" if cfg.test_path else "the dataset's test split", cfg.test_path,
             data.test_x,
             "the test set reports the run's result and the guard must not choose the "
             "model on it: give a set of other checked samples"),
            ("data-path", cfg.data_path, data.train_x,
             "those are the clients' samples: the coordinator's set must be samples no "
             "client holds")):
        if bool(other_path) and Path(path).resolve() == Path(other_path).resolve():
            raise ConfigError(f"{where} is the same file as {other_key}: {fix} "
                              "(docs/FEDEFC.md §3.9)")
        shared = shared_samples(samples.x, x)
        if shared:
            raise ConfigError(
                f"{where} shares {len(shared)} of its {len(samples.y)} samples with "
                f"{other_key} (its sample {shared[0]} first; labels aside): {fix}, and "
                "take out every sample the other set holds (docs/FEDEFC.md §3.9)")
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
