"""The round as steps: plan -> send -> screen -> aggregate -> evaluate -> record
(docs/ARCHITECTURE.md, "One round").

:class:`RoundPipeline` holds what a run fixes (the config, the method's entry and server
hooks, the partition registry, the server's test set) and no state of any round: each
step takes the values it needs and returns new ones.

- :meth:`~RoundPipeline.plan`: the method's work between rounds, the round's partitions
  (the registry learns the nodes it has not seen), every client's fit config and what
  every reply must look like (a :class:`.plan.RoundPlan`);
- send: Flower's (``fit_clients``, or the SecAgg+ workflow: :mod:`.secure_round`);
- :meth:`~RoundPipeline.screen`: every reply checked (:mod:`.validation`; failures and
  refusals recorded with their reasons), the valid ones sorted by partition id (a fixed
  float summation order); under secure aggregation this runs on the masked replies,
  before they are summed;
- :meth:`~RoundPipeline.aggregate`: Flower's FedAvg (by sample count), or the secure
  sum checked (:mod:`.secure_sum`) and decoded; a round with fewer than
  ``min-fit-clients`` valid replies, or whose secure sum no honest clients could have
  given, keeps the global model; then the method's server step
  (``MethodServer.after_aggregate``) and the round's record fields;
- :meth:`~RoundPipeline.evaluate` and the federated evaluation
  (:meth:`~RoundPipeline.plan_evaluation`, :meth:`~RoundPipeline.close_evaluation`):
  the server's test set, and the clients' held-out data;
- record: the round loop (:mod:`.round_loop`) writes what the steps returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy.aggregate import aggregate_inplace, weighted_loss_avg
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import RunConfig
from common.messages import CORE_REPLY, Declaration, EvaluateReply, FitConfig, FitReply
from common.methods import Method
from common.secure_means import SCALE_KEY, SLOTS, SUMMED_KEYS, decode_tail, tail_scale
from common.update_bound import norm_bound, secure_range

from .attendance import absent_among
from .baselines.extra_messages import send_tasks
from .failures import attributed_failures, describe_failure
from .method_server import Aggregated, MethodServer
from .plan import RoundPlan, round_config
from .registry import PartitionRegistry
from .secure_sum import bad_mean_update, check_secure_sum, group_means
from .validation import Expected, check_evaluate_reply, check_reply

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]  # weights -> (loss, accuracy)
Reply = tuple[ClientProxy, FitRes]


@dataclass(frozen=True)
class Screened:
    """The screen step's result: the valid replies sorted by partition id, and the
    refused ones as {node, partition, reason}."""

    accepted: list[Reply]
    rejected: list[dict[str, Any]]

    @property
    def record(self) -> dict[str, Any]:
        return {"rejected": len(self.rejected), "rejected_reasons": self.rejected}


@dataclass(frozen=True)
class SecureSum:
    """What Flower's SecAgg+ workflow decoded (docs/PRIVACY.md): its weighted mean
    ``parameters`` (the clients' updates, then the tail) and ``weight_total``, the sum's
    weight factor slot Q (:mod:`.secure_sum`; None if it was not read), over the
    clients of ``partitions``."""

    parameters: Parameters
    weight_total: int | None
    partitions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Collected:
    """What one secure sum of a round collected (one per group, ``secure-groups``): the
    screened masked replies, Flower's failures (less the screen's refusals) and the sum
    (None: no vector arrived)."""

    screened: Screened
    failures: list
    summed: SecureSum | None


@dataclass(frozen=True)
class Decoded:
    """A secure round's sums decoded: the new parameters (None: refused), the means of the
    summed metrics, why every sum was refused (or None), the record's fields about the
    groups and A(t)'s pull bound, and the partitions whose sums were applied."""

    parameters: Parameters | None
    means: dict[str, float]
    refused: str | None
    fields: dict[str, Any]
    partitions: frozenset[int]


@dataclass(frozen=True)
class RoundOutcome:
    """A round's new global parameters (None: keep the old ones) and its record fields."""

    parameters: Parameters | None
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluationPlan:
    """A federated evaluation: the (node, EvaluateIns) pairs and the partitions asked."""

    round: int
    instructions: list[tuple[ClientProxy, EvaluateIns]]
    partitions: frozenset[int]


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


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


def describe_failures(server_round: int, what: str, failures: list) -> list[str]:
    """Each failure described for the round record, and logged."""
    failed = [describe_failure(f) for f in failures]
    for reason in failed:
        log(WARNING, "round %d: %s failed: %s", server_round, what, reason)
    return failed


class RoundPipeline:
    """The steps of every round for one run (module docstring)."""

    def __init__(self, cfg: RunConfig, method: Method, server: MethodServer,
                 registry: PartitionRegistry, evaluator: Evaluator | None = None):
        self.cfg = cfg
        self.method = method
        self.server = server
        self.registry = registry
        self.evaluator = evaluator
        self.secure = cfg.secure_aggregation
        self.schema = CORE_REPLY + method.reply

    # -- plan --------------------------------------------------------------------------
    def plan(self, server_round: int, parameters: Parameters,
             client_manager: ClientManager) -> RoundPlan:
        """The round's partitions and instructions (the method's work between rounds
        first, with the current global model)."""
        serving = self.registry.serving(client_manager, server_round)
        start, sent = time.monotonic(), []
        extra = self.server.before_round(
            server_round, self.task_sender(serving, parameters, server_round, sent),
            sorted(serving))
        if sum(sent):
            extra["extra_messages_s"] = time.monotonic() - start
        drawn = self.server.sample(server_round, list(serving))
        chosen = self.registry.declare(drawn, server_round)  # a simulation asks them now
        sizes = {pid: self.registry.declared[pid] for pid in chosen}
        arrays = parameters_to_ndarrays(parameters)
        dtypes = [a.dtype for a in arrays]
        shapes = [a.shape for a in arrays]
        if self.secure:  # masked: Flower's weight factor, the weights, the tail; integers
            shapes = [(1,), *shapes, (len(SLOTS),)]
        max_norm, norm_key = norm_bound(self.cfg.dp_clip, self.cfg.dp_noise_multiplier,
                                        self.cfg.max_update_norm,
                                        sum(a.size for a in arrays if a.dtype.kind == "f"))
        expected = Expected(shapes, dtypes, sizes,
                            self.server.asks_accuracy(server_round) and not self.secure,
                            subset=self.method.counts_subset, masked=self.secure,
                            schema=self.schema, max_norm=max_norm,
                            reference=arrays if max_norm is not None else None,
                            norm_key=norm_key)
        bound = max([1, *sizes.values()])
        privacy = self.privacy_config(bound)
        instructions = [(serving[pid], FitIns(parameters, {
            **round_config(self.cfg, pid, server_round),
            **self.server.client_config(server_round, pid), **privacy})) for pid in chosen]
        unserved = self.unserved(serving)
        return RoundPlan(server_round, instructions, expected, bound,
                         {"sampled": drawn, **self.registry.take_news(), **extra,
                          **({"unserved": unserved} if unserved else {})}, parameters)

    def unserved(self, serving: dict[int, ClientProxy]) -> list[dict[str, Any]]:
        """The run's partitions no connected node serves, each with why
        (:meth:`.registry.PartitionRegistry.absence`)."""
        return [self.registry.absence(pid) for pid in range(self.cfg.num_clients)
                if pid not in serving]

    def privacy_config(self, weight_bound: int) -> dict[str, Scalar]:
        """What a training message adds for the client's privacy mods: SecAgg+'s tail
        scale (:mod:`common.secure_means`) and Flower's DP clipping norm."""
        config: dict[str, Scalar] = {}
        if self.secure:
            config[SCALE_KEY] = tail_scale(secure_range(self.cfg), weight_bound)
        if self.cfg.dp_clip > 0:
            config[KEY_CLIPPING_NORM] = self.cfg.dp_clip
        return config

    def task_sender(self, serving: dict[int, ClientProxy], parameters: Parameters,
                    server_round: int, sent: list[int] | None = None
                    ) -> Callable[[dict[int, dict[str, Scalar]]], dict[int, FitRes]]:
        """Task messages to chosen partitions between rounds (:mod:`.baselines.
        extra_messages`): each gets the round config plus its task keys; each call is
        bounded by ``client-timeout`` (0: none), as a round's training calls are, and
        appends the number of messages it sent to ``sent`` (a task for a partition that
        no node serves, or that the registry refuses, is not sent)."""
        def send(tasks: dict[int, dict[str, Scalar]]) -> dict[int, FitRes]:
            declared = self.registry.declare(list(tasks), server_round)
            configs = {pid: {**round_config(self.cfg, pid, server_round), **tasks[pid]}
                       for pid in declared if pid in serving}
            if sent is not None:
                sent.append(len(configs))
            return send_tasks(serving, parameters, configs, server_round,
                              timeout=self.cfg.client_timeout or None)
        return send

    # -- screen ------------------------------------------------------------------------
    def screen(self, plan: RoundPlan, results: list[Reply]) -> Screened:
        """The valid replies sorted by partition id, and the refused ones (logged)."""
        seen: set[int] = set()
        accepted, rejected = self.sort_out(
            plan.round, "reply", results,
            lambda res, node_pid: (check_reply(res, plan.expected, seen, node_pid)
                                   or self.server.check_metrics(plan.round, res.metrics)))
        return Screened(sorted(accepted, key=lambda r: int(r[1].metrics[FitReply.PARTITION_ID])),
                        rejected)

    def sort_out(self, server_round: int, what: str, results: list[tuple[ClientProxy, Any]],
                 check: Callable[[Any, int | None], str | None],
                 ) -> tuple[list[tuple[ClientProxy, Any]], list[dict[str, Any]]]:
        """(accepted replies, rejections {node, partition, reason}): ``check`` gives a
        reply's reason to reject it, given its node's registered partition; each
        rejection is logged."""
        accepted, rejected = [], []
        for proxy, res in results:
            node_pid = self.registry.partition_of(proxy.cid)
            reason = check(res, node_pid)
            if reason is None:
                accepted.append((proxy, res))
            else:
                rejected.append({"node": proxy.cid, "partition": node_pid, "reason": reason})
                log(WARNING, "round %d: rejected %s of node %s (partition %s): %s",
                    server_round, what, proxy.cid, node_pid, reason)
        return accepted, rejected

    # -- aggregate ---------------------------------------------------------------------
    def aggregate(self, plan: RoundPlan, screened: Screened, failures: list,
                  sums: list[SecureSum] | None = None) -> RoundOutcome:
        """FedAvg of the accepted replies, or (secure rounds) the ``sums`` of its groups,
        checked, decoded and combined (:meth:`decode_secure_sums`); then the method's
        server step. ``failures`` are Flower's, the refused replies not among them. A
        round whose every secure sum is refused (the reasons in the record's
        ``refused_sum``) keeps the global model, like a skipped round; a group whose sum
        is refused is left out of the round (``refused_groups``)."""
        t, accepted = plan.round, screened.accepted
        enough = len(accepted) >= self.cfg.min_fit_clients
        decoded = None
        if enough and sums is not None:
            decoded = self.decode_secure_sums(sums, plan, accepted)
            if decoded.parameters is not None:
                accepted = [r for r in accepted
                            if int(r[1].metrics[FitReply.PARTITION_ID]) in decoded.partitions]
        metrics = [res.metrics for _, res in accepted]
        failed = describe_failures(t, "client", failures)
        named = attributed_failures(failures)
        record: dict[str, Any] = {
            **screened.record, "failures": len(failed), "failure_reasons": failed,
            **({"failed_partitions": named} if named else {}),
            "n_clients": len(accepted),
            "partition_ids": [int(m[FitReply.PARTITION_ID]) for m in metrics],
            "num_examples": [int(res.num_examples) for _, res in accepted],
            "client_loss": [str(m.get(FitReply.LOSS, "")) for m in metrics],
            "server_saw": self.server_saw(accepted)}
        params, means = None, {}
        if not enough:
            log(WARNING, "round %d: %d valid replies < min-fit-clients=%d: round skipped, "
                "global model kept", t, len(accepted), self.cfg.min_fit_clients)
            record["skipped"] = True
        else:
            if decoded is None:
                params = ndarrays_to_parameters(aggregate_inplace(accepted))
            else:
                params, means = decoded.parameters, decoded.means
                record.update(decoded.fields)
                if decoded.refused:
                    log(WARNING, "round %d: secure sum refused, global model kept: %s", t,
                        decoded.refused)
                    record.update(skipped=True, refused_sum=decoded.refused)
            record.update(self.fold_metrics(metrics, means))
        replies = [(int(res.metrics[FitReply.PARTITION_ID]), res) for _, res in accepted]
        params, fields = self.server.after_aggregate(
            Aggregated(t, replies, params, means, self.secure, plan.sent))
        return RoundOutcome(params, {**record, **fields})

    def fold_metrics(self, metrics: list[dict[str, Scalar]], secure_means: dict[str, float]
                     ) -> dict[str, Any]:
        """The round record's fields of the schema's metrics (``ReplyMetric.fold``); a
        mean the clients summed under secure aggregation comes from ``secure_means``."""
        fields: dict[str, Any] = {}
        for metric in self.schema:
            values = [m[metric.key] for m in metrics if metric.key in m]
            if "mean" in metric.fold:
                fields[metric.field] = secure_means.get(
                    metric.key, _mean([float(v) for v in values]))
            if "sum" in metric.fold and values:
                fields[metric.field] = int(sum(int(v) for v in values))
            if "per-client" in metric.fold and values:
                name = f"{metric.field}_clients" if "mean" in metric.fold else metric.field
                fields[name] = values
        return fields

    def decode_secure_sum(self, summed: SecureSum, plan: RoundPlan, counts: list[int]
                          ) -> tuple[list[np.ndarray] | None, dict[str, float], str | None]:
        """(SecAgg+'s weighted mean of the clients' updates; the means of the summed
        metrics, :mod:`common.secure_means`; None) for a sum of clients with clear sample
        ``counts`` that passes :func:`.secure_sum.check_secure_sum` and, where the run
        bounds an update, :func:`.secure_sum.bad_mean_update`; else (None, {}, the
        reason)."""
        arrays, c = parameters_to_ndarrays(summed.parameters), secure_range(self.cfg)
        reason = check_secure_sum(arrays, summed.weight_total, counts,
                                  float(plan.weight_bound), c)
        *update, tail = arrays
        expected = plan.expected
        if reason is None and expected.max_norm is not None:
            reason = bad_mean_update(update, parameters_to_ndarrays(plan.sent),
                                     expected.max_norm, expected.norm_key, len(counts),
                                     summed.weight_total, c)
        return (None, {}, reason) if reason else (update, decode_tail(tail), None)

    def decode_secure_sums(self, sums: list[SecureSum], plan: RoundPlan,
                           accepted: list[Reply]) -> Decoded:
        """The round's new weights: the global model the round sent plus the mean update
        of the groups whose sums pass their checks (:meth:`decode_secure_sum`), each
        weighted by its weight total (so one group gives SecAgg+'s weighted mean, and
        several give the mean over all their clients), in the global model's dtypes;
        A(t) and the other means from the groups' (:func:`.secure_sum.group_means`)."""
        counts = {int(res.metrics[FitReply.PARTITION_ID]): int(res.num_examples)
                  for _, res in accepted}
        kept, refused = [], []
        for summed in sums:
            update, means, reason = self.decode_secure_sum(
                summed, plan, [counts[p] for p in summed.partitions])
            if reason:
                refused.append({"partitions": list(summed.partitions), "reason": reason})
            else:
                kept.append((summed, update, means))
        fields: dict[str, Any] = {"refused_groups": refused} if self.cfg.secure_groups > 1 else {}
        if not kept:
            return Decoded(None, {}, "; ".join(r["reason"] for r in refused), fields,
                           frozenset())
        total = sum(summed.weight_total for summed, _, _ in kept)
        mean = [sum(summed.weight_total * update[i] for summed, update, _ in kept) / total
                for i in range(len(kept[0][1]))]
        weights = [np.rint(g + u).astype(dt) if dt.kind in "iu" else (g + u).astype(dt)
                   for g, u, dt in zip(parameters_to_ndarrays(plan.sent), mean,
                                       plan.expected.dtypes)]
        means, group_fields = group_means(
            [(m, len(summed.partitions)) for summed, _, m in kept],
            self.cfg.accuracy_aggregation, self.server.asks_accuracy(plan.round))
        return Decoded(ndarrays_to_parameters(weights), means, None,
                       {**fields, **group_fields},
                       frozenset(p for summed, _, _ in kept for p in summed.partitions))

    def server_saw(self, results: list[Reply]) -> dict[str, list[str]]:
        """What the server received of the round's accepted clients: per client in the
        clear, and only as a sum over them (docs/PRIVACY.md)."""
        clear = sorted({Declaration.NUM_EXAMPLES, *(k for _, r in results for k in r.metrics)})
        if not self.secure:
            return {"per_client": ["weights", *clear], "sum_only": []}
        return {"per_client": clear, "sum_only": ["weights", *SUMMED_KEYS]}

    # -- evaluate ----------------------------------------------------------------------
    def evaluate(self, parameters: Parameters) -> tuple[float, float] | None:
        """The global model's (loss, accuracy) on the server's test set, if any."""
        if self.evaluator is None:
            return None
        return self.evaluator(parameters_to_ndarrays(parameters))

    def plan_evaluation(self, server_round: int, parameters: Parameters,
                        client_manager: ClientManager) -> EvaluationPlan | None:
        """Every node serving a partition evaluates the global model on its held-out
        data (None without federated evaluation)."""
        if not self.cfg.federated_evaluation:
            return None
        serving = self.registry.serving(client_manager, server_round)
        serving = {pid: serving[pid]
                   for pid in self.registry.declare(list(serving), server_round)}
        ins = EvaluateIns(parameters, {FitConfig.ROUND: server_round})
        return EvaluationPlan(server_round, [(serving[pid], ins) for pid in sorted(serving)],
                              frozenset(serving))

    def close_evaluation(self, plan: EvaluationPlan,
                         results: list[tuple[ClientProxy, EvaluateRes]], failures: list,
                         ) -> tuple[dict[str, Any], float | None, dict[str, Scalar]]:
        """(record fields, loss, metrics): the held-out loss and accuracies averaged,
        weighted by the held-out sample counts, over the valid replies that hold samples
        (partition-id order)."""
        seen: set[int] = set()
        valid, rejected = self.sort_out(
            plan.round, "evaluation reply", results,
            lambda res, node_pid: check_evaluate_reply(res, plan.partitions, seen,
                                                       self.registry.held_out.get(node_pid),
                                                       node_pid))
        failed = describe_failures(plan.round, "client evaluation", failures)
        held = sorted((r for _, r in valid if r.num_examples > 0),
                      key=lambda r: int(r.metrics[EvaluateReply.PARTITION_ID]))
        node_of = {pid: proxy.cid for (proxy, _), pid in
                   zip(plan.instructions, sorted(plan.partitions))}
        missing = [*self.unserved(dict.fromkeys(plan.partitions)), *absent_among(
            plan.partitions, [int(r.metrics[EvaluateReply.PARTITION_ID]) for _, r in valid],
            [*attributed_failures(failures),
             *({**r, "reason": f"reply refused: {r['reason']}"} for r in rejected)],
            node_of, "its evaluation failed")]
        fields: dict[str, Any] = {
            **({"federated_missing": sorted(missing, key=lambda a: a["partition"])}
               if missing else {}),
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

    # -- record ------------------------------------------------------------------------
    def describe(self, record: dict[str, Any]) -> str:
        """The round's log line (after ``[round t/T]``): the method's, or the default."""
        line = self.server.describe(record)
        if line is not None:
            return line
        if record["round"] == 0:
            return f"initial model: {evaluation_text(record)}"
        return f"{record.get('n_clients', 0)} clients | {evaluation_text(record)}"

    def notes(self) -> list[str]:
        """Plain-words remarks on a completed run: the registry's (partitions the run
        started without) and the method's (FedEFC that never left phase 1)."""
        return [*self.registry.notes(), *self.server.notes()]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run's server side: the declared sizes and the
        method's state (one flat object; the method's keys are its own)."""
        return {**self.registry.state(), **self.server.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.registry.load_state(state)
        self.server.load_state(state)
