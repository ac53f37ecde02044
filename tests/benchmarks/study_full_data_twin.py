"""Study: would a model trained on ALL the data, beside today's FedEFC, pay the share back?

Under full participation FedEFC's clients keep a validation share out of training
(docs/FEDEFC.md §3.1, §3.6), and most of the runs it ends below FedAvg were already
behind at T_e. This script measures one more way to pay less (docs/RESULTS.md, "A twin
trained on all the data"): every client trains two models each round, in one process as
bench_simulation.py's plain loop does (the same ``MethodClient``, data plan, sampling and
client seeds; weights averaged by sample count):

- the **probe**, today's defaults: the share held out, A(t) read on it, T_e by the
  prestopping rule, in phase 2 Q counted on the share and the forward-corrected loss;
- the **twin**, on all of the client's data: cross-entropy in phase 1 (FedAvg, bit for
  bit), and in phase 2 the forward-corrected loss with the Q the probe's client counted
  that round (out of sample: the probe never trained on the share).

Both are the halves of one run with ``twin-model = "on"`` (``common/twin.py``,
``MethodClient.fit``): the probe's half is what the run without a twin trains.

The phase-2 guard (``fedefc_server/guard.py``'s rule, replayed on the probe's A(t))
ends both when it fires, each delivering its model of the round the guard kept. FedAvg
runs beside them. Per seed it prints final and last-10 accuracy (a run the guard ended
holds its delivered model over the rounds it did not train) and their differences to
FedAvg.

    python tests/benchmarks/study_full_data_twin.py --set num-clients=5 --set fraction=1.0 \\
        [--preset P] [--seeds 0 1 2] [--json OUT.json]
    python tests/benchmarks/study_full_data_twin.py --report A.json B.json ...

The studies of docs/RESULTS.md are stored in results/study-full-data-twin/ (one JSON
per setting, its config inside).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from flwr.app import RecordDict

from common.data_plan import data_plan
from common.methods import load_run_config
from common.params import get_weights
from common.runtime import initial_model
from common.training import configure_threads, pick_device
from common.twin import halves, paired
from fedefc_cli.run_configs import resolve_run_config
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.guard import Phase2Guard
from fedefc_server.plan import round_config, sample_round
from fedefc_server.prestopping import Prestopper
from tests.plain_loop import sample_weighted_mean


def run(flat: dict) -> tuple[dict[str, list[float]], list[float | None], int | None]:
    """One seed: the test accuracy per round (0..T) of FedAvg, of the probe and of the
    twin (the two halves of the twinned run's global pair), the probe's A(t) per round
    (None in round 0), T_e."""
    cfg = load_run_config({**flat, "twin-model": "on"})
    fa_cfg = load_run_config({**flat, "method": "fedavg"})
    configure_threads(cfg.client_threads)
    fed = data_plan(cfg)
    device = pick_device(cfg.device)
    evaluator = TestSetEvaluator(cfg, fed.data)
    w0 = get_weights(initial_model(cfg, fed.data.task))
    pair, wf = paired(w0), w0
    stopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
    n = cfg.num_clients
    states = {p: RecordDict() for p in range(n)}
    local = [partition_data(cfg, p, device) for p in range(n)]
    local_fa = [partition_data(fa_cfg, p, device) for p in range(n)]

    def evaluate(weights):
        twin, probe = halves(weights)
        return evaluator(twin)[1], evaluator(probe)[1]
    acc = {"fedavg": [evaluator(wf)[1]], "twin": [], "probe": []}
    for name, a in zip(("twin", "probe"), evaluate(pair)):
        acc[name].append(a)
    signal: list[float | None] = [None]
    for rnd in range(1, cfg.rounds + 1):
        phase = stopper.phase(rnd)
        replies, replies_fa = [], []
        for pid in sample_round(cfg, list(range(n)), rnd):
            config = round_config(cfg, pid, rnd)
            client = MethodClient(cfg, pid, lambda p=pid: local[p], states[pid])
            replies.append(client.fit(pair, {**config, "phase": phase}))
            fedavg = MethodClient(fa_cfg, pid, lambda p=pid: local_fa[p], RecordDict())
            replies_fa.append(fedavg.fit(wf, config))
        accs = [m["accuracy"] for _, _, m in replies if "accuracy" in m]
        a_t = float(np.mean(accs)) if accs else None
        signal.append(a_t)
        if phase == 1 and a_t is not None:
            stopper.observe(rnd, a_t)
        pair, wf = sample_weighted_mean(replies, pair), sample_weighted_mean(replies_fa, wf)
        acc["fedavg"].append(evaluator(wf)[1])
        for name, a in zip(("twin", "probe"), evaluate(pair)):
            acc[name].append(a)
    return acc, signal, stopper.t_e


def guarded(acc_probe: list[float], acc_twin: list[float], signal: list[float | None],
            t_e: int | None, start_round: int, patience: int) -> tuple[list, list]:
    """(probe curve, twin curve) as the phase-2 guard on the probe's A(t) ends them: fired
    in round t, each delivers its model of the round the guard kept (the model that
    round received: the one after round ``best_round - 1``)."""
    if t_e is None:
        return acc_probe, acc_twin
    guard = Phase2Guard(start_round, patience)
    for t in range(1, len(acc_probe)):
        if signal[t] is not None and \
                guard.observe(t, signal[t], phase_2_model=t - 1 > t_e) == "fired":
            kept = guard.best_round - 1
            return acc_probe[:t] + [acc_probe[kept]], acc_twin[:t] + [acc_twin[kept]]
    return acc_probe, acc_twin


def held_last10(curve: list[float], rounds: int) -> float:
    """The mean of the last 10 planned rounds, a run that ended early holding its
    delivered model (``common.results.mean_last10_held``)."""
    full = curve + [curve[-1]] * (rounds + 1 - len(curve))
    return float(np.mean(full[-10:]))


def differences(study: dict) -> list[dict[str, tuple[float, float]]]:
    """Per seed of a study's JSON: the probe's and the twin's (final, last 10) minus
    FedAvg's, in points, each run ended where the guard ended it; and whether FedAvg
    fell 3 points or more from its best to its final round (it memorized)."""
    cfg = load_run_config(study["config"])
    out = []
    for run_ in study["runs"].values():
        acc, fa = run_["acc"], run_["acc"]["fedavg"]
        ends = guarded(acc["probe"], acc["twin"], run_["signal"], run_["t_e"],
                       cfg.start_round, cfg.gamma_thr)
        row = {name: (100 * (c[-1] - fa[-1]),
                      100 * (held_last10(c, cfg.rounds) - held_last10(fa, cfg.rounds)))
               for name, c in zip(("probe", "twin"), ends)}
        out.append({**row, "memorized": max(fa) - fa[-1] >= 0.03})
    return out


def report(paths: list[str]) -> None:
    """The pooled differences of the studies in ``paths`` (their ``--json`` files)."""
    rows = [row for path in paths for row in differences(json.loads(Path(path).read_text()))]
    print(f"{len(rows)} runs")
    for name in ("probe", "twin"):
        final, last = [r[name][0] for r in rows], [r[name][1] for r in rows]
        memorized = [r[name][0] for r in rows if r["memorized"]]
        print(f"{name}: final - FedAvg mean {statistics.mean(final):+.1f}, least "
              f"{min(final):+.1f}, {sum(x < -1 for x in final)} more than 1 below; last 10 "
              f"mean {statistics.mean(last):+.1f}, least {min(last):+.1f}, "
              f"{sum(x < -1 for x in last)} more than 1 below; where FedAvg memorized "
              f"({len(memorized)} runs) final mean "
              + (f"{statistics.mean(memorized):+.1f}" if memorized else "-"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="pool the differences of earlier --json files; runs nothing")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    base = resolve_run_config(args.preset, args.overrides, "")
    cfg = load_run_config(base)
    rows = {"fedavg": [], "probe": [], "twin": []}
    dump = {}
    for seed in args.seeds:
        acc, signal, t_e = run({**base, "seed": seed})
        p, t = guarded(acc["probe"], acc["twin"], signal, t_e, cfg.start_round,
                       cfg.gamma_thr)
        f = acc["fedavg"]
        dump[seed] = {"acc": acc, "signal": signal, "t_e": t_e}
        res = {name: (c[-1], held_last10(c, cfg.rounds)) for name, c in
               (("fedavg", f), ("probe", p), ("twin", t))}
        for k, v in res.items():
            rows[k].append(v)
        print(f"seed {seed}: T_e {t_e} ended {len(p) - 1} | " + " | ".join(
            f"{k} {100 * v[0]:.1f}/{100 * v[1]:.1f}" for k, v in res.items())
            + f" | twin-fedavg {100 * (res['twin'][0] - res['fedavg'][0]):+.1f}/"
              f"{100 * (res['twin'][1] - res['fedavg'][1]):+.1f}"
            + f" probe-fedavg {100 * (res['probe'][0] - res['fedavg'][0]):+.1f}/"
              f"{100 * (res['probe'][1] - res['fedavg'][1]):+.1f}", flush=True)
    for k in ("probe", "twin"):
        d = [(100 * (a[0] - b[0]), 100 * (a[1] - b[1])) for a, b in zip(rows[k], rows["fedavg"])]
        print(f"{k}: final-fedavg mean {statistics.mean(x for x, _ in d):+.2f} min "
              f"{min(x for x, _ in d):+.1f} below-1 {sum(x < -1 for x, _ in d)}; last10 mean "
              f"{statistics.mean(y for _, y in d):+.2f} min {min(y for _, y in d):+.1f} "
              f"below-1 {sum(y < -1 for _, y in d)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": base, "runs": dump}))


if __name__ == "__main__":
    main()
