"""Confident learning (Northcutt et al., JAIR 2021), FL-adapted: after prestopping each
client drops the samples cleanlab's own filter flags (docs/BASELINE-METHODS.md,
"Forward correction and confident learning")."""

from __future__ import annotations

import numpy as np


class ConfidentLearningMessages:
    """What confident learning's phase-2 replies add (docs/BASELINE-METHODS.md)."""

    KEPT = "kept"  # int: samples trained on (also the reply's sample count)
    REMOVED = "removed"  # int: samples cleanlab flagged


def label_issue_mask(labels: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """True for the samples cleanlab flags with ``filter_by="both"`` (single process).

    A client whose (noisy) labels hold fewer than two distinct classes (or no sample)
    keeps every sample (an all-False mask): confident learning compares a sample's
    label with the other classes' thresholds, which needs at least two observed classes
    (cleanlab refuses such labels with a ValueError)."""
    # lazily: cleanlab adds 0.9 s to the start of every ClientApp process (a SuperNode
    # starts one per message), and only confident learning's phase 2 needs it
    from cleanlab.filter import find_label_issues  # 0.9 s

    labels = np.asarray(labels, dtype=np.int64)
    if len(np.unique(labels)) < 2:
        return np.zeros(len(labels), dtype=bool)
    return np.asarray(find_label_issues(labels, probs, filter_by="both", n_jobs=1), dtype=bool)
