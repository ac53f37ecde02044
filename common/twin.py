"""The global model and its twin (``twin-model``; docs/FEDEFC.md §3.8).

Where every client trains in every round, FedEFC's clients keep a validation share out
of training (docs/FEDEFC.md §3.1). With a twin, each client trains two models from one
global pair: the **probe**, FedEFC as before (the share kept out, A(t) and Q read on it,
the phase-2 guard judging it), and the **twin**, trained on all of the client's data,
the share included: cross-entropy in phase 1 (FedAvg's update), and in phase 2 the
forward-corrected loss with the Q the client counted with its probe that round. The twin
is the model the run delivers: the server's test set, federated evaluation and
``model.pt`` read it, and the guard's verdict on the probe restores both.

The run's parameters are the twin's arrays followed by the probe's, so aggregation,
screening, secure sums, the guard and checkpoints treat the pair as one model.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def paired(weights: list[T]) -> list[T]:
    """The pair of round 0: the twin and the probe start from the same model."""
    return [*weights, *weights]


def halves(arrays: list[T]) -> tuple[list[T], list[T]]:
    """(the twin's arrays, the probe's) of a pair; ValueError for an odd count."""
    if len(arrays) % 2:
        raise ValueError(f"a model pair holds an even number of arrays, not {len(arrays)}")
    half = len(arrays) // 2
    return arrays[:half], arrays[half:]


def delivered(arrays: list[T], twinned: bool) -> list[T]:
    """The arrays of the model the run delivers: the twin's of a pair, else all."""
    return halves(arrays)[0] if twinned else arrays
