"""A grid's cells run in one process: the project's round loop, server hooks and clients,
without Flower's transport (a study tool, as the other scripts beside it).

``fedefc grid run`` runs every cell through ``flwr run`` (a SuperLink, Ray actors, a
message per client and round): on the 2-core machine that costs 30-60 s a cell before
any training and about a second a round, which dominates the small federations of
``configs/grids/fresh-federations.toml``. Here each cell is the same
:class:`fedefc_server.round_loop.RoundLoop` over the same pipeline, method server,
clean set, registry and :class:`fedefc_client.client.MethodClient`, whose nodes answer
in this process (the node state of each partition kept across rounds, as a simulated
SuperNode keeps it). The cell's folder gets what the grid's report reads
(``config.json``, ``metrics.jsonl``, ``summary.json``), so ``fedefc grid report`` and
its ``paired.md`` read these folders as they read a Flower grid's. Runs of the two
runners agree in what they compute, not bit for bit (the threads' float sums differ).

    PYTHONPATH=. python tests/benchmarks/grid_in_process.py fresh-federations \\
        --results-dir /abs/runs [--row LABEL ...] [--column LABEL ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from flwr.app import RecordDict
from flwr.common import FitRes, GetPropertiesRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

from common.data_plan import data_plan
from common.methods import load_run_config
from common.models import classifier_shape
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from common.twin import paired
from fedefc_cli.grid import Grid
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server.clean_set import attach_clean_set
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.guard import ModelGuard
from fedefc_server.prestopping_server import PrestoppingServer
from fedefc_server.round_loop import RoundLoop
from tests.helpers import OK, FakeProxy, make_pipeline

CPU = torch.device("cpu")


class Node(FakeProxy):
    """A simulated node of one partition: the project's client, its state kept."""

    def __init__(self, cfg, partition_id: int):
        self.cfg, self.state = cfg, RecordDict()
        super().__init__(f"node-{partition_id}", partition_id)

    def client(self) -> MethodClient:
        return MethodClient(self.cfg, self.partition_id,
                            lambda: partition_data(self.cfg, self.partition_id, CPU),
                            self.state)

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(OK, self.client().get_properties({}))

    def fit(self, ins, timeout, group_id):
        weights, n, metrics = self.client().fit(parameters_to_ndarrays(ins.parameters),
                                                ins.config)
        return FitRes(OK, ndarrays_to_parameters(weights), n, metrics)


def run_cell(config: dict, out: Path) -> dict:
    """One cell's run into ``out``; its summary."""
    cfg = load_run_config({**config, "out-dir": str(out)})
    data = partition_data(cfg, 0, CPU).data
    model = initial_model(cfg, data.task)
    sizes = [len(idx) for idx in data_plan(cfg).client_indices]
    pipeline = make_pipeline(cfg, plan_sizes=sizes, shape=classifier_shape(model, data.task),
                             evaluator=TestSetEvaluator(cfg, data))
    attach_clean_set(pipeline.server, cfg, simulation=True)
    manager = SimpleClientManager()
    for pid in range(cfg.num_clients):
        manager.register(Node(cfg, pid))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.recorded(), indent=1))
    weights = get_weights(model)
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(paired(weights) if cfg.twinned
                                                       else weights),
                     cfg=cfg, recorder=RunRecorder(out, cfg.to_flat()), model=model,
                     run_info={"runner": "in process (tests/benchmarks/grid_in_process.py)"})
    loop.set_max_workers(1)
    loop.fit(cfg.rounds, None)
    return json.loads((out / "summary.json").read_text())


def record_only() -> None:
    """The guard of every run in this process judges as usual (its verdicts logged, its
    readings recorded) but hands back FedAvg's model and never ends the run."""
    judge = ModelGuard.judge

    def judge_and_train_on(self, t, read, received, proposed, **keys):
        judge(self, t, read, received, proposed, **keys)
        return proposed
    ModelGuard.judge = judge_and_train_on
    PrestoppingServer.finished = lambda self: False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="configs/grids/<name>.toml name or a grid file")
    ap.add_argument("--results-dir", type=Path, required=True)
    ap.add_argument("--row", dest="rows", action="append", default=None)
    ap.add_argument("--column", dest="columns", action="append", default=None)
    ap.add_argument("--record-only", action="store_true",
                    help="the phase-2 guard reads and records every round but never "
                         "restores a model or ends a run: every run trains all its "
                         "rounds, and any delivery rule can be replayed on its records "
                         "(tests/benchmarks/fresh_report.py)")
    args = ap.parse_args(argv)
    if args.record_only:
        record_only()
    # one thread (the clients' configure_threads reads it): a client's two OpenMP threads
    # on a loaded 2-core machine spin at every barrier (measured: 40x slower rounds)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    grid = Grid.load(args.grid)
    cells = [c for c in grid.cells(args.results_dir.resolve(), [])
             if (args.rows is None or c.row in args.rows)
             and (args.columns is None or c.column in args.columns)]
    todo = [c for c in cells if not c.done]
    print(f"grid {grid.name}: {len(cells)} cells, {len(todo)} to run", flush=True)
    for i, cell in enumerate(todo, 1):
        if cell.out_dir.exists():
            shutil.rmtree(cell.out_dir)  # an interrupted attempt: run it again
        start = time.monotonic()
        print(f"[{i}/{len(todo)}] {cell.row} | {cell.column} | seed {cell.seed}", flush=True)
        summary = run_cell(cell.config, cell.out_dir)
        print(f"    final acc {summary.get('final_acc')}, T_e {summary.get('t_e')}, "
              f"{time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
