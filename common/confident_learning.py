"""Confident learning, FL-adapted (ALGORITHM.md section 5): cleanlab's own filter."""

from __future__ import annotations

import numpy as np


def label_issue_mask(labels: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """True for the samples cleanlab flags with ``filter_by="both"`` (single process).

    A client whose (noisy) labels hold fewer than two distinct classes (or no sample)
    keeps every sample (an all-False mask): confident learning compares a sample's
    label with the other classes' thresholds, which needs at least two observed classes
    (cleanlab refuses such labels with a ValueError)."""
    from cleanlab.filter import find_label_issues  # lazily: a ClientApp process starts fast

    labels = np.asarray(labels, dtype=np.int64)
    if len(np.unique(labels)) < 2:
        return np.zeros(len(labels), dtype=bool)
    return np.asarray(find_label_issues(labels, probs, filter_by="both", n_jobs=1), dtype=bool)
