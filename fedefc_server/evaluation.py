"""Central evaluation of the global model on the server's test set, every round
(docs/FEDEFC.md §2.5): the paper datasets' clean test split, or the run's ``test-path``."""

from __future__ import annotations

import numpy as np

from common.config import RunConfig
from common.datasets import Dataset
from common.params import set_weights
from common.runtime import model_for, on_device
from common.training import BatchTransform, evaluate, pick_device


class TestSetEvaluator:
    """Callable ``(weights) -> (loss, accuracy)`` on the dataset's test split."""

    def __init__(self, cfg: RunConfig, data: Dataset):
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.model = model_for(cfg, data.task, self.device, slot="server")
        self.x = on_device(data, "test", self.device)
        self.y = data.test_y.to(self.device)
        self.transform = BatchTransform.of(data.spec, self.device)

    def __call__(self, weights: list[np.ndarray]) -> tuple[float, float]:
        set_weights(self.model, weights)
        return evaluate(self.model, self.x, self.y, self.transform, self.cfg.eval_batch_size)
