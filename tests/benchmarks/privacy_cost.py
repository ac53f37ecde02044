"""Measure what secure aggregation and client-side DP cost at mnist-lite (docs/PRIVACY.md).

FedEFC on the mnist-lite preset ((alpha, p) = (10, 0.5), (rho, zeta) = (0.2, 0.8), seed
0, 100 rounds), one full run per configuration, one after the other: plain,
``secure-aggregation = true``, and ``dp-clip = C`` with each noise multiplier. Printed
per run: final accuracy, mean of the last 10 rounds, best, T_e, A_max, the median and
mean seconds per round, and the rounds with failed clients (a run with failures is not
a measurement). Runs already in ``--out`` are read, not repeated.

    python tests/benchmarks/privacy_cost.py --data-dir /abs/mnist --out /abs/dir \\
        [--dp-clip 1.0] [--dp-noise 0.01,0.1,0.001,0.0,1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job


def run(out: Path, data_dir: str, name: str, keys: dict) -> Path:
    folder = out / name
    if not (folder / "summary.json").exists():
        overrides = [f'data-dir="{data_dir}"', *(f"{k}={v}" for k, v in keys.items())]
        run_simulation_job(resolve_run_config("mnist-lite", overrides, str(folder)),
                           log_path=out / f"{name}.log")
    return folder


def row(name: str, folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["round_s"] for r in recs if r["round"] > 0]
    return {"run": name, "final_acc": summary["final_acc"],
            "mean_last10_acc": summary["mean_last10_acc"], "best_acc": summary["best_acc"],
            "t_e": summary.get("t_e"), "A_max": summary.get("A_max"),
            "round_s_median": statistics.median(seconds), "round_s_mean": statistics.mean(seconds),
            "rounds_with_failures": [r["round"] for r in recs if r.get("failures")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dp-clip", type=float, default=1.0)
    ap.add_argument("--dp-noise", default="0.01,0.1,0.001,0.0,1.0")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    configs = {"plain": {}, "secagg": {"secure-aggregation": "true"}}
    for z in args.dp_noise.split(","):
        configs[f"dp-c{args.dp_clip:g}-z{z}"] = {"dp-clip": args.dp_clip,
                                                 "dp-noise-multiplier": z}
    rows = [row(name, run(out, args.data_dir, name, keys)) for name, keys in configs.items()]
    print("| run | final acc | mean last 10 | best | T_e | A_max | s/round median (mean) "
          "| rounds with failures |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['final_acc']:.4f} | {r['mean_last10_acc']:.4f} | "
              f"{r['best_acc']:.4f} | {r['t_e']} | {r['A_max']:.6f} | {r['round_s_median']:.2f} "
              f"({r['round_s_mean']:.2f}) | {r['rounds_with_failures'] or 'none'} |")
    (out / "privacy-cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
