"""Benchmark: the same FL job through Flower's simulation vs a plain single-process loop.

Both sides run the same clients (FedEFCClient.fit), model, data plan, client sampling,
per-client seeds, prestopping and test evaluation; the plain loop just calls the client
objects one after another in one process and averages weights with NumPy, with no
Flower, no Ray and no SuperLink. Each side is timed as a whole process (interpreter
start, imports and data loading included), alternating A B A B, and the script prints
the wall times, their ratio (target: Flower <= 1.3x the plain loop on 2 cores) and both
final accuracies.

    python tests/benchmarks/bench_simulation.py --data-dir /abs/path/to/data [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def plain_loop(run_config: dict) -> dict:
    """The FL job without Flower (same building blocks, one process)."""
    import numpy as np
    from flwr.app import RecordDict

    from common.config import load_run_config
    from common.federation import federated_data
    from common.params import get_weights
    from common.runtime import initial_model
    from common.training import configure_threads, pick_device
    from fedefc_client.client import FedEFCClient
    from fedefc_client.local_data import partition_data
    from fedefc_server.evaluation import TestSetEvaluator
    from fedefc_server.prestopping import Prestopper
    from fedefc_server.strategy import round_config, sample_round

    start = time.monotonic()
    cfg = load_run_config(run_config)
    configure_threads(cfg.client_threads)
    fed = federated_data(cfg)
    device = pick_device(cfg.device)
    evaluator = TestSetEvaluator(cfg)
    stopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
    weights = get_weights(initial_model(cfg, fed.data))
    states = {pid: RecordDict() for pid in range(cfg.num_clients)}
    accs, round_s = [], []
    for rnd in range(1, cfg.rounds + 1):
        round_start = time.monotonic()
        phase = stopper.phase(rnd)
        replies = []
        for pid in sample_round(cfg, list(range(cfg.num_clients)), rnd):
            client = FedEFCClient(cfg, pid, lambda p=pid: partition_data(cfg, p, device),
                                  states[pid])
            replies.append(client.fit(weights, round_config(cfg, pid, rnd, phase)))
        total = sum(n for _, n, _ in replies)
        weights = [sum(w[i] * (n / total) for w, n, _ in replies).astype(weights[i].dtype)
                   for i in range(len(weights))]
        if phase == 1:
            stopper.observe(rnd, float(np.mean([m["accuracy"] for _, _, m in replies])))
        accs.append(evaluator(weights)[1])
        round_s.append(time.monotonic() - round_start)
    return {"final_acc": accs[-1], "t_e": stopper.t_e, "wall_time_s": time.monotonic() - start,
            "round_s": round_s}


def timed(cmd: list[str]) -> tuple[float, str]:
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return time.monotonic() - start, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="absolute folder holding MNIST/raw")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plain-config", help=argparse.SUPPRESS)  # internal: run the plain loop
    args = ap.parse_args()
    if args.plain_config:
        print(json.dumps(plain_loop(json.loads(Path(args.plain_config).read_text()))))
        return
    from fedefc_server.launch import resolve_run_config

    flower_s, plain_s, results = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            out = Path(tmp) / f"flower-{rep}"
            overrides = [f'data-dir="{args.data_dir}"', f"rounds={args.rounds}", "start-round=3"]
            sets = [arg for o in overrides for arg in ("--set", o)]
            seconds, _ = timed([sys.executable, "-m", "fedefc_server.launch", "run", "mnist-lite",
                                *sets, "--out-dir", str(out)])
            flower_s.append(seconds)
            results["flower"] = json.loads((out / "summary.json").read_text())
            results["flower"]["round_s"] = [json.loads(line)["round_s"] for line in
                                            (out / "metrics.jsonl").read_text().splitlines()[1:]]
            cfg = resolve_run_config("mnist-lite", overrides, str(Path(tmp) / f"plain-{rep}"))
            cfg_file = Path(tmp) / "plain.json"
            cfg_file.write_text(json.dumps(cfg))
            seconds, stdout = timed([sys.executable, __file__, "--data-dir", args.data_dir,
                                     "--plain-config", str(cfg_file)])
            plain_s.append(seconds)
            results["plain"] = json.loads(stdout.strip().splitlines()[-1])
            print(f"repeat {rep}: flower {flower_s[-1]:.1f} s, plain {plain_s[-1]:.1f} s",
                  flush=True)
    ratios = [f / p for f, p in zip(flower_s, plain_s)]
    print(f"mnist-lite, {args.rounds} rounds (start-round 3), 10 of 100 clients per round")
    print(f"flower simulation wall s : median {statistics.median(flower_s):.1f}  {flower_s}")
    print(f"plain loop wall s        : median {statistics.median(plain_s):.1f}  {plain_s}")
    print(f"ratio flower/plain       : median {statistics.median(ratios):.2f}  "
          f"{[round(r, 2) for r in ratios]}  (target <= 1.3)")
    steady = {k: statistics.median(results[k]["round_s"][1:]) for k in ("flower", "plain")}
    print(f"steady round s (2..)     : flower {steady['flower']:.2f}  plain {steady['plain']:.2f}  "
          f"ratio {steady['flower'] / steady['plain']:.2f}")
    print(f"round 1 s                : flower {results['flower']['round_s'][0]:.1f}  plain "
          f"{results['plain']['round_s'][0]:.1f}  (flower: node registry + actor warm-up)")
    fixed = statistics.median(flower_s) - sum(results["flower"]["round_s"])
    print(f"flower outside rounds s  : {fixed:.1f}  (SuperLink, flwr run, Ray start, "
          "ServerApp start, shutdown)")
    print(f"final accuracy           : flower {results['flower']['final_acc']:.4f}  "
          f"plain {results['plain']['final_acc']:.4f}; T_e flower {results['flower']['t_e']} "
          f"plain {results['plain']['t_e']}")


if __name__ == "__main__":
    main()
