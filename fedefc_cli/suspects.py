"""``fedefc labels --suspects MODEL``: a site's samples ranked by how likely their label is
wrong, computed on the site from the model the run delivered (docs/OWN-DATA.md, "Which
labels to check first"); nothing leaves the site.

For every sample x with observed label ỹ: p(x), the softmax of the run's ``model.pt``
(its architecture, input shape, K and normalization from the ``config.json`` the run
wrote beside it; normalization computed from the site's own samples where the run
config gives none, as a node computes it from its training part); the site's Q,
counted from those predictions on the site's own samples with the run's count rule and
weighting (``common/transition.py``: paper eq. (4)-(6), docs/FEDEFC.md §4), Q[i, j] ~
P(ỹ = i | y = j); and the probability of the observed label under the model through
the site's noise, as FedEFC's forward correction reads it (paper eq. (7))::

    P(ỹ | x) = (Q p(x))[ỹ]

The suspects are the samples in increasing order of it (ties: the lower row first).
Ranked so, the first 100 of three sites of 500 with 30 % of labels flipped held 98-100
flipped labels (docs/OWN-DATA.md gives the figures and the two rankings measured beside
it). torch is imported here only when ``--suspects`` is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data_files import DatasetError, read_header
from common.errors import ConfigError
from common.transition import estimate_transition

from .errors import UsageError


class SuspectsError(UsageError):
    """MODEL, its run config or DATA cannot be ranked; the message names it and the fix."""


@dataclass(frozen=True)
class Ranked:
    """A site's samples ranked: ``order`` (rows, most suspect first), per row
    ``observed_p`` ((Q p)[ỹ]) and ``probs`` (p(x), N x K); ``q`` (K x K)."""

    order: np.ndarray
    observed_p: np.ndarray
    probs: np.ndarray
    q: np.ndarray


def observed_probability(probs: np.ndarray, labels: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(Q p(x))[ỹ] of every sample: sum over j of Q[ỹ, j] p(x)[j]."""
    labels = np.asarray(labels, dtype=np.int64)
    return np.einsum("nj,nj->n", probs, q[labels])


def rank(probs: np.ndarray, labels: np.ndarray, rule: str = "cleanlab",
         weighting: str = "none") -> Ranked:
    """The suspects of a site's predictions ``probs`` and observed ``labels``, its Q
    counted from them with ``rule`` and ``weighting``."""
    q = estimate_transition(probs, labels, rule, weighting)
    observed_p = observed_probability(probs, labels, q)
    order = np.lexsort((np.arange(len(labels)), observed_p))
    return Ranked(order, observed_p, probs, q)


def rank_site(data: Path, model_path: Path) -> Ranked:
    """:func:`rank` of DATA's samples under the run's ``model_path`` (module docstring)."""
    import torch  # lazy: torch, 3.6 s of CPU, for --suspects only

    from common.datasets import make_spec, task_shape  # lazy: torch, 4.5 s of CPU
    from common.methods import load_run_config  # lazy: the run-config schema, 1.2 s of CPU
    from common.models import TaskShape  # lazy: torch, 3.6 s of CPU
    from common.runtime import initial_model  # lazy: torch, 4.6 s of CPU
    from common.training import BatchTransform, predict_proba  # lazy: torch, 4.4 s of CPU
    from fedefc_client.private_data import load_private_data  # lazy: torch, 3.6 s of CPU

    where = f"--suspects={str(model_path)!r}"
    config = model_path.with_name("config.json")
    if not model_path.is_file() or not config.is_file():
        raise SuspectsError(f"{where}: give the model.pt of a finished run, with the "
                            f"config.json the run wrote beside it ({str(config)!r}: "
                            f"{'found' if config.is_file() else 'missing'}); copy both "
                            "from the run's folder")
    try:
        cfg = load_run_config(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError, ConfigError) as err:
        raise SuspectsError(f"{str(config)!r} is not the run config of a run ({err}); copy "
                            "the config.json from the run's folder with its model.pt") from None
    try:
        task = task_shape(cfg, str(config))
    except DatasetError:  # the run's data-path is not on this machine: DATA tells
        shape, k = read_header(str(data), f"DATA={str(data)!r}")
        task = TaskShape(shape, cfg.num_classes or k)
    try:
        samples = load_private_data(str(data), task, f"DATA={str(data)!r}")
        spec = make_spec(cfg, task, samples.x)
    except DatasetError as err:
        raise SuspectsError(f"{err}: DATA must be data of the run that trained {where}") \
            from None
    model = initial_model(cfg, task)
    try:
        model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    except (RuntimeError, OSError, ValueError, EOFError) as err:
        raise SuspectsError(f"{where} is not the model its config.json describes "
                            f"({str(err).splitlines()[0]}); copy model.pt and config.json "
                            "from the same run's folder") from None
    probs = predict_proba(model, torch.from_numpy(samples.x),
                          BatchTransform.of(spec, torch.device("cpu")))
    return rank(probs, samples.y, cfg.count_rule, cfg.weighting)
