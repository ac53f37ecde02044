"""Synthetic label noise with cleanlab (docs/FEDEFC.md §1.1).

One noise matrix ``NM[i][j] = P(noisy=i | true=j)`` (columns sum to 1) per noise
group, drawn by ``cleanlab.benchmarking.noise_generation`` with trace ``K(1-rho)``
and a fraction ``zeta`` of zero off-diagonal noise rates. cleanlab draws from
NumPy's global generator; the functions here seed it and restore it afterwards,
so they are pure functions of their arguments.

:func:`reference_noise` reproduces the authors' reference code, which draws the matrix
and then the noisy labels of the whole training set from ONE stream of that generator,
seeded by the matrix call (docs/FEDEFC.md §1.1).
"""

from __future__ import annotations

import contextlib

import numpy as np

from .transition import column_normalize


class NoiseError(ValueError):
    """No valid noise matrix exists for the requested (rho, zeta)."""


@contextlib.contextmanager
def _seeded_global_numpy(seed: int):
    state = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        np.random.set_state(state)


def noise_matrix(num_classes: int, rho: float, zeta: float, prior: np.ndarray,
                 seed: int) -> np.ndarray:
    """The K x K column-stochastic noise matrix for (rho, zeta); identity when rho = 0."""
    if rho == 0.0:
        return np.eye(num_classes)
    if zeta >= 1.0:
        raise NoiseError(f"zeta={zeta} leaves no off-diagonal noise rate for rho={rho}>0")
    trace = _trace(num_classes, rho)
    # lazily: cleanlab adds 0.9 s to the start of every ClientApp process (a SuperNode
    # starts one per message), which never needs it once its data is cached on disk
    from cleanlab.benchmarking.noise_generation import generate_noise_matrix_from_trace  # 0.9 s

    with _seeded_global_numpy(seed):
        nm = generate_noise_matrix_from_trace(
            num_classes, trace, py=np.asarray(prior, dtype=float),
            frac_zero_noise_rates=zeta, valid_noise_matrix=True, seed=seed % 2**32,
        )
    return _checked(nm, num_classes, rho, zeta)


def reference_noise(true_labels: np.ndarray, num_classes: int, rho: float, zeta: float,
                    prior: np.ndarray, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    """(NM, noisy labels) as the reference code draws them: the matrix with cleanlab's
    ``seed`` (42 there, whatever the trial), then the flips of ``true_labels`` (the whole
    training set, in its order) from the same NumPy stream, without reseeding."""
    if rho == 0.0:
        return np.eye(num_classes), np.asarray(true_labels).copy()
    trace = _trace(num_classes, rho)
    from cleanlab.benchmarking.noise_generation import (  # 0.9 s, lazily (noise_matrix)
        generate_noise_matrix_from_trace,
        generate_noisy_labels,
    )

    true_labels = np.asarray(true_labels)
    with _seeded_global_numpy(seed):
        nm = _checked(generate_noise_matrix_from_trace(
            num_classes, trace, py=np.asarray(prior, dtype=float),
            frac_zero_noise_rates=zeta, valid_noise_matrix=True, seed=seed % 2**32),
            num_classes, rho, zeta)
        noisy = np.asarray(generate_noisy_labels(true_labels, nm), dtype=true_labels.dtype)
    return nm, noisy


def _trace(num_classes: int, rho: float) -> float:
    """K(1 - rho), refused when cleanlab cannot build a matrix with it."""
    trace = num_classes * (1.0 - rho)
    if trace <= 1.0:
        raise NoiseError(
            f"rho={rho} gives trace {trace:.3f} <= 1 for K={num_classes}; cleanlab needs "
            f"trace > 1 for a learnable noise matrix: use rho < {1 - 1 / num_classes:.3f}"
        )
    return trace


def _checked(nm: np.ndarray | None, num_classes: int, rho: float, zeta: float) -> np.ndarray:
    """cleanlab's matrix, or NoiseError when it found none or fewer zeros than asked."""
    if nm is None:
        raise NoiseError(
            f"cleanlab found no valid noise matrix for rho={rho}, zeta={zeta} "
            f"(K={num_classes}); lower rho or zeta, or try another seed"
        )
    wanted = int(num_classes * (num_classes - 1) * zeta)
    if zero_off_diagonals(nm) < wanted:
        limit = (num_classes - 2) / (num_classes - 1)
        raise NoiseError(
            f"zeta={zeta} asks for {wanted} zero noise rates but every noisy class keeps at "
            f"least one (K={num_classes}), so at most {zero_off_diagonals(nm)} are possible: "
            f"use zeta <= {limit:.3f} with rho={rho}"
        )
    return nm


def apply_noise(true_labels: np.ndarray, nm: np.ndarray, seed: int) -> np.ndarray:
    """Noisy labels drawn from ``nm`` given the true labels (cleanlab's generator)."""
    true_labels = np.asarray(true_labels)
    if np.allclose(nm, np.eye(len(nm))) or len(true_labels) == 0:
        return true_labels.copy()
    from cleanlab.benchmarking.noise_generation import generate_noisy_labels  # 0.9 s, lazily

    with _seeded_global_numpy(seed):
        return np.asarray(generate_noisy_labels(true_labels, nm), dtype=true_labels.dtype)


def zero_off_diagonals(nm: np.ndarray) -> int:
    """How many off-diagonal entries of ``nm`` are exactly zero."""
    off = ~np.eye(len(nm), dtype=bool)
    return int(np.count_nonzero(nm[off] == 0))


def empirical_transition(noisy: np.ndarray, true: np.ndarray, num_classes: int) -> np.ndarray:
    """The realized ``P(noisy=i | true=j)`` of a label set; a class absent from ``true``
    gives e_j."""
    counts = np.zeros((num_classes, num_classes))
    np.add.at(counts, (np.asarray(noisy), np.asarray(true)), 1.0)
    return column_normalize(counts)
