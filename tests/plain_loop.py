"""A run's rounds without Flower: the same clients (``MethodClient.fit``), data plan,
client sampling, per-client seeds, prestopping and test evaluation in one process, the
weights averaged with NumPy. The plain side of tests/benchmarks/bench_simulation.py (the
floor no framework can beat) and of the studies beside it."""

from __future__ import annotations

import time

import numpy as np
from flwr.app import RecordDict

from common.data_plan import data_plan
from common.methods import load_run_config
from common.models import classifier_shape
from common.params import get_weights
from common.runtime import initial_model
from common.training import configure_threads, pick_device
from common.twin import delivered, paired
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.plan import round_config, sample_round
from fedefc_server.prestopping_server import PrestoppingServer


def sample_weighted_mean(replies: list[tuple[list, int, dict]], like: list) -> list:
    """FedAvg's aggregate of ``(weights, num_examples, metrics)`` fit replies: each array
    the mean of the replies' weighted by their sample counts, in ``like``'s dtypes."""
    total = sum(n for _, n, _ in replies)
    return [sum(w[i] * (n / total) for w, n, _ in replies).astype(like[i].dtype)
            for i in range(len(like))]


def plain_loop(run_config: dict) -> dict:
    """The FL job without Flower (same building blocks, one process): its final test
    accuracy, T_e, wall time and each round's seconds."""
    start = time.monotonic()
    cfg = load_run_config(run_config)
    configure_threads(cfg.client_threads)
    fed = data_plan(cfg)
    device = pick_device(cfg.device)
    evaluator = TestSetEvaluator(cfg, fed.data)
    weights = get_weights(initial_model(cfg, fed.data.task))
    weights = paired(weights) if cfg.twinned else weights  # docs/FEDEFC.md §3.8
    server = PrestoppingServer(cfg, classifier_shape(initial_model(cfg, fed.data.task),
                                                     fed.data.task))
    stopper = server.prestopper
    states = {pid: RecordDict() for pid in range(cfg.num_clients)}

    def client(pid: int, state) -> MethodClient:
        return MethodClient(cfg, pid, lambda: partition_data(cfg, pid, device), state)

    accs, round_s = [], []
    for rnd in range(1, cfg.rounds + 1):
        round_start = time.monotonic()
        phase = stopper.phase(rnd)
        sampled = sample_round(cfg, list(range(cfg.num_clients)), rnd)
        configs = {pid: {**round_config(cfg, pid, rnd), **server.client_config(rnd, pid)}
                   for pid in sampled}
        replies = [client(pid, states[pid]).fit(weights, configs[pid]) for pid in sampled]
        weights = sample_weighted_mean(replies, weights)
        if phase == 1:
            stopper.observe(rnd, float(np.mean([m["accuracy"] for _, _, m in replies])))
        accs.append(evaluator(delivered(weights, cfg.twinned))[1])
        round_s.append(time.monotonic() - round_start)
    return {"final_acc": accs[-1], "t_e": stopper.t_e, "wall_time_s": time.monotonic() - start,
            "round_s": round_s, "accs": accs}
