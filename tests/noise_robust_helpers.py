"""Helpers of the FedCorr, FedNoRo and RoFL tests.

- In-process nodes (:class:`FakeNode`) that drive a strategy without Ray: they answer
  the registry's partition-id query and reply to task messages with metrics computed
  from the message config.
- :func:`simulate`: a real 3-round Flower simulation of a method on 4 small clients.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.common import FitRes, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from common.config import load_run_config
from common.results import RunRecorder
from fedefc_server.launch import resolve_run_config, run_simulation_job
from tests.test_strategy import GLOBAL, OK, PARAMS, FakeProxy

__all__ = ["GLOBAL", "PARAMS", "FakeNode", "make_strategy", "manager", "simulate",
           "trained_reply"]


class FakeNode(FakeProxy):
    """A node serving partition ``pid``; ``answer(config)`` gives its task replies' metrics."""

    def __init__(self, pid: int, answer: Callable[[dict], dict] | None = None):
        super().__init__(str(5_000_000 + 7 * pid), pid)
        self.pid = pid
        self.answer = answer
        self.tasks: list[dict] = []

    def fit(self, ins, timeout, group_id):
        self.tasks.append(dict(ins.config))
        return FitRes(OK, ins.parameters, 0, {"partition-id": self.pid, **self.answer(ins.config)})


def manager(nodes: list[FakeNode]) -> SimpleClientManager:
    m = SimpleClientManager()
    for node in nodes:
        m.register(node)
    return m


def make_strategy(cls, tmp_path, **overrides):
    """A strategy of class ``cls`` whose test-set evaluation is a stub."""
    cfg = load_run_config({"prestopping": False, **overrides})
    return cls(cfg, lambda weights: (0.0, 0.0), RunRecorder(tmp_path, cfg.to_flat()), PARAMS)


def trained_reply(node: FakeNode, num_examples: int, arrays: list[np.ndarray],
                  **metrics) -> tuple[ClientProxy, FitRes]:
    """A phase-1 training reply of ``node``."""
    return node, FitRes(OK, ndarrays_to_parameters(arrays), num_examples,
                        {"partition-id": node.pid, "accuracy": 0.5, **metrics})


def simulate(data_dir: Path, out: Path, method: str, **keys) -> tuple[dict, list[dict]]:
    """3 rounds of ``method`` on 4 IID clients of the tiny MNIST folder (LeNet, one local
    epoch, noise (0.4, 0.4), no prestopping) through ``flwr run``; (summary, records)."""
    overrides = [f"{k}={v}" for k, v in {
        "method": f'"{method}"', "dataset": '"mnist"', "data-dir": f'"{data_dir}"',
        "model": '"lenet"', "num-clients": 4, "rounds": 3, "local-epochs": 1,
        "batch-size": 16, "prestopping": "false", "iid": "true", "rho": 0.4, "zeta": 0.4,
        **keys}.items()]
    summary = run_simulation_job(resolve_run_config(None, overrides, str(out)))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, records
