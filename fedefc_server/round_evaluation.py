"""The evaluate step of a round (docs/ARCHITECTURE.md, "One round"): the global model on
the server's test set, and with federated evaluation on every node's held-out data.

:class:`RoundEvaluation` holds what a run fixes (the config, the run's federation and its
partition registry, the server's test set) and no state of any round:
:meth:`~RoundEvaluation.plan` says which nodes evaluate (every node serving a
partition), :meth:`~RoundEvaluation.close` screens their replies
(:func:`.validation.check_evaluate_reply`; failures and refusals recorded with their
reasons, and the partitions that missed the evaluation named: :mod:`.attendance`) and
averages them weighted by the held-out counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy.aggregate import weighted_loss_avg

from common.config import RunConfig
from common.messages import EvaluateReply, FitConfig
from common.twin import delivered, halves

from .attendance import absent_among
from .failures import attributed_failures, describe_failures
from .federation import Federation
from .registry_report import absences
from .validation import check_evaluate_reply, sort_replies

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]  # weights -> (loss, accuracy)


@dataclass(frozen=True)
class EvaluationPlan:
    """A federated evaluation: the (node, EvaluateIns) pairs and the partitions asked."""

    round: int
    instructions: list[tuple[ClientProxy, EvaluateIns]]
    partitions: frozenset[int]


def evaluation_text(record: dict[str, Any]) -> str:
    """The evaluations a round's record holds, for its log line: the server's test set
    and/or the clients' held-out data (with the true-label diagnostic, if any)."""
    parts = []
    if "test_acc" in record:
        parts.append(f"test acc {record['test_acc']:.4f}  loss {record['test_loss']:.4f}")
    if "federated_acc" in record:
        acc = record["federated_acc"]
        if acc is None:
            parts.append("federated acc n/a (no held-out replies)")
        else:
            true = record.get("federated_true_acc")
            parts.append(f"federated acc {acc:.4f}  loss {record['federated_loss']:.4f}"
                         + ("" if true is None else f" (true labels {true:.4f})"))
    return " | ".join(parts) or "no evaluation"


class RoundEvaluation:
    """The evaluate step of every round of one run (module docstring)."""

    def __init__(self, cfg: RunConfig, federation: Federation,
                 evaluator: Evaluator | None = None):
        self.cfg = cfg
        self.federation = federation
        self.evaluator = evaluator

    def central(self, parameters: Parameters) -> tuple[float, float] | None:
        """The global model's (loss, accuracy) on the server's test set, if any: with a
        twin, the twin's (docs/FEDEFC.md §3.8)."""
        if self.evaluator is None:
            return None
        return self.evaluator(delivered(parameters_to_ndarrays(parameters), self.cfg.twinned))

    def plan(self, server_round: int, parameters: Parameters,
             client_manager: ClientManager) -> EvaluationPlan | None:
        """Every node serving a partition evaluates the global model on its held-out
        data (None without federated evaluation)."""
        if not self.cfg.federated_evaluation:
            return None
        serving = self.federation.serving(client_manager, server_round)
        serving = {pid: serving[pid]
                   for pid in self.federation.registry.declare(list(serving), server_round)}
        if self.cfg.twinned:  # the nodes evaluate the model the run delivers (§3.8)
            parameters = ndarrays_to_parameters(halves(parameters_to_ndarrays(parameters))[0])
        ins = EvaluateIns(parameters, {FitConfig.ROUND: server_round})
        return EvaluationPlan(server_round, [(serving[pid], ins) for pid in sorted(serving)],
                              frozenset(serving))

    def close(self, plan: EvaluationPlan, results: list[tuple[ClientProxy, EvaluateRes]],
              failures: list) -> tuple[dict[str, Any], float | None, dict[str, Scalar]]:
        """(record fields, loss, metrics): the held-out loss and accuracies averaged,
        weighted by the held-out sample counts, over the valid replies that hold samples
        (partition-id order); the partitions that missed it, named
        (``federated_missing``)."""
        seen: set[int] = set()
        registry = self.federation.registry
        valid, rejected = sort_replies(
            plan.round, "evaluation reply", results, registry.partition_of,
            lambda res, node_pid: check_evaluate_reply(res, plan.partitions, seen,
                                                       registry.held_out.get(node_pid),
                                                       node_pid))
        failed = describe_failures(plan.round, "client evaluation", failures)
        held = sorted((r for _, r in valid if r.num_examples > 0),
                      key=lambda r: int(r.metrics[EvaluateReply.PARTITION_ID]))
        missing = self.missing(plan, valid, rejected, failures)
        fields: dict[str, Any] = {
            **({"federated_missing": missing} if missing else {}),
            "federated_acc": None, "federated_loss": None,
            "federated_clients": len(held),
            "federated_samples": int(sum(r.num_examples for r in held)),
            "federated_failures": len(failed), "federated_failure_reasons": failed,
            "federated_rejected": len(rejected), "federated_rejected_reasons": rejected}
        metrics: dict[str, Scalar] = {}
        if held:
            weights = np.array([r.num_examples for r in held], dtype=np.float64)

            def weighted(key: str) -> float:
                return float(np.dot(weights, [float(r.metrics[key]) for r in held])
                             / weights.sum())

            loss = weighted_loss_avg([(r.num_examples, float(r.loss)) for r in held])
            metrics["accuracy"] = weighted(EvaluateReply.ACCURACY)
            fields.update(federated_loss=loss, federated_acc=metrics["accuracy"])
            if all(EvaluateReply.TRUE_ACCURACY in r.metrics for r in held):
                metrics["true_accuracy"] = weighted(EvaluateReply.TRUE_ACCURACY)
                fields["federated_true_acc"] = metrics["true_accuracy"]
        return fields, fields["federated_loss"], metrics

    def missing(self, plan: EvaluationPlan, valid: list[tuple[ClientProxy, EvaluateRes]],
                rejected: list[dict[str, Any]], failures: list) -> list[dict[str, Any]]:
        """The partitions that missed the evaluation, sorted: not served (with the
        registry's reason), or asked and failed or refused."""
        node_of = {pid: proxy.cid for (proxy, _), pid in
                   zip(plan.instructions, sorted(plan.partitions))}
        unserved = absences(self.federation.registry, plan.partitions)
        asked = absent_among(
            plan.partitions, [int(r.metrics[EvaluateReply.PARTITION_ID]) for _, r in valid],
            [*attributed_failures(failures),
             *({**r, "reason": f"reply refused: {r['reason']}"} for r in rejected)],
            node_of, "its evaluation failed")
        return sorted([*unserved, *asked], key=lambda a: a["partition"])
