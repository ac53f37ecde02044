"""Confident learning, FL-adapted (ALGORITHM.md section 5): cleanlab's own filter."""

from __future__ import annotations

import numpy as np


def label_issue_mask(labels: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """True for the samples cleanlab flags with ``filter_by="both"`` (single process)."""
    from cleanlab.filter import find_label_issues  # lazily: a ClientApp process starts fast

    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) == 0:
        return np.zeros(0, dtype=bool)
    return np.asarray(find_label_issues(labels, probs, filter_by="both", n_jobs=1), dtype=bool)
