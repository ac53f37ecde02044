"""Central evaluation of the global model on the run dataset's clean test set, every round
(docs/FEDEFC.md §2.5)."""

from __future__ import annotations

import numpy as np

from common.config import RunConfig
from common.datasets import load_dataset
from common.params import set_weights
from common.runtime import model_for, on_device
from common.training import BatchTransform, evaluate, pick_device


class TestSetEvaluator:
    """Callable ``(weights) -> (loss, accuracy)`` on the dataset's clean test split."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.data = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
        self.device = pick_device(cfg.device)
        self.model = model_for(cfg, self.data, self.device, slot="server")
        self.x = on_device(self.data, "test", self.device)
        self.y = self.data.test_y.to(self.device)
        self.transform = BatchTransform(self.data.mean, self.data.std, self.device)

    def __call__(self, weights: list[np.ndarray]) -> tuple[float, float]:
        set_weights(self.model, weights)
        return evaluate(self.model, self.x, self.y, self.transform, self.cfg.eval_batch_size)
