"""Central evaluation of the global model on the server's test set, every round
(docs/FEDEFC.md §2.5): the paper datasets' clean test split, or the run's ``test-path``;
and on the coordinator's clean validation set, which the phase-2 guard reads
(:mod:`.clean_set`, docs/FEDEFC.md §3.9)."""

from __future__ import annotations

import numpy as np
import torch

from common.config import RunConfig
from common.datasets import Dataset
from common.params import set_weights
from common.runtime import model_for, on_device
from common.training import BatchTransform, evaluate, pick_device, predict_proba


class TestSetEvaluator:
    """Callable ``(weights) -> (loss, accuracy)`` on the dataset's test split, or on
    ``samples`` (inputs, labels) of its kind: the coordinator's clean validation set."""

    def __init__(self, cfg: RunConfig, data: Dataset,
                 samples: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.model = model_for(cfg, data.task, self.device, slot="server")
        if samples is None:
            self.x = on_device(data, "test", self.device)
            self.y = data.test_y.to(self.device)
        else:
            self.x, self.y = (t.to(self.device) for t in samples)
        self.transform = BatchTransform.of(data.spec, self.device)

    def __call__(self, weights: list[np.ndarray]) -> tuple[float, float]:
        set_weights(self.model, weights)
        return evaluate(self.model, self.x, self.y, self.transform, self.cfg.eval_batch_size)

    def correct(self, weights: list[np.ndarray]) -> np.ndarray:
        """Which samples the model of ``weights`` gets right (its argmax against the
        labels): the phase-2 guard's paired reading on the coordinator's clean set."""
        set_weights(self.model, weights)
        probs = predict_proba(self.model, self.x, self.transform, self.cfg.eval_batch_size)
        return probs.argmax(1) == self.y.cpu().numpy()
