"""Benchmark: the server's check of the shares returned in a SecAgg+ unmask stage
(fedefc_server/share_check.py; docs/PRIVACY.md, "Shares a holder can check"), one by
one (``wrong_shares`` per holder: every share's Feldman check, about n^2 t point
multiplications for n nodes and threshold t) against in batches (``wrong_returned``:
each owner's returned shares checked at once, about n t), measured alternately in one
invocation as this process's CPU time (a busy machine does not inflate it). Every
node is active: each holder returns its share of each node's mask seed b.

    python tests/benchmarks/bench_share_check.py [--nodes 10,20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from flwr.common.secure_aggregation.secaggplus_constants import Key

from common.config import secagg_shares
from common.verifiable_shares import deal
from fedefc_server.share_check import wrong_returned, wrong_shares


def unmask_stage(nodes: int) -> tuple[dict, dict]:
    """({holder: (its request, its reply)}, {owner: its two commitments}) of a round of
    ``nodes`` honest nodes, threshold as Flower rounds 0.67."""
    ids = list(range(1000, 1000 + nodes))
    threshold = secagg_shares(0, 0.67, nodes)[1]
    dealt = {owner: deal(os.urandom(32), threshold, ids) for owner in ids}
    commitments = {owner: [c, c] for owner, (c, _) in dealt.items()}
    request = {Key.ACTIVE_NODE_ID_LIST: ids, Key.DEAD_NODE_ID_LIST: []}
    returned = {h: (request, {Key.NODE_ID_LIST: ids,
                              Key.SHARE_LIST: [dealt[o][1][i] for o in ids]})
                for i, h in enumerate(ids)}
    return returned, commitments


def seconds(check) -> float:
    start = time.process_time()
    check()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="10,20")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for nodes in (int(n) for n in args.nodes.split(",")):
        returned, commitments = unmask_stage(nodes)
        one, batch = [], []
        for _ in range(args.repeats):
            one.append(seconds(lambda: [wrong_shares(*returned[h], h, commitments)
                                        for h in returned]))
            batch.append(seconds(lambda: wrong_returned(returned, commitments)))
        assert wrong_returned(returned, commitments) == {}
        a, b = statistics.median(one), statistics.median(batch)
        print(f"{nodes} nodes: one by one {a:.3f} s, in batches {b:.3f} s per round "
              f"(CPU, median of {args.repeats}); ratio {a / b:.1f}", flush=True)


if __name__ == "__main__":
    main()
