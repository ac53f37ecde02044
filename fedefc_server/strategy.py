"""The base of every method's strategy: Flower's FedAvg, made reproducible and robust.

Per round (docs/ARCHITECTURE.md, "One round"):

- ``configure_fit`` samples ``max(1, int(fraction * N))`` partition ids with a
  generator seeded by (seed, round) (:func:`sample_round`) and sends each client its
  own copy of the round config (:meth:`FedAvgStrategy.client_config`: the round and a
  per-client seed, plus what a method adds);
- ``aggregate_fit`` screens the replies (:mod:`.validation`; failures and rejections are
  logged and recorded with their reasons), sorts the valid ones by partition id (a
  fixed float summation order) and averages their weights with Flower's own FedAvg
  (by sample count); a round with fewer than ``min-fit-clients`` valid replies keeps
  the global model;
- under secure aggregation (docs/PRIVACY.md) the replies are screened by
  :meth:`~FedAvgStrategy.screen` before SecAgg+ sums them (:mod:`.secure_round`), and
  ``aggregate_fit`` receives the sum: the weights and the means of the summed metrics
  (:mod:`common.secure_means`), never a client's own;
- ``evaluate`` is Flower's hook for central evaluation (the server's test set) and
  does only that;
- with federated evaluation (``evaluation = federated | both``, docs/OWN-DATA.md),
  ``configure_evaluate`` asks every node that serves a partition to evaluate the
  global model on its held-out data, and ``aggregate_evaluate`` screens the replies
  (:func:`.validation.check_evaluate_reply`) and averages their loss and accuracy
  weighted by the held-out sample counts (Flower's ``weighted_loss_avg``), in
  partition-id order; the round loop records it (:meth:`take_federated_fields`).

What a method adds it adds through hooks, so that the round loop
(:class:`.round_loop.RoundLoop`), which writes the records, checkpoints and the
summary, needs no method-specific code: :meth:`~FedAvgStrategy.record` (fields of
this round's record), :meth:`~FedAvgStrategy.state_fields` (fields of every record),
:meth:`~FedAvgStrategy.server_state` (what a checkpoint keeps),
:meth:`~FedAvgStrategy.summary_fields` and :meth:`~FedAvgStrategy.describe` (the
round's log line). FedAvg, FedProx and FedDitto runs use this class as it is.
"""

from __future__ import annotations

from collections.abc import Callable
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
from flwr.server.strategy import FedAvg
from flwr.server.strategy.aggregate import weighted_loss_avg
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import RunConfig
from common.methods import SUBSET_COUNTS
from common.models import ClassifierShape
from common.secure_means import SCALE_KEY, SLOTS, SUMMED_KEYS, decode_tail, tail_scale
from common.seeds import derive_seed

from .failures import describe_failure, distinct_failures, is_rejection
from .registry import Declaration, PartitionRegistry
from .validation import (
    MEAN_METRICS,
    PER_CLIENT_METRICS,
    SUM_METRICS,
    Expected,
    check_evaluate_reply,
    check_reply,
)

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]  # weights -> (loss, accuracy)


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


def sample_round(cfg: RunConfig, available: list[int], server_round: int) -> list[int]:
    """max(1, int(fraction * N)) partition ids, sorted: a pure function of (seed, round,
    available ids), so every run with the same seed trains the same clients."""
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", server_round))
    pool = np.array(sorted(available))
    picked = rng.choice(pool, size=min(cfg.clients_per_round, len(pool)), replace=False)
    return sorted(int(p) for p in picked)


class FedAvgStrategy(FedAvg):
    """Seeded sampling by partition id, screened replies, FedAvg in partition-id order."""

    def __init__(self, cfg: RunConfig, initial_parameters: Parameters,
                 evaluator: Evaluator | None = None, max_samples: int = 10**8,
                 plan_sizes: list[int] | None = None,
                 model_shape: ClassifierShape | None = None):
        """``plan_sizes``: each partition's training-set size in the run's data plan (what
        a node serving a partition must declare); ``max_samples``: the bound of a node's
        private data when ``max-client-samples`` is 0 (the ServerApp gives the training
        set's size); ``model_shape``: K and the feature width of the run's model (the
        methods that exchange per-class data need them)."""
        super().__init__(fraction_fit=cfg.fraction, fraction_evaluate=0.0, min_fit_clients=1,
                         min_evaluate_clients=0, min_available_clients=1,
                         initial_parameters=initial_parameters, accept_failures=True)
        self.cfg = cfg
        self.evaluator = evaluator
        self.plan_sizes = plan_sizes
        self.max_samples = cfg.max_client_samples or max_samples
        self.registry = PartitionRegistry(vet=self.vet_declaration)
        self.secure = cfg.secure_aggregation
        self.weight_bound = 1  # SecAgg+'s max_weight: the round's largest declared size
        self.secure_means: dict[str, float] = {}  # this secure round's summed metrics
        self.model_shape = model_shape
        self._federated: dict[str, Any] = {}  # the last federated evaluation's fields
        self._evaluating: frozenset[int] = frozenset()  # partitions asked to evaluate
        self.accepted: list[tuple[ClientProxy, FitRes]] = []  # this round's valid replies
        self._round: dict[str, Any] = {}  # this round's record fields
        self._expected: Expected | None = None
        self._global_dtypes: list[np.dtype] = []
        self._waited = False  # whether configure_fit waited for the nodes to connect

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.cfg.method}, seed={self.cfg.seed})"

    # -- sampling and the round config ----------------------------------------------
    def sample_partitions(self, available: list[int], server_round: int) -> list[int]:
        """Partition ids of this round (see :func:`sample_round`)."""
        return sample_round(self.cfg, available, server_round)

    def round_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        """What every message of a round tells a client: the round and its own seed."""
        return {"round": server_round,
                "seed": derive_seed(self.cfg.seed, "client", partition_id, server_round)}

    def client_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        """The per-client config of a training message; methods add their keys."""
        return self.round_config(partition_id, server_round)

    def asks_accuracy(self, server_round: int) -> bool:
        """Whether this round's replies must carry the client's accuracy."""
        return False

    def privacy_config(self) -> dict[str, Scalar]:
        """What a training message adds for the client's privacy mods: SecAgg+'s tail
        scale (:mod:`common.secure_means`) and Flower's DP clipping norm."""
        config: dict[str, Scalar] = {}
        if self.secure:
            config[SCALE_KEY] = tail_scale(self.cfg.clipping_range, self.weight_bound)
        if self.cfg.dp_clip > 0:
            config[KEY_CLIPPING_NORM] = self.cfg.dp_clip
        return config

    # -- which node serves which partition, with how many samples --------------------
    def vet_declaration(self, decl: Declaration) -> str | None:
        """Why a node's declaration is refused, or None (docs/PRIVACY.md, "Weights bound
        to facts"): a partition of the run's dataset must declare the data plan's size;
        private data at most ``max-client-samples`` (0: the training set's size)."""
        if decl.partition >= self.cfg.num_clients:
            return f"partition id {decl.partition} outside 0..{self.cfg.num_clients - 1}"
        if decl.data == "partition" and self.plan_sizes is not None:
            size = self.plan_sizes[decl.partition]
            if decl.num_examples != size:
                return (f"declares {decl.num_examples} samples for partition {decl.partition}, "
                        f"whose size in the run's data plan is {size}")
        elif decl.num_examples > self.max_samples:
            return (f"declares {decl.num_examples} samples, above the bound {self.max_samples}"
                    "; raise max-client-samples if nodes hold more")
        return None

    def serving(self, client_manager: ClientManager, server_round: int
                ) -> dict[int, ClientProxy]:
        """{partition id: node} of the registered nodes (the first call of a process
        waits for the nodes to connect: round 0's federated evaluation, round 1, or the
        first round of a resumed run)."""
        if not self._waited:
            client_manager.wait_for(min(self.cfg.num_clients, 10_000), timeout=600)
            self._waited = True
        return self.registry.refresh(client_manager, server_round)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        serving = self.serving(client_manager, server_round)
        chosen = self.sample_partitions(list(serving), server_round)
        self._round = {"sampled": chosen, **self.registry.take_news()}
        arrays = parameters_to_ndarrays(parameters)
        sizes = {pid: self.registry.declared[pid] for pid in chosen}
        self.weight_bound = max([1, *sizes.values()])
        self._global_dtypes = [a.dtype for a in arrays]
        shapes, dtypes = [a.shape for a in arrays], list(self._global_dtypes)
        if self.secure:  # masked: Flower's weight factor, the weights, the tail; integers
            shapes = [(1,), *shapes, (len(SLOTS),)]
            dtypes = [np.dtype(np.int64)] * len(shapes)
        self._expected = Expected(shapes, dtypes, sizes,
                                  self.asks_accuracy(server_round) and not self.secure,
                                  subset=self.cfg.method in SUBSET_COUNTS, masked=self.secure)
        privacy = self.privacy_config()
        return [(serving[pid], FitIns(parameters, {**self.client_config(pid, server_round),
                                                   **privacy}))
                for pid in chosen]

    # -- aggregation ----------------------------------------------------------------
    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException],
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Plain rounds: screen, then FedAvg. Secure rounds: ``results`` were screened
        before the sum and each carries the sum as its parameters; ``failures`` include
        the refused replies (already recorded as rejections)."""
        self.secure_means = {}
        if self.secure:
            failures = [f for f in distinct_failures(failures) if not is_rejection(f)]
            results = sorted(results, key=lambda r: int(r[1].metrics["partition-id"]))
        else:
            results = self.screen(server_round, results)
        self.record_failures(server_round, failures)
        self.accepted = results
        metrics = [res.metrics for _, res in results]
        self.record(n_clients=len(results),
                    partition_ids=[int(m["partition-id"]) for m in metrics],
                    num_examples=[int(res.num_examples) for _, res in results],
                    client_loss=[str(m.get("loss", "")) for m in metrics],
                    server_saw=self.server_saw(results))
        if len(results) < self.cfg.min_fit_clients:
            log(WARNING, "round %d: %d valid replies < min-fit-clients=%d: round skipped, "
                "global model kept", server_round, len(results), self.cfg.min_fit_clients)
            self.record(skipped=True)
            return None, {}
        if self.secure:
            params = self.unpack_secure_sum(results)
        else:
            params = super().aggregate_fit(server_round, results, failures)[0]
        for key in MEAN_METRICS:
            mean = _mean([float(m[key]) for m in metrics if key in m])
            self.record(**{key.replace("-", "_"): self.secure_means.get(key, mean)})
        for key in SUM_METRICS:
            if any(key in m for m in metrics):
                self.record(**{key: int(sum(int(m.get(key, 0)) for m in metrics))})
        self.record(q_cos_clients=[float(m["q-cos"]) for m in metrics if "q-cos" in m])
        for key in PER_CLIENT_METRICS:
            if any(key in m for m in metrics):
                self.record(**{key.replace("-", "_"): [m.get(key) for m in metrics]})
        return params, {}

    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """Why a method strategy cannot use a reply's own metrics (None: it can); asked
        after :func:`check_reply` passed, a reason rejects the reply like its checks."""
        return None

    def screen(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
               ) -> list[tuple[ClientProxy, FitRes]]:
        """The valid replies sorted by partition id; rejections are logged and recorded
        with their reasons. Under secure aggregation this runs on the masked replies,
        before they are summed (:mod:`.secure_round`)."""
        seen: set[int] = set()
        accepted, rejected = self.sort_out(
            server_round, "reply", results,
            lambda res, node_pid: (check_reply(res, self._expected, seen, node_pid)
                                   or self.check_metrics(server_round, res.metrics)))
        self.record(rejected=len(rejected), rejected_reasons=rejected)
        return sorted(accepted, key=lambda r: int(r[1].metrics["partition-id"]))

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

    @staticmethod
    def describe_failures(server_round: int, what: str, failures: list) -> list[str]:
        """Each failure described for the round record, and logged."""
        failed = [describe_failure(f) for f in failures]
        for reason in failed:
            log(WARNING, "round %d: %s failed: %s", server_round, what, reason)
        return failed

    def record_failures(self, server_round: int,
                        failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> None:
        failed = self.describe_failures(server_round, "client", failures)
        self.record(failures=len(failed), failure_reasons=failed)

    # -- secure aggregation -----------------------------------------------------------
    def unpack_secure_sum(self, results: list[tuple[ClientProxy, FitRes]]) -> Parameters:
        """The weights of SecAgg+'s weighted mean (every result carries it), in the
        global model's dtypes, and the means of the summed metrics (``secure_means``)."""
        arrays = parameters_to_ndarrays(results[0][1].parameters)
        *weights, tail = arrays
        self.secure_means = decode_tail(tail)
        weights = [np.rint(w).astype(dt) if dt.kind in "iu" else w.astype(dt)
                   for w, dt in zip(weights, self._global_dtypes)]
        return ndarrays_to_parameters(weights)

    def server_saw(self, results: list[tuple[ClientProxy, FitRes]]) -> dict[str, list[str]]:
        """What the server received of the round's accepted clients: per client in the
        clear, and only as a sum over them (docs/PRIVACY.md)."""
        clear = sorted({"num-examples", *(k for _, r in results for k in r.metrics)})
        if not self.secure:
            return {"per_client": ["weights", *clear], "sum_only": []}
        return {"per_client": clear, "sum_only": ["weights", *SUMMED_KEYS]}

    def note_halted(self, server_round: int) -> None:
        """Record a secure round that SecAgg+ stopped before the sum (too few clients
        answered a stage to reconstruct the masks): the global model is kept."""
        if "n_clients" not in self._round:
            log(WARNING, "round %d: secure aggregation halted (fewer clients than "
                "reconstruction-threshold answered a stage): global model kept", server_round)
            self.record(n_clients=0, skipped=True, secure_aggregation_halted=True)

    # -- evaluation (Flower's hook) ---------------------------------------------------
    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Scalar]] | None:
        """The global model's (loss, {"accuracy"}) on the server's test set, if any."""
        if self.evaluator is None:
            return None
        loss, acc = self.evaluator(parameters_to_ndarrays(parameters))
        return loss, {"accuracy": acc}

    # -- federated evaluation (Flower's evaluate round) -------------------------------
    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Every node serving a partition evaluates the global model on its held-out
        data (none without federated evaluation)."""
        if not self.cfg.federated_evaluation:
            return []
        serving = self.serving(client_manager, server_round)
        self._evaluating = frozenset(serving)
        ins = EvaluateIns(parameters, {"round": server_round})
        return [(serving[pid], ins) for pid in sorted(serving)]

    def aggregate_evaluate(self, server_round: int,
                           results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
                           ) -> tuple[float | None, dict[str, Scalar]]:
        """The held-out loss and accuracies, averaged weighted by the held-out sample
        counts over the valid replies that hold samples (partition-id order)."""
        seen: set[int] = set()
        valid, rejected = self.sort_out(
            server_round, "evaluation reply", results,
            lambda res, node_pid: check_evaluate_reply(res, self._evaluating, seen,
                                                       self.max_samples, node_pid))
        failed = self.describe_failures(server_round, "client evaluation", failures)
        held = sorted((r for _, r in valid if r.num_examples > 0),
                      key=lambda r: int(r.metrics["partition-id"]))
        fields: dict[str, Any] = {
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
            metrics["accuracy"] = weighted("accuracy")
            fields.update(federated_loss=loss, federated_acc=metrics["accuracy"])
            if all("true-accuracy" in r.metrics for r in held):
                metrics["true_accuracy"] = weighted("true-accuracy")
                fields["federated_true_acc"] = metrics["true_accuracy"]
        self._federated = fields
        return fields["federated_loss"], metrics

    def take_federated_fields(self) -> dict[str, Any]:
        """The last federated evaluation's record fields, handed over once."""
        fields, self._federated = self._federated, {}
        return fields

    # -- what the round loop records --------------------------------------------------
    def record(self, **fields: Any) -> None:
        """Add fields to the current round's record (metrics.jsonl); method strategies
        use it for what a reader needs to see them work."""
        self._round.update(fields)

    def take_round_fields(self) -> dict[str, Any]:
        """This round's record fields (:meth:`record`), handed over once."""
        fields, self._round = self._round, {}
        return fields

    def state_fields(self, server_round: int) -> dict[str, Any]:
        """Fields of the method's state that every record shows (round 0 included)."""
        return {}

    def server_state(self) -> dict[str, Any]:
        """Everything the server must remember to continue the run (JSON-serializable):
        here the partitions' declared sizes, fixed for the run, resumed ones included."""
        return {"declared_sizes": {str(p): n for p, n in self.registry.declared.items()}}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`server_state` from a checkpoint."""
        self.registry.declared = {int(p): int(n)
                                  for p, n in state.get("declared_sizes", {}).items()}

    def summary_fields(self) -> dict[str, Any]:
        """What summary.json adds about the method."""
        return {}

    def describe(self, record: dict[str, Any]) -> str:
        """The round's log line (after ``[round t/T]``)."""
        if record["round"] == 0:
            return f"initial model: {evaluation_text(record)}"
        return f"{record.get('n_clients', 0)} clients | {evaluation_text(record)}"
