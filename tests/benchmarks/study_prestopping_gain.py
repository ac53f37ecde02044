"""Study: where would T_e fall if a rise of A(t) smaller than its own sampling error did not
count as a rise? Replayed on recorded runs, no training.

The prestopping rule (docs/FEDEFC.md §3.3) counts any A(t) above the best as progress.
With the held-out signal on large shares A(t) can creep up by a tenth of a point per
round for twenty rounds (full MNIST, non-IID, (0.4, 0.8): docs/RESULTS.md, "Cross-silo
on full MNIST"), so T_e never comes. This script replays the rule with a minimum gain:
a round counts as progress only when A(t) > A_max + z * SE(t), where SE(t) is the
standard error of the unweighted mean of the clients' accuracies on their shares,
sqrt(A(t) (1 - A(t)) * sum_k 1 / n_k) / K (n_k: client k's share size, from its reply's
sample count and the run's validation keys, ``common/data_plan.py: validation_count``).
The run is a pure function of its config and seed, so every recorded run whose T_e the
rule leaves unchanged would end exactly as recorded; only the runs it changes need
running again. It first replays the strict rule (z = 0) and checks it gives every
recorded T_e.

    python tests/benchmarks/study_prestopping_gain.py [--results results] [--z 0.5,1,2]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from common.data_plan import validation_count
from fedefc_server.prestopping import Prestopper


def prestopping_point(rounds: list[tuple[int, float, float]], start: int, gamma: int,
                      z: float) -> int | None:
    """T_e of (round, A(t), SE(t)) under the server's rule (:class:`Prestopper`) with a
    minimum gain of z * SE(t)."""
    stopper = Prestopper(start, gamma)
    for t, a, se in rounds:
        if stopper.observe(t, a, z * se):
            return stopper.t_e
    return None


def phase_1_signal(run: Path, summary: dict, cfg: dict) -> list[tuple[int, float, float]]:
    """(round, A(t), SE(t)) of a recorded run's phase-1 rounds (T_e included)."""
    fraction = cfg.get("validation-fraction", 0.4)
    cap = cfg.get("validation-max-per-class", 0) * summary.get("num_classes", 10)
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines()[1:]:
        rec = json.loads(line)
        if rec.get("A") is None or rec.get("phase") != 1:
            continue
        shares = [validation_count(fraction, cap, m) for m in rec["num_examples"]]
        a, k = rec["A"], len(shares)
        out.append((rec["round"], a,
                    math.sqrt(max(a * (1 - a), 1e-12) * sum(1 / n for n in shares)) / k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--z", default="0.5,1,2", help="minimum gains, in standard errors")
    args = ap.parse_args()
    zs = [float(z) for z in args.z.split(",")]
    runs = []
    for path in sorted(args.results.glob("**/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("accuracy_signal") != "held-out" or summary.get("method") != "fedefc":
            continue
        cfg = json.loads((path.parent / "config.json").read_text())
        if cfg.get("prestopping-min-gain", 0.0):  # a run of the rule under study itself
            continue
        signal = phase_1_signal(path.parent, summary, cfg)
        replay = [prestopping_point(signal, cfg["start-round"], cfg["gamma-thr"], z)
                  for z in (0.0, *zs)]
        runs.append((path.parent.relative_to(args.results), summary.get("t_e"), replay))
    wrong = [r for r in runs if r[1] != r[2][0]]
    print(f"{len(runs)} recorded FedEFC runs with the held-out signal and the strict rule; "
          f"replayed, the rule gives their recorded T_e in {len(runs) - len(wrong)}")
    for run, recorded, replay in wrong:
        print(f"  NOT REPRODUCED {run}: recorded {recorded}, replayed {replay[0]}")
    for i, z in enumerate(zs, start=1):
        changed = [(run, replay[0], replay[i]) for run, _, replay in runs
                   if replay[i] != replay[0]]
        never = sum(1 for _, before, _ in changed if before is None)
        earlier = sum(1 for _, before, after in changed
                      if before is not None and after is not None and after < before)
        print(f"z = {z}: T_e changes in {len(changed)} of {len(runs)} runs ({earlier} earlier, "
              f"{never} that never left phase 1 now do)")
        for run, before, after in changed:
            print(f"    {run}: {before} -> {after}")


if __name__ == "__main__":
    main()
