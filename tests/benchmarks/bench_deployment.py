"""Benchmark: the same short FL job on Flower's deployment runtime vs its simulation runtime.

Deployment: :class:`fedefc_cli.deploy_local.LocalDeployment` on 127.0.0.1 (SuperLink + its
SuperExec, one SuperNode + SuperExec per client, ``--isolation process``: a fresh
ClientApp process per message, prepared data from the disk cache) and ``flwr run``.
Simulation: ``fedefc run``'s path (simulation SuperLink + Ray, 1 CPU per client).
Same run config on both sides; with ``--client-threads 1`` (the default) the final
weights must be bitwise equal, with 0 each side picks its own thread count (Ray actor:
1, ClientApp process: all cores) and only float-level differences are expected.

Printed per side: the wall time from starting the first Flower process to the run's end
(start-up included), the job's own wall time (summary.json), and per round ``round_s``,
the client compute (the slowest client's ``fit-s``: its local update, data loading
excluded; clients run in parallel) and the overhead (``round_s`` minus that compute).
Then the ratios deployment / simulation, and how far apart the two final models are.

    python tests/benchmarks/bench_deployment.py [--rounds 5] [--clients 3] [--client-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedefc_cli.deploy_local import LocalDeployment, NodeSpec
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job


def run_config(out_dir: Path, args: argparse.Namespace) -> dict:
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist-embedded"', "model": '"lenet"', "num-clients": args.clients,
        "fraction": 1.0, "rounds": args.rounds, "local-epochs": 1, "batch-size": 32,
        "start-round": 2, "gamma-thr": 2, "rho": 0.4, "zeta": 0.4,
        "accuracy-signal": '"global"', "open-deployment": "true",  # no allowlist
        "client-threads": args.client_threads,
    }.items()]
    return resolve_run_config(None, overrides, str(out_dir))


def rounds(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["round"] > 0]


def simulate(work: Path, args: argparse.Namespace) -> tuple[Path, float]:
    out = work / "sim"
    start = time.monotonic()
    run_simulation_job(run_config(out, args), log_path=work / "sim.log")
    return out, time.monotonic() - start


def deploy(work: Path, args: argparse.Namespace) -> tuple[Path, float]:
    out = work / "dep"
    nodes = [NodeSpec({"partition-id": k, "num-partitions": args.clients,
                       "cache-dir": str(work / f"cache-{k}")}) for k in range(args.clients)]
    start = time.monotonic()
    with LocalDeployment(work / "federation", nodes) as dep:
        _, status = dep.run(run_config(out, args))
    if status != "finished:completed":
        raise SystemExit(f"deployment run ended {status}; logs in {work / 'federation'}")
    return out, time.monotonic() - start


def report(name: str, out: Path, wall: float) -> dict:
    recs = rounds(out)
    job = json.loads((out / "summary.json").read_text())["wall_time_s"]
    print(f"\n{name}: wall {wall:.1f} s (start-up included), job {job:.1f} s, "
          f"final acc {recs[-1]['test_acc']:.4f}, T_e {recs[-1]['t_e']}")
    print("  round  round_s  compute_s  overhead_s")
    overheads = []
    for r in recs:
        compute = max(r["fit_s"])
        overheads.append(r["round_s"] - compute)
        print(f"  {r['round']:5d}  {r['round_s']:7.2f}  {compute:9.2f}  {overheads[-1]:10.2f}")
    later = overheads[1:] or overheads
    print(f"  overhead per round: round 1 {overheads[0]:.2f} s (node registry, data "
          f"preparation), later rounds mean {statistics.mean(later):.2f} s")
    return {"wall": wall, "job": job, "overhead_1": overheads[0],
            "overhead_later": statistics.mean(later),
            "round_s": statistics.mean(r["round_s"] for r in recs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--client-threads", type=int, default=1,
                    help="torch threads per client; 0: each runtime's default")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="fedefc-bench-dep-") as tmp:
        work = Path(tmp)
        sim_out, sim_wall = simulate(work, args)
        dep_out, dep_wall = deploy(work, args)
        sim = report("simulation", sim_out, sim_wall)
        dep = report("deployment", dep_out, dep_wall)
        wa, wb = torch.load(sim_out / "model.pt"), torch.load(dep_out / "model.pt")
        same = all(torch.equal(wa[k], wb[k]) for k in wa)
        diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
        last_sim, last_dep = rounds(sim_out)[-1], rounds(dep_out)[-1]
    print(f"\nratio deployment/simulation: wall {dep['wall'] / sim['wall']:.2f}x, "
          f"job {dep['job'] / sim['job']:.2f}x, mean round {dep['round_s'] / sim['round_s']:.2f}x")
    print(f"deployment overhead per round minus simulation's: "
          f"{dep['overhead_later'] - sim['overhead_later']:+.2f} s (rounds >= 2)")
    print(f"final weights identical: {same} (max |dw| {diff:.3g}); final accuracy gap "
          f"{100 * abs(last_sim['test_acc'] - last_dep['test_acc']):.2f} points; "
          f"T_e {last_sim['t_e']} vs {last_dep['t_e']}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0 if same or args.client_threads != 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
