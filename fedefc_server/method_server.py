"""What a method adds to the round pipeline: the server hooks (docs/ARCHITECTURE.md,
"A method's server").

The pipeline (:mod:`.pipeline`) runs every round the same way: plan -> send -> screen
-> aggregate -> evaluate -> record. A method changes it only through these hooks, each
called with explicit values and returning explicit values; a hook never reads what
another call left behind. The defaults add nothing: FedAvg, FedProx and FedDitto use
:class:`MethodServer` as it is (their differences are on the clients).

| step | hook | default |
| --- | --- | --- |
| plan | :meth:`before_round` (work between rounds, task messages) | nothing |
| plan | :meth:`sample` (which partitions train) | :func:`.plan.sample_round` |
| plan | :meth:`client_config` (keys of a client's fit config) | none |
| plan | :meth:`asks_accuracy` (the replies carry A_k) | never |
| screen | :meth:`check_metrics` (the method's own reply checks) | none |
| aggregate | :meth:`after_aggregate` (its server step, record fields) | FedAvg's model |
| record | :meth:`state_fields`, :meth:`describe`, :meth:`summary_fields`, :meth:`notes` | none |
| loop | :meth:`finished` (the run ends after this round) | never |
| checkpoint | :meth:`state`, :meth:`load_state`, :meth:`check_checkpoint` | nothing |
| checkpoint | :meth:`models`, :meth:`load_models` (models it keeps besides the global one) | none |

Whatever a hook must remember across rounds (FedEFC's prestopping rule, FedCorr's noise
estimates, RoFL's centroids) is the method's run state: it lives in the hooks object,
is returned by :meth:`state` for every checkpoint and restored by :meth:`load_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common import FitRes, Parameters, Scalar, parameters_to_ndarrays

from common.config import RunConfig
from common.models import ClassifierShape

from .guard import BestRead, ModelGuard, Phase2Guard, clean_reading
from .plan import sample_round

if TYPE_CHECKING:
    from .clean_set import CleanSet
    from .round_evaluation import Evaluator

# Send partitions task messages between rounds: {pid: task config} -> {pid: reply}
# (:mod:`.extra_messages`), bound to the round's nodes and global model.
TaskSender = Callable[[dict[int, dict[str, Scalar]]], dict[int, FitRes]]


@dataclass(frozen=True)
class Aggregated:
    """What a round's aggregation gives the method: the accepted replies as (partition
    id, reply) in id order, the new global parameters (None: the round was skipped and
    the global model is kept), the means of the metrics the clients summed under secure
    aggregation (docs/PRIVACY.md; empty in plain rounds) and the global model the round
    sent (``received``: the one its clients measured before training)."""

    round: int
    replies: list[tuple[int, FitRes]]
    parameters: Parameters | None
    secure_means: dict[str, float]
    secure: bool
    received: Parameters | None = None


class MethodServer:
    """A method's server hooks; every default adds nothing (module docstring)."""

    def __init__(self, cfg: RunConfig, model_shape: ClassifierShape):
        """``model_shape``: K and the feature width of the run's model (the methods that
        exchange per-class data need them)."""
        self.cfg = cfg
        self.model_shape = model_shape
        # the coordinator's clean validation set, measured and reported (docs/FEDEFC.md §3.9)
        self.clean: tuple[Evaluator, CleanSet] | None = None
        # what chooses the delivered model among those the run made, keeping the best in
        # every checkpoint: FedEFC's phase-2 guard, or with the clean set and deliver =
        # "best-read" the best read on it (docs/FEDEFC.md §3.4, §3.9)
        self.chooser: ModelGuard | None = None

    def read_clean_set(self, evaluator: Evaluator, clean: CleanSet) -> str:
        """Measure each round's new global model on the coordinator's clean validation set
        (``clean_acc`` in the round's record): FedAvg's view of the set a FedEFC run's
        guard reads, and FedAvg on the clients' data without it, the run such a FedEFC run
        pairs with (docs/FEDEFC.md §3.9). Nothing else changes. Returns what the server
        does with the set, in words, for the log."""
        self.clean = (evaluator, clean)
        if self.cfg.deliver == "best-read":
            self.chooser = BestRead(clean.summary)
            return (f"the server reads each round's model on {clean.summary} and delivers "
                    "the model that reads best where the set can tell (deliver=\"best-read\")")
        return f"the server reports each round's model's accuracy on {clean.summary}"

    # -- plan --------------------------------------------------------------------------
    def before_round(self, server_round: int, send_tasks: TaskSender,
                     partitions: list[int]) -> dict[str, Any]:
        """Work before ``server_round`` is sampled (``partitions``: those served now);
        returns fields for the round's record."""
        return {}

    def sample(self, server_round: int, available: list[int]) -> list[int]:
        """The partitions that train in ``server_round``, sorted."""
        return sample_round(self.cfg, available, server_round)

    def client_config(self, server_round: int, partition_id: int) -> dict[str, Scalar]:
        """Keys the method adds to a client's fit config (beyond round and seed)."""
        return {}

    def asks_accuracy(self, server_round: int) -> bool:
        """Whether the replies of ``server_round`` must carry A_k (docs/FEDEFC.md §3.1)."""
        return False

    # -- screen ------------------------------------------------------------------------
    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """Why the method cannot use a reply's metrics (None: it can); asked after the
        pipeline's own checks passed, a reason refuses the reply like theirs."""
        return None

    # -- aggregate ---------------------------------------------------------------------
    def after_aggregate(self, result: Aggregated) -> tuple[Parameters | None, dict[str, Any]]:
        """The method's server step after FedAvg (called for every round that reached
        aggregation, skipped ones included): the global parameters to keep (by default
        FedAvg's, ``result.parameters``) and fields for the round's record: the new
        model's accuracy on the coordinator's clean set where the run has one."""
        if self.clean is None or result.parameters is None:
            return result.parameters, {}
        if not isinstance(self.chooser, BestRead):
            return result.parameters, {
                "clean_acc": self.clean[0](parameters_to_ndarrays(result.parameters))[1]}
        read = clean_reading(self.clean, result.parameters, twinned=False)
        return self.chooser.choose(result.round, read, result.parameters,
                                   result.round == self.cfg.rounds), {"clean_acc": read.value}

    # -- record ------------------------------------------------------------------------
    def state_fields(self, server_round: int) -> dict[str, Any]:
        """Fields of the method's state that every record shows (round 0 included)."""
        return {}

    def describe(self, record: dict[str, Any]) -> str | None:
        """The round's log line after ``[round t/T]`` (None: the pipeline's)."""
        return None

    def summary_fields(self) -> dict[str, Any]:
        """What summary.json adds about the method: the clean set it reported on."""
        if self.clean is None:
            return {}
        chosen = {} if self.chooser is None else self.chooser.summary_fields()
        return {"clean_set": self.clean[1].summary, "deliver": self.cfg.deliver, **chosen}

    def notes(self) -> list[str]:
        """Plain-words remarks on a completed run that change how to read it (the last
        log lines and the summary's ``notes``)."""
        return [] if self.chooser is None else self.chooser.notes(self.cfg.rounds)

    # -- loop --------------------------------------------------------------------------
    def finished(self) -> bool:
        """Whether the run ends after the round just recorded (FedEFC's phase-2 guard,
        docs/FEDEFC.md §3.4), before its last round."""
        return False

    # -- checkpoint --------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything the method must remember to continue the run (JSON-serializable)."""
        return {} if self.chooser is None else {"chooser": asdict(self.chooser.rule)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` from a checkpoint."""
        if self.chooser is not None and "chooser" in state:
            self.chooser.rule = Phase2Guard(**state["chooser"])

    def models(self) -> dict[str, list[np.ndarray]]:
        """Models the method keeps besides the global one (name -> arrays), for the
        checkpoint."""
        return {} if self.chooser is None else self.chooser.models()

    def load_models(self, models: dict[str, list[np.ndarray]]) -> None:
        """Restore :meth:`models` from a checkpoint (after :meth:`load_state`)."""
        if self.chooser is not None:
            self.chooser.load_models(models)

    @classmethod
    def check_checkpoint(cls, state: dict[str, Any], cfg: RunConfig) -> None:
        """Refuse (``CheckpointError`` naming the keys) a checkpoint's method state that
        this config cannot continue; the launcher's preflight calls it before any Flower
        process starts, and :meth:`load_state` should too."""
