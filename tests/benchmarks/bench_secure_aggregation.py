"""Benchmark: seconds per round of FedEFC with secure aggregation against without, measured
in the same invocation, interleaved (plain, secure, plain, secure, ...) so that both see
the same machine.

Each run is the mnist-lite preset cut to ``--rounds`` rounds (start-round 3, so phase 2
runs too) through ``fedefc run``'s path (simulation SuperLink, Ray, 1 CPU per client).
Round 1 is left out of the per-round times: it holds the partition registry's one-time
queries of the 100 nodes. Printed: per run the median and mean ``round_s`` of rounds
2..R, then the medians over the repeats and the ratio secure / plain.

    python tests/benchmarks/bench_secure_aggregation.py --data-dir /abs/mnist \\
        [--rounds 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job


def round_seconds(out: Path) -> list[float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    failed = [r["round"] for r in recs if r.get("failures")]
    if failed:
        raise SystemExit(f"{out}: clients failed in rounds {failed}; not a measurement")
    return [r["round_s"] for r in recs if r["round"] > 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    medians: dict[str, list[float]] = {"plain": [], "secure": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in ("plain", "secure"):
                out = Path(tmp) / f"{mode}-{rep}"
                keys = [f'data-dir="{args.data_dir}"', f"rounds={args.rounds}",
                        "start-round=3", f"secure-aggregation={str(mode == 'secure').lower()}"]
                run_simulation_job(resolve_run_config("mnist-lite", keys, str(out)),
                                   log_path=Path(tmp) / f"{mode}-{rep}.log")
                seconds = round_seconds(out)
                medians[mode].append(statistics.median(seconds))
                print(f"{mode} #{rep + 1}: round_s median {statistics.median(seconds):.2f}, "
                      f"mean {statistics.mean(seconds):.2f} (rounds 2..{args.rounds})",
                      flush=True)
    plain, secure = (statistics.median(medians[m]) for m in ("plain", "secure"))
    print(f"median s/round: plain {plain:.2f}, secure {secure:.2f}, "
          f"ratio secure/plain {secure / plain:.2f}")


if __name__ == "__main__":
    main()
