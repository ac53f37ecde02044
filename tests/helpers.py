"""Stand-ins and small jobs shared by the tests (fixtures are in conftest.py).

- In-process nodes that drive a strategy without Ray: :class:`FakeProxy` answers the
  partition registry's query; :class:`FakeNode` also replies to task messages with
  metrics computed from the message config.
- :class:`InProcessGrid`: a Flower grid whose nodes are the real ClientApp (with its
  mods) in this process, keeping every reply the server received; for secure rounds.
- :func:`make_driver`: a round pipeline (the run's method, a stub central evaluation)
  driven through Flower's Strategy calls the way the round loop drives it
  (:class:`RoundDriver`).
- Small real jobs through ``flwr run`` (:func:`simulate`, :func:`small_job`) and their
  records (:func:`records`); the tests that run them carry the ``flower`` marker.
- How long a test waits for something before it gives up (:func:`patience`), scaled by
  the one setting ``FEDEFC_TEST_TIME_SCALE``.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.common import (
    Code,
    FitRes,
    GetPropertiesRes,
    Status,
    ndarrays_to_parameters,
)
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy

from common.methods import load_object, load_run_config, method_of
from common.models import ClassifierShape
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job
from fedefc_server.declarations import SizeRule
from fedefc_server.pipeline import RoundPipeline
from fedefc_server.registry import PartitionRegistry
from fedefc_server.strategy import RoundStrategy


# -- time ----------------------------------------------------------------------------------
def time_scale() -> float:
    """``FEDEFC_TEST_TIME_SCALE`` (default 1): the factor of every limit a test waits for."""
    text = os.environ.get("FEDEFC_TEST_TIME_SCALE", "").strip() or "1"
    try:
        scale = float(text)
    except ValueError:
        scale = 0.0
    if not scale > 0:
        raise ValueError(f"FEDEFC_TEST_TIME_SCALE={text!r}: give a factor above 0, e.g. 3")
    return scale


def patience(seconds: float) -> float:
    """How long a test waits for something to happen (a process to start or to exit, a
    run to end, a round to be recorded) before it gives up and fails: ``seconds`` times
    ``FEDEFC_TEST_TIME_SCALE``. Such a limit only bounds how long a hang takes to be
    reported: the test asserts what happened, never that it happened fast, so a larger
    limit cannot turn a failure into a pass. The base values are far above an idle
    2-core machine's times (an hour for a Flower run of a few rounds that takes 1-4
    minutes there), so the suite passes with both cores kept busy by other work
    (tests/load_harness.py); scale them for a slower machine still."""
    return seconds * time_scale()


RUN_LIMIT_S = 3600.0  # a test's limit (before scaling) for one Flower run of a few rounds


OK = Status(code=Code.OK, message="")
GLOBAL = [np.zeros((3, 4), np.float32), np.zeros(5, np.float32)]  # a "model": K=3, D=4
PARAMS = ndarrays_to_parameters(GLOBAL)


# Nodes that run the project's client code inside the test process take this lock for
# each message: a real node is a process of its own, while these share one process and
# torch's global state (its thread pool, its RNG). A CI worker crashed (a fatal signal)
# while Flower's fit_clients had three such nodes training in its threads at once.
IN_PROCESS_NODES = threading.Lock()

SIZE = 10  # the sample count a stand-in node declares unless told otherwise


class FakeProxy(ClientProxy):
    """A node that only answers the registry's query: its partition id and sizes."""

    def __init__(self, cid: str, partition_id: int, num_examples: int = SIZE,
                 held_out: int = 0):
        super().__init__(cid)
        self.partition_id = partition_id
        self.num_examples = num_examples
        self.held_out = held_out

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(OK, {"partition-id": self.partition_id,
                                     "num-examples": self.num_examples,
                                     "held-out": self.held_out, "data": "partition"})

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError


class FakeNode(FakeProxy):
    """A node serving partition ``pid``; ``answer(config)`` gives its task replies' metrics."""

    def __init__(self, pid: int, answer: Callable[[dict], dict] | None = None,
                 num_examples: int = SIZE):
        super().__init__(str(5_000_000 + 7 * pid), pid, num_examples)
        self.pid = pid
        self.answer = answer
        self.tasks: list[dict] = []

    def fit(self, ins, timeout, group_id):
        self.tasks.append(dict(ins.config))
        return FitRes(OK, ins.parameters, 0, {"partition-id": self.pid, **self.answer(ins.config)})


def manager(nodes: list[FakeProxy]) -> SimpleClientManager:
    """A client manager with ``nodes`` registered."""
    m = SimpleClientManager()
    for node in nodes:
        m.register(node)
    return m


def partition_nodes(n: int, base: int = 7_000_000, sizes: list[int] | None = None,
                    held_out: list[int] | None = None) -> list[FakeProxy]:
    """Nodes serving partitions 0..n-1 (of ``sizes``, default :data:`SIZE` each, and
    ``held_out`` samples, default none)."""
    return [FakeProxy(str(base + 13 * pid), pid, sizes[pid] if sizes else SIZE,
                      held_out[pid] if held_out else 0) for pid in range(n)]


def partition_manager(n: int, base: int = 7_000_000, sizes: list[int] | None = None,
                      held_out: list[int] | None = None) -> SimpleClientManager:
    """A client manager with :func:`partition_nodes`."""
    return manager(partition_nodes(n, base, sizes, held_out))


class InProcessGrid:
    """Flower's grid for an in-process federation: node ``k`` (id ``1000 + k``) runs
    ``app`` (the project's ClientApp, mods included) with partition ``k`` of the run
    config ``run_config`` (and the node config ``node_configs[k]``, if given); each
    message is copied, as the wire would. ``sent`` and ``received`` hold every message
    the server sent and every reply it got, in order; ``public_keys`` (node id -> PEM
    bytes) are what ``get_nodes`` reports, as a SuperLink with node authentication does.

    Messages are handled one at a time (:data:`IN_PROCESS_NODES`), also when the server
    sends from several threads, as Flower's ``fit_clients`` does."""

    def __init__(self, app, run_config: dict[str, Any], n_nodes: int,
                 node_configs: dict[int, dict[str, Any]] | None = None, *,
                 public_keys: dict[int, bytes] | None = None):
        self.app = app
        extra = node_configs or {}
        self.contexts = {1000 + k: Context(1, 1000 + k, {"partition-id": k,
                                                         "num-partitions": n_nodes,
                                                         **extra.get(k, {})},
                                           RecordDict(), dict(run_config))
                         for k in range(n_nodes)}
        self.public_keys = public_keys or {}
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def get_nodes(self) -> list[NodeInfo]:
        return [NodeInfo(node_id=nid, public_key=self.public_keys.get(nid, b""))
                for nid in self.contexts]

    def manager(self) -> SimpleClientManager:
        """A client manager holding a Flower proxy for every node."""
        return manager([GridClientProxy(nid, self, 1) for nid in self.contexts])

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        with IN_PROCESS_NODES:
            return self._handle(list(messages))

    def _handle(self, messages: list[Message]) -> list[Message]:
        replies = []
        for msg in messages:
            self.sent.append(copy.deepcopy(msg))
            msg = copy.deepcopy(msg)
            try:
                reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as err:  # what a SuperNode sends back for a failed ClientApp
                reply = Message(Error(1, f"{type(err).__name__}: {err}"), reply_to=msg)
            replies.append(copy.deepcopy(reply))
        self.received.extend(replies)
        return replies


SHAPE = ClassifierShape(3, 4)  # the K x D of GLOBAL


def make_pipeline(cfg, plan_sizes: list[int] | None = None, max_private: int = 4000,
                  shape: ClassifierShape = SHAPE, evaluator=lambda weights: (0.0, 0.0),
                  plan_held_out: list[int] | None = None, allowlist=None) -> RoundPipeline:
    """The round pipeline of run config ``cfg`` (its method's server hooks)."""
    server = load_object(method_of(cfg).server)(cfg, shape)
    weight = (cfg.max_client_samples or max(plan_sizes or [max_private])
              if cfg.secure_aggregation else None)  # common.data_plan.secure_weight's M
    rule = SizeRule(cfg.num_clients, plan_sizes, max_private, plan_held_out,
                    secure_weight=weight)
    return RoundPipeline(cfg, method_of(cfg), server,
                         PartitionRegistry(rule, allowlist=allowlist,
                                           wait_for_nodes=cfg.wait_for_nodes),
                         evaluator)


class RoundDriver:
    """Drives a pipeline through Flower's Strategy calls as the round loop does:
    ``configure_fit`` plans round t and builds its :class:`RoundStrategy`,
    ``aggregate_fit`` goes to that strategy, :meth:`fields` is the round's record."""

    def __init__(self, pipeline: RoundPipeline):
        self.pipeline = pipeline
        self.strategy: RoundStrategy | None = None

    @property
    def server(self):
        return self.pipeline.server

    @property
    def registry(self):
        return self.pipeline.registry

    def configure_fit(self, server_round, parameters, client_manager):
        plan = self.pipeline.plan(server_round, parameters, client_manager)
        self.strategy = RoundStrategy(self.pipeline, plan)
        return self.strategy.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        return self.strategy.aggregate_fit(server_round, results, failures)

    def fields(self) -> dict[str, Any]:
        """The last round's record fields: the plan's and the aggregation's."""
        outcome = self.strategy.outcome
        return {**self.strategy.plan.record, **(outcome.record if outcome else {})}


def make_driver(**overrides: Any) -> RoundDriver:
    """A :class:`RoundDriver` for the run config ``overrides`` (prestopping off unless
    given), with the 2-array model :data:`GLOBAL` (K = 3 classes, 4 features), private
    data bounded by 4,000 samples and a stub evaluation."""
    return RoundDriver(make_pipeline(load_run_config({"prestopping": False, **overrides})))


def trained_reply(node: FakeProxy, arrays: list[np.ndarray], num_examples: int | None = None,
                  **metrics) -> tuple[ClientProxy, FitRes]:
    """A training reply of ``node`` (counting its declared size unless told otherwise)."""
    n = node.num_examples if num_examples is None else num_examples
    return node, FitRes(OK, ndarrays_to_parameters(arrays), n,
                        {"partition-id": node.partition_id, **metrics})


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process now (``/proc/PID/stat``;
    state ``Z``: exited, not reaped)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def records(out: Path) -> list[dict]:
    """A run's metrics.jsonl ([] before its first record)."""
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for_round(out: Path, rnd: int, timeout: float | None = None,
                   ended: Callable[[], bool] = lambda: False) -> None:
    """Until the run writing ``out`` has recorded round ``rnd`` or a later one, or
    ``ended()`` says its job is over (whatever it recorded); TimeoutError after
    ``timeout`` (default ``patience(1800)``). A line still being written, or a file a
    restarted attempt just removed, is read again at the next look."""
    timeout = patience(1800) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ended() or any(r["round"] >= rnd for r in records(out)):
                return
        except (json.JSONDecodeError, FileNotFoundError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"round {rnd} not recorded in {out} within {timeout:.0f} s")


def simulate(data_dir: Path, out: Path, method: str, **keys) -> tuple[dict, list[dict]]:
    """3 rounds of ``method`` on 4 IID clients of the tiny MNIST folder (LeNet, one local
    epoch, noise (0.4, 0.4), no prestopping) through ``flwr run``; (summary, records)."""
    overrides = [f"{k}={v}" for k, v in {
        "method": f'"{method}"', "dataset": '"mnist"', "data-dir": f'"{data_dir}"',
        "model": '"lenet"', "num-clients": 4, "rounds": 3, "local-epochs": 1,
        "batch-size": 16, "prestopping": "false", "iid": "true", "rho": 0.4, "zeta": 0.4,
        **keys}.items()]
    summary = run_simulation_job(resolve_run_config(None, overrides, str(out)))
    return summary, records(out)


def small_job(data_dir: Path, out: Path, **extra) -> dict[str, Any]:
    """The run config of a 6-round FedEFC job on 4 IID clients of the tiny MNIST folder
    (prestopping can trigger from round 2). Its clients keep nothing across rounds
    (``q-pooling = "none"``), so a resumed job ends exactly as an uninterrupted one."""
    base = {"dataset": '"mnist"', "data-dir": f'"{data_dir}"', "model": '"lenet"',
            "num-clients": 4, "fraction": 1.0, "rounds": 6, "local-epochs": 1,
            "batch-size": 16, "start-round": 1, "gamma-thr": 1, "rho": 0.3, "zeta": 0.4,
            "iid": "true", "client-threads": 1, "accuracy-signal": '"global"',
            "q-pooling": '"none"', **extra}
    return resolve_run_config(None, [f"{k}={v}" for k, v in base.items()], str(out))
