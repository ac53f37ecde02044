"""The round as steps: plan -> send -> screen -> aggregate -> evaluate -> record
(docs/ARCHITECTURE.md, "One round").

:class:`RoundPipeline` holds what a run fixes (the config, the method's entry and server
hooks, the partition registry and the wait for its federation, the server's test set)
and no state of any round: each step takes the values it needs and returns new ones.

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
- evaluate: :attr:`RoundPipeline.evaluation` (:class:`.round_evaluation.RoundEvaluation`),
  the server's test set and the clients' held-out data;
- record: the round loop (:mod:`.round_loop`) writes what the steps returned (the log
  line from :meth:`~RoundPipeline.describe`), and :mod:`.summary` tells the run's end.

Each step's helpers live with their subject: the checks in :mod:`.validation`, the
secure sums' decoding in :mod:`.secure_sum`, the failures in :mod:`.failures`, who is
missing in :mod:`.attendance`; what remains here is the round's order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import (
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
from flwr.server.strategy.aggregate import aggregate_inplace
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import RunConfig
from common.messages import CORE_REPLY, Declaration, FitReply
from common.methods import Method
from common.secure_means import SCALE_KEY, SLOTS, SUMMED_KEYS, tail_scale
from common.update_bound import BOUND_KEY, RELATIVE_KEY, float_size, round_bound, secure_range

from .culprit_search import CulpritSearch
from .extra_messages import send_tasks
from .failures import attributed_failures, describe_failures
from .federation import Federation
from .method_server import Aggregated, MethodServer
from .plan import RoundPlan, round_config
from .registry import PartitionRegistry
from .registry_report import absences
from .round_evaluation import Evaluator, RoundEvaluation, evaluation_text
from .secure_sum import SecureSum, decode_sums
from .validation import Expected, check_reply, sort_replies

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
class Collected:
    """What one secure sum of a round collected (one per group, ``secure-groups``): the
    screened masked replies, Flower's failures (less the screen's refusals) and the sum
    (None: no vector arrived)."""

    screened: Screened
    failures: list
    summed: SecureSum | None


@dataclass(frozen=True)
class RoundOutcome:
    """A round's new global parameters (None: keep the old ones) and its record fields."""

    parameters: Parameters | None
    record: dict[str, Any] = field(default_factory=dict)


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


class RoundPipeline:
    """The steps of every round for one run (module docstring)."""

    def __init__(self, cfg: RunConfig, method: Method, server: MethodServer,
                 registry: PartitionRegistry, evaluator: Evaluator | None = None):
        self.cfg = cfg
        self.method = method
        self.server = server
        self.registry = registry
        self.federation = Federation(registry)  # the first round waits for its nodes
        self.evaluator = evaluator
        self.evaluation = RoundEvaluation(cfg, self.federation, evaluator)  # evaluate step
        self.secure = cfg.secure_aggregation
        self.schema = CORE_REPLY + method.reply
        # the norm of the initial model's float weights, which a secure run's default
        # update bound scales (common/update_bound.py: round_bound): the ServerApp sets it
        # from the initial model, else the first round planned measures what it sends
        self.initial_size: float | None = None
        self.search = CulpritSearch()  # who broke a secure sum (.culprit_search)

    # -- plan --------------------------------------------------------------------------
    def plan(self, server_round: int, parameters: Parameters,
             client_manager: ClientManager) -> RoundPlan:
        """The round's partitions and instructions (the method's work between rounds
        first, with the current global model)."""
        serving = self.federation.serving(client_manager, server_round)
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
        if self.initial_size is None:
            self.initial_size = float_size(arrays)
        max_norm, norm_key = round_bound(self.cfg, arrays, self.initial_size)
        expected = Expected(shapes, dtypes, sizes,
                            self.server.asks_accuracy(server_round) and not self.secure,
                            subset=self.method.counts_subset, masked=self.secure,
                            schema=self.schema, max_norm=max_norm,
                            reference=arrays if max_norm is not None else None,
                            norm_key=norm_key)
        bound = self.registry.rule.secure_weight if self.secure else 1
        privacy = self.privacy_config(bound)
        if norm_key == RELATIVE_KEY:
            privacy[BOUND_KEY] = max_norm
        instructions = [(serving[pid], FitIns(parameters, {
            **round_config(self.cfg, pid, server_round),
            **self.server.client_config(server_round, pid), **privacy})) for pid in chosen]
        unserved = absences(self.registry, serving)
        return RoundPlan(server_round, instructions, expected, bound,
                         {"sampled": drawn, **self.registry.take_news(), **extra,
                          **({"unserved": unserved} if unserved else {})}, parameters)

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
        """Task messages to chosen partitions between rounds (:mod:`.extra_messages`):
        each gets the round config plus its task keys; each call is bounded by
        ``client-timeout`` (0: none), as a round's training calls are, and appends the
        number of messages it sent to ``sent`` (a task for a partition that no node
        serves, or that the registry refuses, is not sent)."""
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
        accepted, rejected = sort_replies(
            plan.round, "reply", results, self.registry.partition_of,
            lambda res, node_pid: (check_reply(res, plan.expected, seen, node_pid)
                                   or self.server.check_metrics(plan.round, res.metrics)))
        return Screened(sorted(accepted, key=lambda r: int(r[1].metrics[FitReply.PARTITION_ID])),
                        rejected)

    # -- aggregate ---------------------------------------------------------------------
    def aggregate(self, plan: RoundPlan, screened: Screened, failures: list,
                  sums: list[SecureSum] | None = None) -> RoundOutcome:
        """FedAvg of the accepted replies, or (secure rounds) the ``sums`` of its groups,
        checked, decoded and combined (:func:`.secure_sum.decode_sums`); then the method's
        server step. ``failures`` are Flower's, the refused replies not among them. A
        round whose every secure sum is refused (the reasons in the record's
        ``refused_sum``) keeps the global model, like a skipped round; a group whose sum
        is refused is left out of the round (``refused_groups``)."""
        t, accepted = plan.round, screened.accepted
        enough = len(accepted) >= self.cfg.min_fit_clients
        decoded = None
        if enough and sums is not None:
            decoded = decode_sums(sums, plan, accepted, self.cfg,
                                  self.server.asks_accuracy(plan.round))
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

    def server_saw(self, results: list[Reply]) -> dict[str, list[str]]:
        """What the server received of the round's accepted clients: per client in the
        clear, and only as a sum over them (docs/PRIVACY.md)."""
        clear = sorted({Declaration.NUM_EXAMPLES, *(k for _, r in results for k in r.metrics)})
        if not self.secure:
            return {"per_client": ["weights", *clear], "sum_only": []}
        return {"per_client": clear, "sum_only": ["weights", *SUMMED_KEYS]}

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
        return [*self.federation.notes(), *self.server.notes()]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run's server side: the declared sizes, the
        method's state (one flat object; the method's keys are its own) and a search for
        the client that broke a secure sum, while one goes on."""
        return {**self.registry.state(), **self.server.state(),
                **({"culprit_search": self.search.state()} if self.search.suspects else {})}

    def load_state(self, state: dict[str, Any]) -> None:
        self.registry.load_state(state)
        self.server.load_state(state)
        self.search = CulpritSearch.of(state.get("culprit_search"))
