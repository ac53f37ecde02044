"""The round loop: Flower's legacy ``Server.fit``, able to start after a checkpoint, and the
owner of everything a run writes.

Per round (docs/ARCHITECTURE.md, "One round"): the pipeline's plan step
(:meth:`.pipeline.RoundPipeline.plan`), a :class:`.strategy.RoundStrategy` over that
plan, Flower's ``fit_round`` with it (under secure aggregation a
:class:`.secure_round.SecureRound`: the same strategy driven by Flower's SecAgg+
workflow, so both modes share this loop), then the central evaluation (the strategy's
``evaluate``: the server's test set, if any), then, with federated evaluation, Flower's
``evaluate_round`` (the clients' held-out data), then the round's record in
``metrics.jsonl``, its log line and ``checkpoint.pt``. Round 0 evaluates the initial
model both ways. After the last round: ``model.pt``, ``summary.json``, whose
accuracies come from the server's test set when the run has one, else from the
federated evaluation (``accuracy_source`` says which), and its picture ``curves.png``
(:mod:`.curves`). The method contributes fields
through its server hooks (:class:`.method_server.MethodServer`); nothing here depends
on the method.

The strategy sees absolute round numbers, so sampling and client seeds, which are pure
functions of (seed, round), continue exactly where an interrupted run stopped. A round
whose exchange may have lost messages with a restarted SuperLink (:mod:`.link_watch`) is
not recorded: the run stops as interrupted, to be resumed after the round before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import Parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server import Server
from flwr.server.client_manager import ClientManager
from flwr.server.history import History
from torch import nn

from common.config import RunConfig
from common.params import state_dict_of
from common.results import RunRecorder
from common.twin import delivered

from . import checkpoint
from .attendance import describe, missed_training
from .curves import write_curves
from .failures import RunFailed, telling
from .link_watch import LinkLost, LinkWatchGrid
from .pipeline import RoundOutcome, RoundPipeline
from .resumes import note_interruption
from .strategy import RoundStrategy
from .summary import INTERRUPTED_PREFIX, RunFacts, build_summary, tell

SecureRoundFn = Callable[[RoundStrategy, Parameters], RoundOutcome]


def untrained_reason(record: dict[str, Any]) -> str:
    """Why a round's record holds no trained reply, from its own fields."""
    if not record.get("sampled"):
        return "no node served a partition to sample"
    parts = [f"{len(record['sampled'])} sampled"]
    for key, what in (("failure_reasons", "failed"), ("rejected_reasons", "refused")):
        reasons = [r if isinstance(r, str) else r["reason"] for r in record.get(key) or []]
        if reasons:
            parts.append(f"{len(reasons)} {what}, e.g. {telling(reasons)}")
    if record.get("secure_aggregation_halted"):
        parts.append("secure aggregation halted")
    return "; ".join(parts)


def unchanged_reason(records: list[dict[str, Any]]) -> str | None:
    """Why the run's global model never changed, when no training round of ``records``
    applied an update (every one kept the model: refused, or skipped), else None."""
    trained = [r for r in records if r.get("round", 0) > 0]
    if not trained or not all(r.get("skipped") for r in trained):
        return None
    last = trained[-1]
    why = (last.get("refused_sum") or last.get("secure_refused")
           or ("secure aggregation halted" if last.get("secure_aggregation_halted")
               else "fewer valid replies than min-fit-clients"))
    return (f"the global model never changed: each of the {len(trained)} rounds kept it "
            f"(round {last['round']}: {why}); the model delivered would be the initial one")


class RoundLoop(Server):
    """``Server.fit`` from round ``first_round`` on, recording every round. Flower's
    ``Server`` drives one strategy: here ``self.strategy`` is the current round's."""

    def __init__(self, *, client_manager: ClientManager, pipeline: RoundPipeline,
                 parameters: Parameters, cfg: RunConfig, recorder: RunRecorder,
                 model: nn.Module, run_info: dict[str, Any], first_round: int = 1,
                 elapsed_before: float = 0.0, secure_round: SecureRoundFn | None = None,
                 link: LinkWatchGrid | None = None, resumed: dict[str, Any] | None = None):
        """``parameters``: the global model to start from; ``model`` gives the
        architecture that ``model.pt`` is saved as; ``run_info`` (the data's facts)
        opens the summary; ``elapsed_before`` is the wall time of the interrupted
        run(s) this one resumes; ``secure_round`` replaces ``fit_round`` when the run
        uses secure aggregation; ``link``: a deployment's watched grid
        (:mod:`.link_watch`), None in a simulation; ``resumed``: why and when the run
        resumes (:func:`.resumes.resume_event`), recorded in its first round's record."""
        super().__init__(client_manager=client_manager,
                         strategy=RoundStrategy(pipeline, None))  # round 0: evaluation
        self.pipeline = pipeline
        self.parameters = parameters
        self.cfg = cfg
        self.recorder = recorder
        self.model = model
        self.run_info = run_info
        self.first_round = first_round
        self._elapsed_before = elapsed_before
        self.secure_round = secure_round
        self.link = link
        self.resumed = resumed
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        """Wall time of the whole run so far, interrupted parts included."""
        return self._elapsed_before + time.monotonic() - self._t0

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        """The rounds, then the summary. A run that cannot produce a result
        (:class:`.failures.RunFailed`: its nodes never formed the federation, a round
        trained no node, or no round changed the global model: :func:`unchanged_reason`)
        ends at once: its summary says ``failed`` and why, the last log
        line starts with ``RUN FAILED``, and the error propagates so that Flower marks
        the run failed; it writes no model. A round that may have lost messages with a
        restarted SuperLink (:class:`.link_watch.LinkLost`) is neither evaluated nor
        recorded: the last line starts with ``RUN INTERRUPTED``, the error propagates,
        and the checkpoint of the round before is what ``fedefc deploy submit`` resumes
        from; only the reason is written (:func:`.resumes.note_interruption`)."""
        start = time.monotonic()
        try:
            if self.first_round == 1:
                self._end_round(0, time.monotonic(), timeout, {})
            else:
                log(INFO, "resuming at round %d of %d", self.first_round, num_rounds)
            for server_round in range(self.first_round, num_rounds + 1):
                round_start = time.monotonic()
                outcome = self.train_round(server_round, timeout)
                self._check_link(server_round)  # a lost exchange: no evaluation of it
                if outcome.parameters is not None:
                    self.parameters = outcome.parameters
                self._end_round(server_round, round_start, timeout, outcome.record)
                if not outcome.record.get("n_clients"):
                    raise RunFailed(f"round {server_round}: no node trained "
                                    f"({untrained_reason(outcome.record)})")
                if self.pipeline.server.finished():  # FedEFC's phase-2 guard fired
                    break
            if (unchanged := unchanged_reason(self.recorder.rounds)) is not None:
                raise RunFailed(unchanged)
        except RunFailed as err:
            self._finish(None, failure=str(err))
            raise
        except LinkLost as err:
            reason = self._interruption(err)
            note_interruption(self.recorder.out_dir, self._next_round(), str(err))
            log(ERROR, "%s%s", INTERRUPTED_PREFIX, reason)
            raise
        self._finish(parameters_to_ndarrays(self.parameters))
        # Flower logs the History it is handed after the run, a copy of metrics.jsonl of
        # two lines a round (40 of a finished run's 62 closing lines): it gets none
        return History(), time.monotonic() - start

    def _next_round(self) -> int:
        """The round after the last one recorded (and checkpointed)."""
        return max((r["round"] for r in self.recorder.rounds), default=0) + 1

    def _interruption(self, err: LinkLost) -> str:
        """The ``RUN INTERRUPTED`` line's reason and what to do about it."""
        done = self._next_round() - 1  # checkpointed
        then = (f"its checkpoint of round {done} is kept: `fedefc deploy submit` resumes "
                f"it on its own, or by hand `fedefc deploy submit CONNECTION --resume "
                f"{self.recorder.out_dir}` with the first submission's --sign-key (and "
                "--key-id) where its apps are signed" if done else
                "no round was checkpointed yet: submit the run again")
        return (f"{err}; a message lost with a restarting SuperLink would leave the round "
                f"waiting forever, so the run stops here, the round not recorded; {then}")

    def _check_link(self, server_round: int) -> None:
        """:class:`.link_watch.LinkLost` if an exchange of this round may have lost
        messages (:mod:`.link_watch`): checked after its training exchange (a round that
        lost one is not evaluated: the run stops at once) and before it is recorded (its
        federated evaluation's)."""
        if self.link is not None and self.link.lost:
            raise LinkLost(f"round {server_round}: {self.link.lost}")

    def train_round(self, server_round: int, timeout: float | None) -> RoundOutcome:
        """One round's training: plan, send, screen, aggregate. The outcome's record
        holds the plan's fields and the aggregation's."""
        plan = self.pipeline.plan(server_round, self.parameters, self._client_manager)
        self.strategy = RoundStrategy(self.pipeline, plan)
        if self.secure_round is not None:
            outcome = self.secure_round(self.strategy, self.parameters)
        else:
            self.fit_round(server_round=server_round, timeout=timeout)
            outcome = self.strategy.outcome or RoundOutcome(None, {"n_clients": 0})
        record = {**plan.record, **outcome.record}
        partition_of = self.pipeline.registry.partition_of
        node_of = {pid: proxy.cid for proxy, _ in plan.instructions
                   if (pid := partition_of(proxy.cid)) is not None}
        missing = missed_training(record, plan.partitions, node_of)
        record.pop("unserved", None)
        return RoundOutcome(outcome.parameters, {**record, **({"missing": missing}
                                                              if missing else {})})

    def _end_round(self, server_round: int, round_start: float,
                   timeout: float | None, fields: dict[str, Any]) -> None:
        """Evaluate, record, log and checkpoint round ``server_round`` (0: the initial
        model); ``fields``: the round's training record."""
        evaluated = self.strategy.evaluate(server_round, parameters=self.parameters)
        record: dict[str, Any] = {"round": server_round}
        if evaluated is not None:
            loss, metrics = evaluated
            record.update(test_acc=metrics["accuracy"], test_loss=loss)
        if self.cfg.federated_evaluation:
            self.evaluate_round(server_round=server_round, timeout=timeout)
            record.update(self.strategy.federated)
        record.update(self.pipeline.server.state_fields(server_round), elapsed_s=self.elapsed())
        self._check_link(server_round)
        if server_round == 0:
            record["n_clients"] = 0
        else:
            record.update(fields, round_s=time.monotonic() - round_start)
        if server_round == self.first_round and self.resumed:
            record["resumed"] = self.resumed
        self.recorder.write_round(record)
        log(INFO, "[round %d/%d] %s", server_round, self.cfg.rounds,
            self.pipeline.describe(record))
        for key, what in (("missing", "missed by"), ("federated_missing",
                                                     "federated evaluation missed by")):
            if record.get(key):
                log(WARNING, "[round %d/%d] %s %s", server_round, self.cfg.rounds, what,
                    describe(record[key]))
        if server_round > 0:
            checkpoint.save(self.recorder.out_dir, checkpoint.Checkpoint(
                server_round, parameters_to_ndarrays(self.parameters),
                self.pipeline.state(), self.cfg.recorded(), self.elapsed(),
                self.pipeline.server.models()))

    def _finish(self, weights: list[np.ndarray] | None, failure: str | None = None
                ) -> dict[str, Any]:
        """Write model.pt (unless the run failed) and summary.json, and log the summary
        (:mod:`.summary`: built from the rounds' records, then told). A run whose clients
        failed or were refused still completes, its summary counting them; one in which
        a partition missed more rounds than ``max-missed-share`` allows ends
        ``degraded``; a failed run (``failure``) writes no model."""
        if failure is None:
            self.recorder.write_model(state_dict_of(self.model,
                                                    delivered(weights, self.cfg.twinned)))
        facts = RunFacts(self.run_info, self.pipeline.server.summary_fields(),
                         [] if failure else self.pipeline.notes(), self.elapsed(), failure)
        summary = self.recorder.write_summary(
            build_summary(self.cfg, self.recorder.rounds, facts))
        write_curves(self.recorder.out_dir, self.recorder.rounds, summary, self.cfg.num_clients)
        tell(summary, self.cfg)
        return summary
