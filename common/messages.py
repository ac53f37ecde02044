"""The keys of the messages both apps exchange, named once (docs/ARCHITECTURE.md, "What
each message carries"), and what a reply's metrics must be.

The core's keys are here; a compared method names its own in its module
(``common/baselines/fedcorr.py: FedCorrMessages``, ...) and declares the metrics its
training replies carry in its registry entry (:mod:`common.methods`), as
:class:`ReplyMetric` values: the server checks every declared metric a reply holds and
folds it into the round record as the entry says; nothing else is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class FitConfig:
    """Server -> client: what every training message tells its client."""

    ROUND = "round"  # int: the server round
    SEED = "seed"  # int: the client's seed, derived from (run seed, partition id, round)
    PHASE = "phase"  # int 1 | 2: FedEFC's phase (methods with a prestopping point only)


class Declaration:
    """Node -> server, once per node (``get_properties``): what the node serves."""

    PARTITION_ID = "partition-id"  # int
    NUM_EXAMPLES = "num-examples"  # int: the samples it trains on (docs/PRIVACY.md)
    HELD_OUT = "held-out"  # int: the samples it holds out for federated evaluation
    DATA = "data"  # str: PARTITION (of the run's dataset) | PRIVATE (the node's own)
    # str, only where the node's own data names its classes (data.npz's class_names): K
    # and a hash of the names in index order (common/data_files.py:
    # class_map_fingerprint), never the names; every node's must be the same
    # (docs/OWN-DATA.md, "Preparing a folder of images")
    CLASS_MAP = "class-map"
    PARTITION = "partition"
    PRIVATE = "private"
    KINDS = (PARTITION, PRIVATE)


class FitReply:
    """Client -> server: the metrics of a training reply (beside weights and count)."""

    PARTITION_ID = "partition-id"  # int: every reply
    LOSS = "loss"  # str: the name of the loss the client trained with
    TRAIN_LOSS = "train-loss"  # float: mean training loss
    FIT_S = "fit-s"  # float: local compute seconds
    # float in [0, 1]: A_k in phase 1 (docs/FEDEFC.md §3.1), and in phase 2 where the
    # phase-2 guard watches the held-out accuracy (§3.4)
    ACCURACY = "accuracy"
    # float in [0, 1]: with a twin, the twin's reading on its guard slice, the samples
    # neither model trains on (the delivered model's guard signal, docs/FEDEFC.md §3.4, §3.8)
    GUARD_ACCURACY = "guard-accuracy"
    # simulation diagnostics (diagnostics = true, the simulator's truth; docs/FEDEFC.md §5)
    NOISE_RATE = "noise-rate"  # float: the client's realized flip rate
    Q_COS = "q-cos"  # float: cosine similarity of Q and the true noise matrix (phase 2)
    Q_L1 = "q-l1"  # float: their L1 distance


class EvaluateReply:
    """Client -> server: the metrics of a federated-evaluation reply (docs/OWN-DATA.md)."""

    PARTITION_ID = "partition-id"  # int
    ACCURACY = "accuracy"  # float in [0, 1]: against the held-out samples' observed labels
    TRUE_ACCURACY = "true-accuracy"  # float in [0, 1]: against their true labels (simulation)


def carries_accuracy(phase: int | None, guarded: bool = False) -> bool:
    """The accuracy rule: a training reply carries A_k in FedEFC's phase 1
    (docs/FEDEFC.md §3.1), and in phase 2 when the run's phase-2 guard is on (``guarded``:
    ``phase-2-guard`` resolved, §3.4). The server asks by sending the phase; the client,
    which knows the run config, answers."""
    return phase == 1 or (phase == 2 and guarded)


Fold = Literal["mean", "sum", "per-client"]


@dataclass(frozen=True)
class ReplyMetric:
    """A metric a training reply may carry: ``count`` (an integer >= 0) or ``number`` (a
    finite number), and how the round record keeps it (``fold``): the mean over the
    round's accepted replies (``None`` when none carries it), their sum, or one value per
    client; none of these (``()``) when the method's server records it itself. The
    record's field is the key with ``_`` for ``-`` (``_clients`` appended to a per-client
    list beside a mean)."""

    key: str
    kind: Literal["number", "count"] = "number"
    fold: tuple[Fold, ...] = ("mean",)

    @property
    def field(self) -> str:
        return self.key.replace("-", "_")


# What every method's training replies may carry, beyond the partition id and the loss
# name (both always there) and the accuracy A_k (checked by the accuracy rule).
CORE_REPLY = (
    ReplyMetric(FitReply.Q_COS, fold=("mean", "per-client")),
    ReplyMetric(FitReply.Q_L1),
    ReplyMetric(FitReply.NOISE_RATE),
    ReplyMetric(FitReply.TRAIN_LOSS),
    ReplyMetric(FitReply.FIT_S, fold=("per-client",)),
)
