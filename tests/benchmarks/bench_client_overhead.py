"""Benchmark: what a client pays per training message beyond its training steps.

One process holds the clients of the first ``--clients`` partitions of a run (data
loaded once, as a simulation's worker process holds them) and hands each of them the
same global model, as the ClientApp does: ``MethodClient.fit`` for FedAvg, FedEFC's
phase 1 (the paper's ``global`` signal) and FedEFC's phase 2 (Q counted, then the
forward-corrected loss). Each message is timed whole, and so are the training steps in
it (``common.training.train_batches``, the batches, forward, backward and optimizer
steps); the rest is the client's overhead: the model's weights in and out, the prediction
pass over the local data where the method or the signal reads it (docs/FEDEFC.md §3.1,
§4), Q, and the reply's metrics. Medians over ``--repeats`` rounds of every client.

``--compare DIR`` runs the same measurement in a fresh process from another copy of the
project (``git archive COMMIT | tar -x -C DIR``), then this one: a before/after on the
same machine, the two interleaved ``--pairs`` times. Numbers: docs/BENCHMARKS.md,
"A client's overhead per message".

    python tests/benchmarks/bench_client_overhead.py [--data-dir /abs/data] [--device cpu]
        [--clients 10] [--repeats 3] [--compare DIR] [--pairs 2]

Without ``--data-dir`` it runs the embedded MNIST subset (100 clients of 40 images);
with it, the mnist-lite preset (full MNIST, 100 clients of 600, LeNet-5, E = 5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = (("fedavg", None), ("fedefc", 1), ("fedefc", 2))


def run_config(data_dir: str | None, method: str, device: str) -> dict:
    keys = {"method": method, "client-threads": 1, "device": device}
    if data_dir is None:
        return {"num-clients": 100, "fraction": 0.1, "local-epochs": 5, **keys}
    preset = tomllib.loads((ROOT / "configs" / "mnist-lite.toml").read_text())
    return {**preset, "data-dir": data_dir, **keys}


def measure(data_dir: str | None, device: str, clients: int, repeats: int) -> dict:
    """{case: (median ms per message, median ms of training steps)} in this process."""
    from flwr.app import RecordDict

    import common.training as training
    import fedefc_client.job as job_module
    from common.data_plan import data_plan
    from common.methods import load_run_config
    from common.params import get_weights
    from common.runtime import initial_model
    from common.training import configure_threads, pick_device
    from fedefc_client.client import MethodClient
    from fedefc_client.local_data import partition_data
    from fedefc_server.plan import round_config

    configure_threads(1)
    steps_s = [0.0]
    train_batches = training.train_batches

    def timed_steps(*args, **kwargs):
        begin = time.perf_counter()
        result = train_batches(*args, **kwargs)
        steps_s[0] += time.perf_counter() - begin
        return result

    job_module.train_batches = training.train_batches = timed_steps
    out = {}
    for method, phase in CASES:
        cfg = load_run_config(run_config(data_dir, method, device))
        dev = pick_device(cfg.device)
        weights = get_weights(initial_model(cfg, data_plan(cfg).data.task))
        pool = {pid: MethodClient(cfg, pid, lambda p=pid, c=cfg, d=dev: partition_data(c, p, d),
                                  RecordDict()) for pid in range(clients)}
        whole, steps = [], []
        for rnd in range(repeats + 1):  # round 0 warms up (data, model, allocator)
            for pid, client in pool.items():
                config = round_config(cfg, pid, rnd + 2)
                if phase is not None:
                    config["phase"] = phase
                steps_s[0] = 0.0
                begin = time.perf_counter()
                client.fit(weights, config)
                if rnd:
                    whole.append(time.perf_counter() - begin)
                    steps.append(steps_s[0])
        label = method if phase is None else f"{method}, phase {phase}"
        out[label] = (1000 * statistics.median(whole), 1000 * statistics.median(steps))
    return out


def in_fresh_process(checkout: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--device", args.device,
           "--clients", str(args.clients), "--repeats", str(args.repeats)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout,
                          env={**os.environ, "PYTHONPATH": str(checkout.resolve())})
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", help="absolute folder holding MNIST/raw (mnist-lite)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another checkout, measured first")
    ap.add_argument("--pairs", type=int, default=2, help="with --compare: interleaved pairs")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.data_dir, args.device, args.clients, args.repeats)))
        return
    runs = {"this checkout": []}
    if args.compare:
        runs = {str(args.compare): [], "this checkout": []}
    for _ in range(args.pairs if args.compare else 1):
        for name in runs:
            runs[name].append(in_fresh_process(ROOT if name == "this checkout"
                                               else args.compare, args))
    data = f"mnist-lite at {args.data_dir}" if args.data_dir else "the embedded MNIST"
    print(f"{data}, {args.clients} clients x {args.repeats} rounds, device {args.device}; "
          "ms per training message (median; over pairs, the median of the medians)")
    print(f"{'checkout':<28} {'case':<18} {'message':>8} {'steps':>8} {'overhead':>9} "
          f"{'share':>6}")
    medians = {}
    for name, results in runs.items():
        for case in results[0]:
            whole = statistics.median(r[case][0] for r in results)
            steps = statistics.median(r[case][1] for r in results)
            medians[name, case] = whole - steps
            print(f"{name[-28:]:<28} {case:<18} {whole:8.1f} {steps:8.1f} "
                  f"{whole - steps:9.1f} {(whole - steps) / whole:6.1%}")
    if args.compare:
        for case in runs["this checkout"][0]:
            before, after = medians[str(args.compare), case], medians["this checkout", case]
            print(f"overhead {case}: {before:.1f} -> {after:.1f} ms per message "
                  f"({before - after:+.1f} ms saved)")


if __name__ == "__main__":
    main()
