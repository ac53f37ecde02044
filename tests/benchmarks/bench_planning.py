"""Planning a round at scale: round 1 (the registry learns every node) beside round 2;
and the batch gather the training loop uses against advanced indexing.

Runs FedAvg on mnist-lite's data (full MNIST, LeNet, one local epoch) with 10 clients
per round and 100, 1,000 and 10,000 simulated nodes through ``fedefc run``, and prints
the seconds of round 1 and round 2 (``round_s`` of metrics.jsonl) and their ratio. In a
simulation the registry reads the partitions from Flower's engine and asks only the
sampled nodes for their declarations (docs/BENCHMARKS.md, "Planning a round"), so round 1
holds 10 declaration messages and the round's training. With ``--floor``, beside each:
the no-op app (``tests/flower_apps/noop``) sending one empty message to every node in the
same kind of simulation, Flower's own cost of asking every node once (what round 1 paid
before the registry asked only the sampled nodes).

First it times, in this process on one thread (as a client runs), gathering a batch of 64
MNIST images out of 600 with ``index_select`` against ``x[idx]``, and prints the ratio.

    python tests/benchmarks/bench_planning.py --data-dir /tmp/mnist [--nodes 100,1000,10000]
        [--floor]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from fedefc_cli.flower import LocalSimulation
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job

NOOP_APP = Path(__file__).resolve().parents[1] / "flower_apps" / "noop"


def one(data_dir: str, nodes: int, out: Path) -> dict:
    overrides = [f"{k}={v}" for k, v in {
        "method": '"fedavg"', "dataset": '"mnist"', "data-dir": f'"{data_dir}"',
        "model": '"lenet"', "num-clients": nodes, "fraction": 10 / nodes, "rounds": 2,
        "local-epochs": 1, "batch-size": 64, "client-threads": 1, "start-round": 1}.items()]
    start = time.monotonic()
    run_simulation_job(resolve_run_config(None, overrides, str(out)),
                       log_path=out.with_suffix(".log"))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"nodes": nodes, "round_1_s": records[1]["round_s"],
            "round_2_s": records[2]["round_s"], "job_s": time.monotonic() - start}


def floor(nodes: int, work: Path) -> float:
    """Seconds of Flower's no-op app sending one message to each of ``nodes`` simulated
    nodes and receiving the replies (its round 0, the registry's query)."""
    work.mkdir(parents=True)
    with LocalSimulation(work) as sim:
        _, status = sim.run({"nodes": nodes, "rounds": 0, "query": True,
                             "out-dir": str(work / "out")}, nodes, 1, 0.0, app_dir=NOOP_APP,
                            log_path=work / "run.log")
    if status != "finished:completed":
        raise SystemExit(f"the no-op app's run ended {status}; see {work / 'run.log'}")
    return json.loads((work / "out" / "metrics.jsonl").read_text().splitlines()[0])["round_s"]


def gather_us(gather, repeats: int = 2000) -> float:
    """Mean microseconds of ``gather()`` after a warm-up."""
    gather()
    start = time.perf_counter()
    for _ in range(repeats):
        gather()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="absolute folder holding MNIST/raw")
    ap.add_argument("--nodes", default="100,1000,10000")
    ap.add_argument("--floor", action="store_true",
                    help="also time Flower's no-op app messaging every node once")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randint(0, 256, (600, 1, 28, 28), dtype=torch.uint8)
    idx = torch.randperm(600, generator=torch.Generator().manual_seed(0))[:64]
    indexed, selected = gather_us(lambda: x[idx]), gather_us(lambda: x.index_select(0, idx))
    print(f"batch of 64 of 600 uint8 images: x[idx] {indexed:.0f} us, index_select "
          f"{selected:.0f} us, ratio {indexed / selected:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.nodes.split(",")):
            row = one(args.data_dir, n, Path(tmp) / f"n{n}")
            print(f"{row['nodes']:>6} nodes: round 1 {row['round_1_s']:6.1f} s, round 2 "
                  f"{row['round_2_s']:5.1f} s, ratio {row['round_1_s'] / row['round_2_s']:5.1f}"
                  f" (whole job {row['job_s']:.0f} s)", flush=True)
            if args.floor:
                base = floor(n, Path(tmp) / f"floor{n}")
                print(f"{n:>6} nodes: Flower's floor, one no-op message per node {base:6.1f} s;"
                      f" round 1 / floor {row['round_1_s'] / base:5.2f}", flush=True)


if __name__ == "__main__":
    main()
