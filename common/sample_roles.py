"""One record of the roles of a client's samples (docs/FEDEFC.md §3.1, §3.6-§3.8), built
once per client from the run config, its partition id and size (and the ``verified``
mask where its data has one); the one place that reads the options which place samples
(``validation-fraction``, ``validation-labels``, ``estimation-share``,
``validation-phase-2``, the twin's rule).

Of a client's ``n`` samples, with federated evaluation a seeded ``local-test-fraction``
is held out (docs/OWN-DATA.md, "Federated evaluation") and the rest is its training
part, the size it declares. Within the training part (positions below are positions in
it): the validation share of the held-out accuracy signal (§3.1), its guard slice
(every second position, §3.6), with ``validation-labels = "verified"`` a share of
checked labels and beside it the estimation share Q is counted on (§3.7). Which of
them a round trains on depends on the phase and ``validation-phase-2``; the twin trains
on all but the guard slice (§3.8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from common.config import RunConfig
from common.data_files import PrivateDataError
from common.fedefc_plan import twin_reads_slice
from common.methods import validation_share
from common.seeds import derive_seed


# the roles drawn from a seeded generator each: the held-out part, the validation share,
# the estimation share
DRAWS = ("local-test", "validation", "estimation")


def held_out_count(cfg: RunConfig, n: int) -> int:
    """How many of a client's ``n`` samples it holds out for federated evaluation:
    round(local-test-fraction * n), at most n - 1; 0 without federated evaluation
    (docs/OWN-DATA.md, "Federated evaluation")."""
    if not cfg.federated_evaluation:
        return 0
    return min(int(round(cfg.local_test_fraction * n)), max(n - 1, 0))


def training_size(cfg: RunConfig, n: int) -> int:
    """The samples a client with ``n`` samples trains on: the size it declares and
    every reply of it counts (docs/PRIVACY.md, "Weights bound to facts"). The
    validation share of the held-out accuracy signal is part of it (docs/FEDEFC.md
    §3.1): a reply's weight is the client's data size in every round."""
    return n - held_out_count(cfg, n)


def validation_count(share: float, cap: int, m: int) -> int:
    """How many of the ``m`` samples a client trains on form its validation share
    (docs/FEDEFC.md §3.1): round(share * m), at most ``cap`` (0: no cap), at least 1 and
    at most m - 1."""
    count = int(round(share * m))
    if cap:
        count = min(count, cap)
    return min(max(count, 1), m - 1)


def declared_sizes(cfg: RunConfig, n: int) -> tuple[int, int]:
    """(training size, held-out count) a client with ``n`` samples declares, without
    drawing its positions: what the registry checks a declaration against
    (docs/PRIVACY.md, "Weights bound to facts"); :attr:`SampleRoles.declared` alike."""
    return training_size(cfg, n), held_out_count(cfg, n)


def roles_key(cfg: RunConfig) -> tuple:
    """What :meth:`SampleRoles.build` reads of the run config beyond its seed and data:
    the part of a cache key for a client's data that its roles add."""
    return (cfg.evaluation_mode, cfg.local_test_fraction, validation_share(cfg),
            cfg.validation_max_per_class, cfg.validation_labels, cfg.estimation_share,
            cfg.validation_phase_2, twin_reads_slice(cfg))


def share_count(cfg: RunConfig, m: int, num_classes: int) -> int:
    """How many of the ``m`` samples a client trains on form its validation share, where
    the run keeps one (docs/FEDEFC.md §3.1, §3.6: :func:`validation_count` of
    ``validation-fraction``, at most ``validation-max-per-class`` per class); the server
    reads it off a reply's sample count."""
    return validation_count(cfg.validation_fraction, cfg.validation_max_per_class * num_classes,
                            m)


def verified_labels(cfg: RunConfig) -> bool:
    """Whether the validation share's labels are checked ones (docs/FEDEFC.md §3.7)."""
    return cfg.validation_labels == "verified"


@dataclass(frozen=True)
class SampleRoles:
    """The roles of a client's ``n`` samples (module docstring). ``train`` and
    ``held_out`` are sorted positions among the ``n`` (``held_out`` None without
    federated evaluation); ``share`` (the validation share, None without one) and
    ``estimation`` (None without one) are sorted positions within the training part."""

    n: int
    train: np.ndarray
    held_out: np.ndarray | None
    share: np.ndarray | None
    estimation: np.ndarray | None
    verified: bool  # the share's labels are checked ones (§3.7)
    phase_2: str  # validation-phase-2: "estimate", "train" or "guard-slice" (§3.1, §3.6)
    twin_slice: bool  # the twin keeps the guard slice out of training (§3.8)

    @classmethod
    def build(cls, cfg: RunConfig, partition_id: int, n: int, num_classes: int,
              verified: np.ndarray | None = None, simulated: bool = True,
              where: str = "") -> SampleRoles:
        """The roles of partition ``partition_id``'s ``n`` samples, each drawn with a
        generator seeded by (seed, its name in :data:`DRAWS`, partition id): the held-out
        part (``"local-test"``: :func:`held_out_count`), the validation share among the
        m samples trained on (``"validation"``: :func:`share_count` of them; none when
        the run keeps no share, ``common/methods.py: validation_share``, or m < 2), and
        with verified labels the estimation share (``"estimation"``:
        round(estimation-share * r) of the r samples outside the share, none when r < 2).
        With verified labels the share is the samples the ``verified`` mask (over the
        ``n``) names, where there is one; without one a ``simulated`` client (true labels
        known) keeps the seeded share, its labels to be checked, and a node's own data is
        refused (PrivateDataError naming ``where``)."""
        rng = {name: np.random.default_rng(derive_seed(cfg.seed, name, partition_id))
               for name in DRAWS}
        keeps_share, twin_slice = validation_share(cfg) != 0.0, twin_reads_slice(cfg)
        held = None
        train = np.arange(n)
        if cfg.federated_evaluation:
            perm = rng["local-test"].permutation(n)
            count = held_out_count(cfg, n)
            train, held = np.sort(perm[count:]), np.sort(perm[:count])
        m = len(train)
        share = None
        if keeps_share and m >= 2:
            share = np.sort(rng["validation"].permutation(m)[:share_count(cfg, m, num_classes)])
        checked = verified_labels(cfg)
        if checked and share is not None and not (simulated and verified is None):
            share = _marked(None if verified is None else
                            verified if held is None else verified[train], m, where)
        estimation = None
        if checked and cfg.estimation_share and share is not None:
            estimation = _estimation_share(cfg.estimation_share, rng["estimation"], share, m)
        return cls(n, train, held, share, estimation, checked, cfg.validation_phase_2,
                   twin_slice)

    @property
    def declared(self) -> tuple[int, int]:
        """(training size, held-out count): what the client's node declares; the share
        is part of the training size (docs/FEDEFC.md §3.1)."""
        return len(self.train), 0 if self.held_out is None else len(self.held_out)

    @property
    def guard_slice(self) -> np.ndarray | None:
        """The half of the share that stays out of training in phase 2 with
        ``validation-phase-2 = "guard-slice"`` and that the twin never trains on: every
        second position, the first included (the share is a seeded draw, so its every
        second position is one too); all of a 1-sample share (docs/FEDEFC.md §3.6)."""
        return None if self.share is None else self.share[::2]

    def guard(self, phase: int | None) -> np.ndarray | None:
        """The samples A_k is read on in ``phase``: the share, or its guard slice in
        phase 2 with ``validation-phase-2 = "guard-slice"`` (§3.6); None without one."""
        return self.guard_slice if phase == 2 and self.phase_2 == "guard-slice" else self.share

    def held_back(self, phase: int | None) -> np.ndarray | None:
        """Positions not trained on in ``phase`` (None: all trained on; a method without
        phases keeps no share out): the share in phase 1, and in phase 2 unless
        ``validation-phase-2 = "train"`` (§3.1), or only its guard slice with
        ``"guard-slice"`` (§3.6); beside a verified share also the estimation share, in
        both phases (§3.7)."""
        val = self.guard(phase)
        if val is None or phase is None or (phase == 2 and self.phase_2 == "train"):
            return None
        return val if self.estimation is None else np.union1d(val, self.estimation)

    def trained_on(self, phase: int | None) -> np.ndarray:
        """The sorted positions trained on in ``phase``: the training part less
        :meth:`held_back`."""
        keep = np.ones(len(self.train), dtype=bool)
        held = self.held_back(phase)
        if held is not None:
            keep[held] = False
        return np.flatnonzero(keep)

    def counted(self, phase: int | None) -> np.ndarray:
        """The samples whose predictions Q is counted on in phase 2: the estimation
        share where there is one; beside any other verified share the samples trained
        on (its labels carry no noise to count, §3.7); else the samples held back (the
        share with ``"estimate"``, its guard slice with ``"guard-slice"``, §3.6), or all
        of them (docs/FEDEFC.md §4)."""
        if self.estimation is not None:
            return self.estimation
        if self.verified and self.share is not None:
            return self.trained_on(phase)
        held = self.held_back(phase)
        return np.arange(len(self.train)) if held is None else held

    def twin(self) -> SampleRoles:
        """The twin's roles (docs/FEDEFC.md §3.8): where the guard reads the clients its
        share is the guard slice, which it never trains on and is read on (the delivered
        model's guard signal, §3.4); else (the guard reads the coordinator's clean set,
        §3.9) none. The rest of the share and the estimation share are trained on."""
        return replace(self, share=self.guard_slice if self.twin_slice else None,
                       estimation=None)

    def checked_mask(self) -> np.ndarray | None:
        """The mask, over the ``n`` samples, of the verified share; None without one.
        What ``fedefc deploy export`` marks ``verified``, so that a node holding the
        export has the simulation's share (§3.7)."""
        if not self.verified or self.share is None:
            return None
        mask = np.zeros(self.n, dtype=bool)
        mask[self.train[self.share]] = True
        return mask


def _marked(verified: np.ndarray | None, m: int, where: str) -> np.ndarray:
    """The positions a node's ``verified`` mask over its ``m`` training samples names:
    at least one, and not all (docs/OWN-DATA.md, "Verified labels")."""
    if verified is None or not verified.any():
        raise PrivateDataError(
            f"{where}: validation-labels=\"verified\" but the data names no verified "
            "sample; store a boolean array 'verified' beside 'labels' (True where the "
            "label was checked; docs/OWN-DATA.md, \"Verified labels\"), or set "
            "validation-labels=\"observed\"")
    positions = np.flatnonzero(verified)
    if len(positions) >= m:
        raise PrivateDataError(
            f"{where}: all {m} samples it trains on are verified, so none is left "
            "to train on; mark only a sample of them verified (docs/OWN-DATA.md, "
            "\"Verified labels\")")
    return positions


def _estimation_share(fraction: float, rng: np.random.Generator, share: np.ndarray,
                      m: int) -> np.ndarray | None:
    """The estimation share among the ``m`` samples outside ``share``, drawn with
    ``rng`` (:meth:`SampleRoles.build`; ``fraction`` of the r others, at least 1, at most
    r - 1)."""
    rest = np.setdiff1d(np.arange(m), share)
    if len(rest) < 2:
        return None
    count = validation_count(fraction, 0, len(rest))
    return np.sort(rest[rng.permutation(len(rest))[:count]])
