"""Measure how far lying clients move the prestopping point T_e, per accuracy aggregation.

10% of the clients (partitions 0..N/10-1) always report accuracy 1.0, or always 0.0, in
phase 1; everything else is honest. For each aggregation (mean = the paper's, median,
trimmed-mean) the script runs the honest job and the two lying jobs through real Flower
simulations and prints T_e, its shift from the honest run under the same aggregation,
and the final test accuracy.

    python tests/benchmarks/bench_lying_clients.py --preset mnist-lite \\
        --set data-dir=/abs/path/to/data --set rounds=40
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--aggregations", default="mean,median,trimmed-mean")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = resolve_run_config(args.preset, args.overrides, str(Path(tmp) / "probe"))
        liars = f"0-{max(1, base['num-clients'] // 10) - 1}"
        for how in args.aggregations.split(","):
            honest_t_e = None
            for name, fault in (("honest", ""), ("always 1.0", f"acc=1.0@{liars}"),
                                ("always 0.0", f"acc=0.0@{liars}")):
                cfg = resolve_run_config(args.preset, [*args.overrides,
                                                       f"accuracy-aggregation={how}",
                                                       f'faults="{fault}"'],
                                         str(Path(tmp) / f"{how}-{len(rows)}"))
                summary = run_simulation_job(cfg, log_path=Path(tmp) / "runs.log")
                if name == "honest":
                    honest_t_e = summary["t_e"]
                shift = (None if summary["t_e"] is None or honest_t_e is None
                         else summary["t_e"] - honest_t_e)
                rows.append({"aggregation": how, "clients": name, "t_e": summary["t_e"],
                             "shift": shift, "final_acc": summary["final_acc"]})
                print(f"{how:13s} {name:11s} T_e {summary['t_e']}  shift {shift}  "
                      f"final acc {summary['final_acc']:.4f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
