"""Benchmark: FedEFC in deployment against Flower's own floor, on the same federation.

One :class:`fedefc_cli.deployment.LocalDeployment` on 127.0.0.1 (a SuperLink and its
SuperExec, one SuperNode and SuperExec per client, ``--isolation process``: a fresh app
process per message). On it, one after the other:

- **FedEFC**: mnist-embedded, LeNet, every client sampled every round, 1 local epoch,
  ``client-threads=1``, prepared data from the node's disk cache;
- **Flower's floor**: tests/flower_apps/noop, a ServerApp / ClientApp pair that sends
  the same messages (one ``query`` per node first, then one ``train`` per node per
  round) carrying as many float32 values as LeNet has weights, and does nothing with
  them.

Printed: each app's seconds per round (round 1 apart: it holds the node registry and
FedEFC's data preparation), the messages each SuperNode received (they must match), the
ratio FedEFC / floor and the difference per round, FedEFC's local update (the slowest
``fit-s``: training only, timed inside the client), and what remains: the project's own
per-message cost above the floor. Then the ClientApp module's import time in fresh
processes, FedEFC's and the no-op's (``python -X importtime``-free wall clock, median).

    python tests/benchmarks/bench_flower_floor.py [--rounds 5] [--clients 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.methods import load_run_config
from common.models import TaskShape, build_model
from fedefc_cli.deployment import LocalDeployment, NodeSpec
from fedefc_cli.run_configs import APP_DIR, resolve_run_config

NOOP_APP = APP_DIR / "tests" / "flower_apps" / "noop"


def fedefc_config(out: Path, args: argparse.Namespace) -> dict:
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist-embedded"', "model": '"lenet"', "num-clients": args.clients,
        "fraction": 1.0, "rounds": args.rounds, "local-epochs": 1, "batch-size": 32,
        "start-round": 2, "gamma-thr": 2, "rho": 0.4, "zeta": 0.4, "client-threads": 1,
    }.items()]
    return resolve_run_config(None, overrides, str(out))


def model_floats(run_config: dict) -> int:
    """The number of values of the run's model (LeNet on 1 x 28 x 28 MNIST, 10 classes)."""
    cfg = load_run_config(run_config)
    model = build_model(cfg.model, TaskShape((1, 28, 28), 10), cfg.seed)
    return sum(p.numel() for p in model.state_dict().values())


def received(dep: LocalDeployment) -> dict[str, int]:
    """Messages each SuperNode has received so far, by type."""
    counts: dict[str, int] = {}
    for folder in sorted(dep.work_dir.glob("node-*")):
        for kind in re.findall(r"Receiving: (\w+) message", (folder / "supernode.log").read_text()):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def rounds_of(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["round"] > 0]


def run(dep: LocalDeployment, run_config: dict, app_dir: Path) -> tuple[float, dict]:
    before = received(dep)
    start = time.monotonic()
    outcome = dep.submit(run_config, timeout=3600, app_dir=app_dir)
    wall = time.monotonic() - start
    if not outcome.completed:
        raise SystemExit(f"{app_dir.name}: run ended {outcome.verdict}; logs in {dep.work_dir}")
    after = received(dep)
    return wall, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def import_time(module: str, path: Path, repeats: int) -> float:
    """Median wall seconds of a fresh interpreter importing ``module`` (from ``path``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get(
        "PYTHONPATH", "")])}
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", f"import {module}"], env=env, check=True)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="import-time repetitions")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="fedefc-bench-floor-") as tmp:
        work = Path(tmp)
        cfg = fedefc_config(work / "fedefc", args)
        floats = model_floats(cfg)
        noop = {"mode": "ok", "rounds": args.rounds, "nodes": args.clients, "floats": floats,
                "query": True, "out-dir": str(work / "noop")}
        nodes = [NodeSpec({"partition-id": k, "num-partitions": args.clients,
                           "cache-dir": str(work / f"cache-{k}")}) for k in range(args.clients)]
        with LocalDeployment(work / "federation", nodes) as dep:
            dep.wait_online(args.clients)
            noop_wall, noop_msgs = run(dep, noop, NOOP_APP)
            fedefc_wall, fedefc_msgs = run(dep, cfg, APP_DIR)
        fed, flo = rounds_of(work / "fedefc"), rounds_of(work / "noop")
    fed_later = statistics.mean(r["round_s"] for r in fed[1:])
    flo_later = statistics.mean(r["round_s"] for r in flo[1:])
    fit_later = statistics.mean(max(r["fit_s"]) for r in fed[1:])
    print(f"\nmodel: LeNet, {floats} float32 values per message; {args.clients} nodes, "
          f"{args.rounds} rounds")
    print(f"messages received by the SuperNodes: FedEFC {fedefc_msgs}, floor {noop_msgs}")
    print("                      round 1 s   later rounds s (mean)   run wall s")
    for name, recs, later, wall in (("FedEFC", fed, fed_later, fedefc_wall),
                                    ("Flower's floor (noop)", flo, flo_later, noop_wall)):
        print(f"{name:21} {recs[0]['round_s']:9.2f}   {later:21.2f}   {wall:10.1f}")
    print(f"ratio FedEFC / floor: later rounds {fed_later / flo_later:.2f}x, round 1 "
          f"{fed[0]['round_s'] / flo[0]['round_s']:.2f}x, run {fedefc_wall / noop_wall:.2f}x")
    print(f"FedEFC above the floor per later round: {fed_later - flo_later:+.2f} s, of which "
          f"local training (slowest fit-s) {fit_later:.2f} s; the rest, "
          f"{fed_later - flo_later - fit_later:+.2f} s, is the project's own per-message "
          "start-up (imports, data from the cache, model) and the server's evaluation")
    fedefc_import = import_time("fedefc_client.client_app", APP_DIR, args.repeats)
    noop_import = import_time("noop_app.client_app", NOOP_APP, args.repeats)
    print(f"ClientApp module import in a fresh process (median of {args.repeats}): FedEFC "
          f"{fedefc_import:.2f} s, no-op {noop_import:.2f} s, difference "
          f"{fedefc_import - noop_import:+.2f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
