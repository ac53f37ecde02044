"""Study: where would T_e fall if a rise of A(t) smaller than its own sampling error did not
count as a rise? Replayed on recorded runs, no training.

The prestopping rule (docs/FEDEFC.md §3.3) counts any A(t) above the best as progress.
With the held-out signal on large shares A(t) can creep up by a tenth of a point per
round for twenty rounds (full MNIST, non-IID, (0.4, 0.8): docs/RESULTS.md, "Cross-silo
on full MNIST"), so T_e never comes. This script replays the rule with a minimum gain:
a round counts as progress only when A(t) > A_max + z * SE(t), where SE(t) is the
standard error of the unweighted mean of the clients' accuracies on their shares,
sqrt(A(t) (1 - A(t)) * sum_k 1 / n_k) / K (n_k: client k's share size, from its reply's
sample count and the run's validation keys, ``common/sample_roles.py: validation_count``).
The run is a pure function of its config and seed, so every recorded run whose T_e the
rule leaves unchanged would end exactly as recorded; only the runs it changes need
running again. It first replays the strict rule (z = 0) and checks it gives every
recorded T_e. ``auto`` is the default setting: one standard error where the shares are
large (``fedefc_server/prestopping.py: min_gain_z``). The replay itself is the grid
runner's (``fedefc_server/prestopping_replay.py``).

It reads run folders, which git does not hold: fetch the grids first (``fedefc results
fetch cross-silo``, ``own-data``, ``full-participation``, ``cross-silo-mnist``: docs/RESULTS.md,
"Where the runs are").

    python tests/benchmarks/study_prestopping_gain.py [--results ~/fedefc-results] \
        [--z 0.5,1,2,auto]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedefc_cli.raw_archive import RESULTS_HOME
from fedefc_server.prestopping_replay import replayed_t_e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS_HOME,
                    help="a folder of run folders (default ~/fedefc-results)")
    ap.add_argument("--z", default="0.5,1,2,auto",
                    help="minimum gains, in standard errors, or auto")
    args = ap.parse_args()
    zs = [z if z == "auto" else float(z) for z in args.z.split(",")]
    runs = []
    for path in sorted(args.results.glob("**/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("accuracy_signal") != "held-out" or summary.get("method") != "fedefc":
            continue
        cfg = json.loads((path.parent / "config.json").read_text())
        # a run whose rule asked for a gain is a run of the rule under study itself
        if summary.get("prestopping_min_gain_used", cfg.get("prestopping-min-gain", 0.0)):
            continue
        replay = [replayed_t_e(path.parent, z) for z in (0.0, *zs)]
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
