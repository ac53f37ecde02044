"""Benchmark: where a simulation's time outside its rounds goes, piece by piece.

Two views of one ``fedefc run PRESET`` (default mnist-lite, 3 rounds, start-round 1):

1. **The run's milestones**: every line the launcher prints, timed from its start; the
   pieces between the lines Flower and the project print at each step: the launcher's
   imports and its preflight child (data plan, model), the SuperLink's start, ``flwr
   run`` packing and submitting the app, the simulation process's start, the
   ServerApp's build (data, registry), the initial evaluation (round 0; Ray starts
   beside it), round 1 (the Ray actors' first messages: their imports, data, and on a
   GPU their CUDA contexts) against the later rounds, and the end (Ray's and the
   SuperLink's shutdown, ``flwr ls``).
2. **What each piece costs alone**, each in a fresh process (wall seconds): importing
   torch, importing the ClientApp module (what a Ray actor does on its first message),
   ``ray.init`` with two single-CPU actors answering once, loading the run's data plan
   and slicing ten clients' partitions (on ``--device``), the initial evaluation on the
   server's test set.

``--compare DIR`` times the run from another copy of the project too (e.g. ``git
archive COMMIT | tar -x -C DIR``), interleaved, for a before/after under the same load.

    python tests/benchmarks/bench_startup.py --data-dir /abs/data [--preset mnist-lite]
        [--rounds 3] [--repeats 1] [--compare DIR] [--device cpu] [--no-pieces]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (piece, the line that ends it); a piece starts where the one before ended
MILESTONES = [
    ("launcher imports, preflight child", "fedefc: results ->"),
    ("SuperLink start", "Using SuperLink"),
    ("flwr run: pack, submit", "Successfully started run"),
    ("simulation process start", "Starting Flower Simulation"),
    ("ServerApp build (data, registry)", "FedEFC run |"),
    ("initial evaluation (Ray starting beside it)", "[round 0/"),
    ("round 1 (actors' first messages)", "[round 1/"),
]


def milestones(checkout: Path, args: argparse.Namespace, out: Path) -> dict:
    """The launcher's lines timed from its start, cut into :data:`MILESTONES`."""
    cmd = [sys.executable, "-m", "fedefc_cli", "run", args.preset,
           "--set", f'data-dir="{args.data_dir}"', "--set", f"rounds={args.rounds}",
           "--set", "start-round=1", "--set", f'device="{args.device}"',
           *[a for s in args.set for a in ("--set", s)], "--out-dir", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [(time.monotonic() - start, line) for line in proc.stdout]
    wall = time.monotonic() - start
    if proc.wait() != 0:
        raise SystemExit(f"{checkout}: the run failed:\n"
                         + "".join(line for _, line in lines[-30:]))
    at, pieces = 0.0, {}
    for name, marker in MILESTONES:
        when = next(t for t, line in lines if marker in line)
        pieces[name], at = when - at, when
    rounds = [json.loads(x)["round_s"] for x in (out / "metrics.jsonl").read_text()
              .splitlines()[1:]]
    last = next(t for t, line in lines if f"[round {args.rounds}/" in line)
    steady = statistics.median(rounds[1:])
    pieces[f"rounds 2-{args.rounds}"] = last - at
    pieces["end: shutdown, flwr ls, exit"] = wall - last
    pieces["round 1 beyond a steady round"] = pieces["round 1 (actors' first messages)"] - steady
    return {"wall": wall, "steady": steady, "pieces": pieces,
            "outside": wall - sum(rounds) + rounds[0] - steady}


PIECES = {
    "import torch": "import torch",
    "import the ClientApp module": "import fedefc_client.client_app",
    "ray.init + 2 actors answering": """
import ray
ray.init(num_cpus=2, include_dashboard=False, logging_level='ERROR')
@ray.remote(num_cpus=1)
class A:
    def ping(self): return 1
actors = [A.remote() for _ in range(2)]
ray.get([a.ping.remote() for a in actors])
""",
    "data plan + 10 partitions": """
from common.methods import load_run_config
from common.training import pick_device
from fedefc_client.local_data import partition_data
from fedefc_cli.run_configs import resolve_run_config
cfg = load_run_config(resolve_run_config(PRESET, ['data-dir="DATA"'], "/tmp/x"))
[partition_data(cfg, p, pick_device("DEVICE")) for p in range(10)]
""",
    "initial evaluation (server test set)": """
from common.data_plan import data_plan
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from fedefc_cli.run_configs import resolve_run_config
from fedefc_server.evaluation import TestSetEvaluator
cfg = load_run_config(resolve_run_config(PRESET, ['data-dir="DATA"', 'device="DEVICE"'], "/tmp/x"))
fed = data_plan(cfg)
evaluator = TestSetEvaluator(cfg, fed.data)
import time; t = time.monotonic()
evaluator(get_weights(initial_model(cfg, fed.data.task)))
print("EVAL", time.monotonic() - t)
""",
}


def piece_times(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    """Each of :data:`PIECES` in a fresh interpreter: its wall seconds (the evaluation's
    own seconds, without its process's imports and data)."""
    out = {}
    for name, code in PIECES.items():
        code = (code.replace("PRESET", repr(args.preset)).replace("DATA", args.data_dir)
                .replace("DEVICE", args.device))
        start = time.monotonic()
        res = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                             text=True)
        took = time.monotonic() - start
        if res.returncode:
            raise SystemExit(f"{name}: {res.stderr[-2000:]}")
        evals = [line for line in res.stdout.splitlines() if line.startswith("EVAL")]
        out[name] = float(evals[0].split()[1]) if evals else took
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--preset", default="mnist-lite")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--compare", help="another copy of the project, timed the same way")
    ap.add_argument("--no-pieces", action="store_true", help="only the run's milestones")
    args = ap.parse_args()
    checkouts = {"this": ROOT}
    if args.compare:
        checkouts["compare"] = Path(args.compare).resolve()
    runs: dict[str, list[dict]] = {k: [] for k in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for label, checkout in checkouts.items():
                runs[label].append(milestones(checkout, args, Path(tmp) / f"{label}-{rep}"))
    print(f"{args.preset}, {args.rounds} rounds, device {args.device}; medians of "
          f"{args.repeats}; wall seconds")
    names = [*runs["this"][0]["pieces"], "outside the rounds (with round 1's extra)",
             "steady round", "whole run"]
    print(f"{'piece':<46}" + "".join(f"{label:>10}" for label in checkouts))
    for name in names:
        cells = []
        for label in checkouts:
            key = {"outside the rounds (with round 1's extra)": "outside",
                   "steady round": "steady", "whole run": "wall"}.get(name)
            values = [r[key] if key else r["pieces"][name] for r in runs[label]]
            cells.append(f"{statistics.median(values):>10.1f}")
        print(f"{name:<46}" + "".join(cells))
    if args.no_pieces:
        return
    print("each piece alone, in a fresh process (wall s):")
    for label, checkout in checkouts.items():
        for name, seconds in piece_times(checkout, args).items():
            print(f"  {label:<8} {name:<40} {seconds:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
