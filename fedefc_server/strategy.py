"""Flower's Strategy for one round: the seam Flower's own machinery drives.

Flower's ``Server.fit_round`` and ``evaluate_round`` and its SecAgg+ workflow call a
``Strategy``: ``configure_fit`` before sending, ``aggregate_fit`` with the replies
(with their secure sum, under secure aggregation), ``evaluate`` for the server's test
set, ``configure_evaluate`` / ``aggregate_evaluate`` for the federated evaluation.
:class:`RoundStrategy` answers them for ONE round, over that round's
:class:`.plan.RoundPlan`, by calling the steps of :class:`.pipeline.RoundPipeline`: the
round loop builds one per round (:mod:`.round_loop`) and reads its results when Flower
is done. Nothing survives the round here: what a run keeps lives in the method's server
hooks (FedEFC's prestopping rule: :class:`.prestopping_server.PrestoppingServer`) and
the partition registry.

So FedEFC's accuracy aggregation, prestopping detection and phase switch happen through
this Strategy: ``configure_fit`` sends each client its phase, ``aggregate_fit`` averages
the phase-1 accuracies into A(t) and feeds the prestopping rule (paper Algorithm 1).
"""

from __future__ import annotations

from typing import Any

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from common.messages import FitReply

from .failures import Attributed, distinct_failures, is_rejection
from .pipeline import Collected, RoundOutcome, RoundPipeline, Screened
from .plan import RoundPlan
from .round_evaluation import EvaluationPlan
from .secure_sum import SecureSum


class RoundStrategy(Strategy):
    """The Strategy of round ``plan.round`` (``plan`` None: round 0, evaluation only)."""

    def __init__(self, pipeline: RoundPipeline, plan: RoundPlan | None):
        self.pipeline = pipeline
        self.plan = plan
        self.screened: Screened | None = None  # secure rounds: the masked replies' screen
        self.weight_total: int | None = None  # secure rounds: Q, read by .secure_round
        self.summing = False  # secure rounds: aggregate_fit has received the sum
        self.collected: Collected | None = None  # secure rounds: after aggregate_fit
        self.outcome: RoundOutcome | None = None  # plain rounds: after aggregate_fit
        self.evaluation: EvaluationPlan | None = None  # after configure_evaluate
        self.federated: dict[str, Any] = {}  # after aggregate_evaluate: record fields

    def __repr__(self) -> str:
        cfg = self.pipeline.cfg
        return f"RoundStrategy(method={cfg.method}, seed={cfg.seed})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The round loop holds the global model (from the run's start or a checkpoint)."""
        return None

    # -- training ----------------------------------------------------------------------
    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        """The plan's instructions (sampled and configured by the pipeline's plan step);
        in a plain round each node's proxy names the node and its partition in its
        failures (:class:`.failures.Attributed`; SecAgg+ sends its own messages)."""
        if self.pipeline.secure:
            return list(self.plan.instructions)
        return self.attributed(self.plan.instructions)

    def attributed(self, instructions: list[tuple[ClientProxy, Any]]
                   ) -> list[tuple[ClientProxy, Any]]:
        partition_of = self.pipeline.registry.partition_of
        return [(Attributed(proxy, partition_of(proxy.cid)), ins)
                for proxy, ins in instructions]

    def screen_masked(self, results: list[tuple[ClientProxy, FitRes]]
                      ) -> list[tuple[ClientProxy, FitRes]]:
        """Secure rounds: screen the masked replies before SecAgg+ sums them; the
        accepted ones (:mod:`.secure_round`)."""
        self.screened = self.pipeline.screen(self.plan, results)
        return self.screened.accepted

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException],
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Plain rounds: screen, then aggregate. Secure rounds: ``results`` passed
        :meth:`screen_masked` and each carries the sum as its parameters (its weight
        total is :attr:`weight_total`); ``failures`` include the replies the secure
        round's grid refused, which it recorded. A secure round only collects them
        (:attr:`collected`): :class:`.secure_round.SecureRound` aggregates the sums of
        all its groups at once."""
        if self.pipeline.secure:
            self.summing = True
            failures = [f for f in distinct_failures(failures) if not is_rejection(f)]
            accepted = sorted(results, key=lambda r: int(r[1].metrics[FitReply.PARTITION_ID]))
            pids = tuple(int(res.metrics[FitReply.PARTITION_ID]) for _, res in accepted)
            self.collected = Collected(
                Screened(accepted, self.screened.rejected if self.screened else []), failures,
                SecureSum(results[0][1].parameters, self.weight_total, pids) if results
                else None)
            return None, {}
        screened = self.pipeline.screen(self.plan, results)
        self.outcome = self.pipeline.aggregate(self.plan, screened, failures)
        return self.outcome.parameters, {}

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Scalar]] | None:
        """The global model's (loss, {"accuracy"}) on the server's test set, if any."""
        evaluated = self.pipeline.evaluation.central(parameters)
        return None if evaluated is None else (evaluated[0], {"accuracy": evaluated[1]})

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Every node serving a partition evaluates the global model on its held-out
        data (none without federated evaluation)."""
        self.evaluation = self.pipeline.evaluation.plan(server_round, parameters,
                                                         client_manager)
        return [] if self.evaluation is None else self.attributed(self.evaluation.instructions)

    def aggregate_evaluate(self, server_round: int,
                           results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
                           ) -> tuple[float | None, dict[str, Scalar]]:
        """The held-out loss and accuracies (:meth:`.round_evaluation.RoundEvaluation.
        close`)."""
        self.federated, loss, metrics = self.pipeline.evaluation.close(
            self.evaluation, results, failures)
        return loss, metrics
