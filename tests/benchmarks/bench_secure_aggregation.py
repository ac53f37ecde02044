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

``--shares``: the verifiable shares' own cost per round instead (common/
verifiable_shares.py; docs/PRIVACY.md, "Shares a holder can check"), at 5 and 10
nodes, every holder of every secret (num-shares = 0) and the threshold Flower rounds
0.67 to: every node deals b and sk1 (a 306-byte PEM key), every holder checks the two
shares of each other node, the server checks every node's returned share of b and
combines each b; against Flower's own Shamir (``create_shares``, ``combine_shares``)
doing the dealing and combining, measured alternately in the same invocation. The
seconds are the work of all the parties added up (in a round they run in parallel on
their own machines; in a simulation on the simulation's CPUs), as this process's CPU
time, so that a busy machine does not inflate them.

    python tests/benchmarks/bench_secure_aggregation.py --shares [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from common.config import secagg_shares
from common.verifiable_shares import combine, deal, verify
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job


def round_seconds(out: Path) -> list[float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    failed = [r["round"] for r in recs if r.get("failures")]
    if failed:
        raise SystemExit(f"{out}: clients failed in rounds {failed}; not a measurement")
    return [r["round_s"] for r in recs if r["round"] > 1]


def verifiable_round(nodes: int, threshold: int) -> float:
    """Seconds of one round's share work with verifiable shares (module docstring)."""
    ids = list(range(1000, 1000 + nodes))
    start = time.process_time()
    dealt = {d: [deal(os.urandom(n), threshold, ids) for n in (32, 306)] for d in ids}
    for holder in ids:
        at = ids.index(holder)
        for dealer in ids:
            if dealer != holder:
                for commitment, shares in dealt[dealer]:
                    assert verify(shares[at], commitment, holder) is None
    for owner in ids:
        commitment, shares = dealt[owner][0]
        for at, holder in enumerate(ids):
            assert verify(shares[at], commitment, holder) is None
        combine(shares)
    return time.process_time() - start


def flower_round(nodes: int, threshold: int) -> float:
    """Seconds of the same round's dealing and combining with Flower's Shamir."""
    start = time.process_time()
    dealt = {d: [create_shares(os.urandom(n), threshold, nodes) for n in (32, 306)]
             for d in range(nodes)}
    for owner in range(nodes):
        combine_shares(dealt[owner][0])
    return time.process_time() - start


def shares_main(repeats: int) -> None:
    for nodes in (5, 10):
        _, threshold = secagg_shares(0, 0.67, nodes)
        ours, flowers = [], []
        for _ in range(repeats):
            ours.append(verifiable_round(nodes, threshold))
            flowers.append(flower_round(nodes, threshold))
        mine, theirs = statistics.median(ours), statistics.median(flowers)
        print(f"{nodes} nodes, threshold {threshold}: verifiable shares {mine:.3f} CPU s/round, "
              f"Flower's Shamir {theirs:.3f} CPU s/round (median of {repeats}), ratio "
              f"{mine / theirs:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shares", action="store_true")
    args = ap.parse_args()
    if args.shares:
        shares_main(args.repeats)
        return
    if not args.data_dir:
        ap.error("--data-dir is required (or --shares)")
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
