"""The FedEFC strategy: Flower's FedAvg plus accuracy aggregation and the phase switch.

Per round (paper Algorithm 1, ALGORITHM.md section 3):

- ``configure_fit`` samples ``max(1, int(fraction * N))`` partition ids with a
  generator seeded by (seed, round) and sends each client its own copy of the
  config: the phase, the round and a per-client seed.
- ``aggregate_fit`` sorts the replies by partition id (a fixed float summation
  order), averages the weights with Flower's own FedAvg (by sample count), averages
  the clients' accuracies without weights (paper eq. (3)) and feeds A(t) to the
  :class:`Prestopper`. From round T_e + 1 on every client is told phase 2.
- ``evaluate`` tests the global model on the clean test set, writes the round's
  record and a checkpoint; after the last round it writes the summary and the final model.

Reliability (docs/RELIABILITY.md): every reply is validated before aggregation
(:mod:`.validation`); failed and rejected clients are logged and counted, and a round
with fewer than ``min-fit-clients`` valid replies keeps the global model; A(t) can be
a median or trimmed mean (:mod:`.robust`); a run resumes from its checkpoint
(:mod:`.checkpoint`, :class:`.server.ResumableServer`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from common.config import RunConfig
from common.results import RunRecorder
from common.seeds import derive_seed

from . import checkpoint
from .evaluation import TestSetEvaluator
from .prestopping import Prestopper
from .registry import PartitionRegistry
from .robust import aggregate_accuracy
from .validation import MEAN_METRICS, PER_CLIENT_METRICS, SUM_METRICS, Expected, check_reply


def _describe_failure(failure) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    proxy, res = failure
    return f"node {proxy.cid}: status {res.status.code.name} {res.status.message}"


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def sample_round(cfg: RunConfig, available: list[int], server_round: int) -> list[int]:
    """max(1, int(fraction * N)) partition ids, sorted: a pure function of (seed, round,
    available ids), so every run with the same seed trains the same clients."""
    wanted = max(1, int(cfg.num_clients * cfg.fraction))
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", server_round))
    pool = np.array(sorted(available))
    picked = rng.choice(pool, size=min(wanted, len(pool)), replace=False)
    return sorted(int(p) for p in picked)


def round_config(cfg: RunConfig, partition_id: int, server_round: int,
                 phase: int) -> dict[str, Scalar]:
    """What one client is told for one round: its phase, the round and its own seed."""
    return {"phase": phase, "round": server_round,
            "seed": derive_seed(cfg.seed, "client", partition_id, server_round)}


class FedEFCStrategy(FedAvg):
    """FedAvg with FedEFC's prestopping detection and phase switch."""

    def __init__(self, cfg: RunConfig, evaluator: TestSetEvaluator, recorder: RunRecorder,
                 initial_parameters: Parameters, run_info: dict[str, Any] | None = None,
                 registry: PartitionRegistry | None = None, max_samples: int = 10**8):
        super().__init__(fraction_fit=cfg.fraction, fraction_evaluate=0.0, min_fit_clients=1,
                         min_evaluate_clients=0, min_available_clients=1,
                         initial_parameters=initial_parameters, accept_failures=True)
        self.cfg = cfg
        self.evaluator = evaluator
        self.recorder = recorder
        self.registry = registry or PartitionRegistry()
        self.prestopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
        self.run_info = dict(run_info or {})
        self._round_info: dict[str, Any] = {}
        self._t0 = time.monotonic()
        self._round_start = self._t0
        self._elapsed_before = 0.0  # wall time of the interrupted run(s) this one resumes
        self.max_samples = cfg.max_client_samples or max_samples
        self._expected: Expected | None = None
        self.accepted: list[tuple[ClientProxy, FitRes]] = []  # this round's valid replies
        self._waited = False  # whether configure_fit waited for the nodes to connect

    def __repr__(self) -> str:
        return f"FedEFCStrategy(method={self.cfg.method}, seed={self.cfg.seed})"

    # -- sampling ---------------------------------------------------------------------
    def sample_partitions(self, available: list[int], server_round: int) -> list[int]:
        """Partition ids of this round (see :func:`sample_round`)."""
        return sample_round(self.cfg, available, server_round)

    def client_config(self, partition_id: int, server_round: int) -> dict[str, Scalar]:
        """The per-client copy of the round config."""
        return round_config(self.cfg, partition_id, server_round,
                            self.prestopper.phase(server_round))

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self._round_start = time.monotonic()
        if not self._waited:  # the first round of this process: round 1, or a resumed one
            client_manager.wait_for(min(self.cfg.num_clients, 10_000), timeout=600)
            self._waited = True
        serving = self.registry.refresh(client_manager, server_round)
        chosen = self.sample_partitions(list(serving), server_round)
        phase = self.prestopper.phase(server_round)
        self._round_info = {"phase": phase, "sampled": chosen}
        arrays = parameters_to_ndarrays(parameters)
        self._expected = Expected([a.shape for a in arrays], [a.dtype for a in arrays],
                                  frozenset(chosen), phase, self.max_samples)
        return [(serving[pid], FitIns(parameters, self.client_config(pid, server_round)))
                for pid in chosen]

    # -- aggregation ------------------------------------------------------------------
    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException],
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        results = self.screen(server_round, results, failures)
        self.accepted = results
        metrics = [res.metrics for _, res in results]
        info = self._round_info
        info.update(n_clients=len(results),
                    partition_ids=[int(m["partition-id"]) for m in metrics],
                    num_examples=[int(res.num_examples) for _, res in results],
                    client_loss=[str(m.get("loss", "")) for m in metrics])
        if len(results) < self.cfg.min_fit_clients:
            log(WARNING, "round %d: %d valid replies < min-fit-clients=%d: round skipped, "
                "global model kept", server_round, len(results), self.cfg.min_fit_clients)
            info["skipped"] = True
            return None, {}
        params = super().aggregate_fit(server_round, results, failures)[0]
        if info["phase"] == 1:
            accs = [float(m["accuracy"]) for m in metrics]
            info["client_acc"] = accs
            info["A"] = aggregate_accuracy(accs, self.cfg.accuracy_aggregation,
                                           self.cfg.trim_fraction)
            if info["A"] is not None and self.prestopper.observe(server_round, info["A"]):
                log(INFO, "PRESTOPPING POINT T_e = %d (A_max = %.4f, patience %d = gamma_thr): "
                    "phase 2 from round %d", server_round, self.prestopper.a_max,
                    self.prestopper.patience, server_round + 1)
        for key in MEAN_METRICS:
            info[key.replace("-", "_")] = _mean([float(m[key]) for m in metrics if key in m])
        for key in SUM_METRICS:
            if any(key in m for m in metrics):
                info[key] = int(sum(int(m.get(key, 0)) for m in metrics))
        info["q_cos_clients"] = [float(m["q-cos"]) for m in metrics if "q-cos" in m]
        for key in PER_CLIENT_METRICS:
            if any(key in m for m in metrics):
                info[key.replace("-", "_")] = [m.get(key) for m in metrics]
        return params, {}

    def record(self, **fields: Any) -> None:
        """Add fields to the current round's record (metrics.jsonl); method strategies
        use it for what a reader needs to see them work."""
        self._round_info.update(fields)

    def check_metrics(self, server_round: int, metrics: dict[str, Scalar]) -> str | None:
        """Why a method strategy cannot use a reply's own metrics (None: it can); asked
        after :func:`check_reply` passed, a reason rejects the reply like its checks."""
        return None

    def screen(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
               failures: list[tuple[ClientProxy, FitRes] | BaseException],
               ) -> list[tuple[ClientProxy, FitRes]]:
        """The valid replies sorted by partition id; failures and rejections are logged
        and recorded with their reasons."""
        seen: set[int] = set()
        accepted, rejected = [], []
        for proxy, res in results:
            reason = (check_reply(res, self._expected, seen)
                      or self.check_metrics(server_round, res.metrics))
            if reason is None:
                accepted.append((proxy, res))
            else:
                rejected.append({"node": proxy.cid, "partition": self.registry.partition_of(
                    proxy.cid), "reason": reason})
                log(WARNING, "round %d: rejected reply of node %s (partition %s): %s",
                    server_round, proxy.cid, self.registry.partition_of(proxy.cid), reason)
        failed = [_describe_failure(f) for f in failures]
        for reason in failed:
            log(WARNING, "round %d: client failed: %s", server_round, reason)
        self._round_info.update(failures=len(failed), failure_reasons=failed,
                                rejected=len(rejected), rejected_reasons=rejected)
        return sorted(accepted, key=lambda r: int(r[1].metrics["partition-id"]))

    # -- state for checkpoints ----------------------------------------------------------
    def server_state(self) -> dict[str, Any]:
        """Everything the server must remember to continue the run (JSON-serializable);
        method strategies extend it."""
        return {"prestopper": asdict(self.prestopper),
                "elapsed_s": self._elapsed_before + time.monotonic() - self._t0}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`server_state` from a checkpoint."""
        stopper = dict(state["prestopper"])
        stopper["history"] = [tuple(h) for h in stopper["history"]]
        self.prestopper = Prestopper(**stopper)
        self._elapsed_before = float(state["elapsed_s"])

    # -- evaluation and records -------------------------------------------------------
    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Scalar]] | None:
        weights = parameters_to_ndarrays(parameters)
        loss, acc = self.evaluator(weights)
        now = time.monotonic()
        record: dict[str, Any] = {"round": server_round, "test_acc": acc, "test_loss": loss,
                                  "A_max": self.prestopper.a_max,
                                  "patience": self.prestopper.patience,
                                  "t_e": self.prestopper.t_e,
                                  "elapsed_s": self._elapsed_before + now - self._t0}
        if server_round == 0:
            record.update(phase=1, n_clients=0)
        else:
            record.update(self._round_info, round_s=now - self._round_start)
        self.recorder.write_round(record)
        self._log_round(record)
        if server_round > 0:
            checkpoint.save(self.recorder.out_dir, checkpoint.Checkpoint(
                server_round, weights, self.server_state(), self.cfg.to_flat()))
        if server_round == self.cfg.rounds:
            self.finish(weights)
        return loss, {"accuracy": acc}

    def _log_round(self, r: dict[str, Any]) -> None:
        head = f"[round {r['round']}/{self.cfg.rounds}] phase {r['phase']}"
        if r["round"] == 0:
            log(INFO, "%s | initial model: test acc %.4f", head, r["test_acc"])
        elif r["phase"] == 1:
            a = r.get("A")
            log(INFO, "%s | A(t) %s  A_max %.4f  patience %d/%d | test acc %.4f  loss %.4f",
                head, "n/a" if a is None else f"{a:.4f}", r["A_max"], r["patience"],
                self.cfg.gamma_thr, r["test_acc"], r["test_loss"])
        else:
            kinds = ", ".join(sorted(set(r.get("client_loss", [])))) or "no clients"
            cos = r.get("q_cos")
            log(INFO, "%s | %d clients, loss: %s%s | test acc %.4f  loss %.4f", head,
                r.get("n_clients", 0), kinds,
                "" if cos is None else f" (Q vs true: cos {cos:.3f}, L1 {r['q_l1']:.3f})",
                r["test_acc"], r["test_loss"])

    def finish(self, weights: list[np.ndarray]) -> dict[str, Any]:
        """Write summary.json and model.pt, and log the summary."""
        self.recorder.write_model(self.evaluator.state_dict(weights))
        summary = self.recorder.write_summary({
            **self.run_info, "method": self.cfg.method, "dataset": self.cfg.dataset,
            "seed": self.cfg.seed, "rounds": self.cfg.rounds, "t_e": self.prestopper.t_e,
            "A_max": self.prestopper.a_max,
            "wall_time_s": self._elapsed_before + time.monotonic() - self._t0,
        })
        log(INFO, "SUMMARY | final acc %.4f | best %.4f (round %s) | mean of last 10 %.4f | "
            "T_e %s | wall time %.1f s", summary.get("final_acc", float("nan")),
            summary.get("best_acc", float("nan")), summary.get("best_round"),
            summary.get("mean_last10_acc", float("nan")), summary["t_e"],
            summary["wall_time_s"])
        log(INFO, "results: %s", summary["out_dir"])
        return summary
