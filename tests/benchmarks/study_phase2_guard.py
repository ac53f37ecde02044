"""Study: FedEFC's phase 2 under full participation, with and without the phase-2 guard.

The choices of docs/FEDEFC.md §3.4 and §4.8 (the guard's rule, what it does when it
fires, the estimator) were measured with this script. It runs the project's clients in
one process, as bench_simulation.py's plain loop does (the same ``MethodClient``, data
plan, sampling, client seeds and prestopping rule; weights averaged by sample count),
and records in every round the test accuracy of the global model and its held-out A:
the mean over the clients of its accuracy on their validation shares, which is what a
guarded run's clients report one round later. Per seed it runs

- FedAvg;
- FedEFC with ``phase-2-guard = "off"`` for each ``--estimator`` (the trajectory a
  guard would watch), from which the guard's rule (``fedefc_server/guard.py``) is
  replayed offline for each patience and margin (a margin of z standard errors of A(t),
  from the shares' sizes): when it fires in round r (it hears of the model of round r
  in round r + 1, as in a run), the run ends with the best model, so its final
  accuracy is that model's and its last records are the rounds up to r + 1;
- FedEFC whose guard, when it fires, restores the best model and then trains plain
  cross-entropy on all the data, the share included (``--fallback-all``; online).

It prints per variant the mean final accuracy and mean of the last 10 rounds, their
differences to FedAvg per seed, and how many seeds ended more than 1 point below.

    python tests/benchmarks/study_phase2_guard.py --set num-clients=5 --set fraction=1.0 \\
        [--preset cross-silo] [--seeds 0 1 2] [--patience 2 3] [--margin 0 1] \\
        [--fallback-all] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import RecordDict

from common.data_plan import data_plan
from common.methods import load_run_config
from common.params import get_weights, set_weights
from common.runtime import initial_model, model_for
from common.training import BatchTransform, configure_threads, pick_device, predict_proba
from fedefc_cli.run_configs import resolve_run_config
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.plan import round_config, sample_round
from fedefc_server.prestopping import Prestopper


@dataclass
class Trajectory:
    """Per round 0..T: the global model's test accuracy and held-out A; T_e; the shares'
    sizes; the round the online guard fired in (fallback runs)."""

    acc: list[float]
    held_out: list[float | None]
    t_e: int | None
    shares: list[int]
    fired: int | None = None


def run(flat: dict, fallback_patience: int | None = None) -> Trajectory:
    """One run; with ``fallback_patience`` the guard runs online and, when it fires,
    restores the best model and trains cross-entropy on all the data from then on."""
    cfg = load_run_config(flat)
    configure_threads(cfg.client_threads)
    fed = data_plan(cfg)
    device = pick_device(cfg.device)
    evaluator = TestSetEvaluator(cfg, fed.data)
    weights = get_weights(initial_model(cfg, fed.data.task))
    stopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
    states = {pid: RecordDict() for pid in range(cfg.num_clients)}
    locals_ = [partition_data(cfg, pid, device) for pid in range(cfg.num_clients)]
    probe = model_for(cfg, fed.data.task, device, slot="server")

    def held_out(w: list[np.ndarray]) -> float | None:
        if locals_[0].validation is None:
            return None
        set_weights(probe, w)
        accs = []
        for local in locals_:
            val = torch.as_tensor(local.validation, device=device)
            pred = predict_proba(probe, local.x.index_select(0, val),
                                 BatchTransform.of(local.spec, device),
                                 cfg.eval_batch_size).argmax(1)
            accs.append(float(np.mean(pred == local.labels[local.validation])))
        return float(np.mean(accs))

    acc, a_of = [evaluator(weights)[1]], [held_out(weights)]
    best, best_w, worse, fired = -1.0, None, 0, None
    for rnd in range(1, cfg.rounds + 1):
        replies = []
        for pid in sample_round(cfg, list(range(cfg.num_clients)), rnd):
            client = MethodClient(cfg, pid, lambda p=pid: locals_[p], states[pid])
            config = round_config(cfg, pid, rnd)
            if fired is None and cfg.method != "fedavg":
                config["phase"] = stopper.phase(rnd)
            replies.append(client.fit(weights, config))  # no phase: all data, cross-entropy
        total = sum(n for _, n, _ in replies)
        weights = [sum(w[i] * (n / total) for w, n, _ in replies).astype(weights[i].dtype)
                   for i in range(len(weights))]
        if stopper.phase(rnd) == 1 and "accuracy" in replies[0][2]:
            stopper.observe(rnd, float(np.mean([m["accuracy"] for _, _, m in replies])))
        a_of.append(held_out(weights))
        if fallback_patience is not None and fired is None and a_of[-1] is not None \
                and rnd > cfg.start_round:
            if a_of[-1] > best:
                best, best_w, worse = a_of[-1], weights, 0
            elif stopper.t_e is not None and rnd > stopper.t_e:
                worse += 1
                if worse >= fallback_patience:
                    fired, weights = rnd, best_w
        acc.append(evaluator(weights)[1])
    sizes = [0 if local.validation is None else len(local.validation) for local in locals_]
    return Trajectory(acc, a_of, stopper.t_e, sizes, fired)


def replay_guard(tr: Trajectory, start_round: int, patience: int, z: float) -> list[float]:
    """The test-accuracy records of the guarded run (docs/FEDEFC.md §3.4): the rule of
    ``Phase2Guard`` on the recorded held-out A, with a margin of ``z`` standard errors."""
    if tr.t_e is None:
        return tr.acc
    best, best_round, worse = -1.0, None, 0
    for r in range(start_round + 1, len(tr.acc)):
        a = tr.held_out[r]
        if a > best:
            best, best_round, worse = a, r, 0
            continue
        if r <= tr.t_e:
            continue
        margin = z * float(np.sqrt(sum(best * (1 - best) / n for n in tr.shares))) / len(
            tr.shares)
        worse = worse + 1 if a < best - margin else 0
        if worse >= patience:
            end = min(r + 1, len(tr.acc) - 1)  # the run hears of round r's model in r + 1
            return tr.acc[:end] + [tr.acc[best_round]]
    return tr.acc


def stats(curve: list[float]) -> tuple[float, float]:
    return curve[-1], float(np.mean(curve[-10:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--estimator", nargs="+", default=["counted", "shrunk"])
    ap.add_argument("--patience", type=int, nargs="+", default=None,
                    help="guard patience values (default: the run's gamma-thr)")
    ap.add_argument("--margin", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--fallback-all", action="store_true")
    ap.add_argument("--json", help="write every trajectory here")
    args = ap.parse_args()
    base = resolve_run_config(args.preset, [*args.overrides, "phase-2-guard=\"off\""], "")
    cfg = load_run_config(base)
    patience = args.patience or [cfg.gamma_thr]
    curves: dict[str, dict[int, list[float]]] = {}
    dump = {}
    for seed in args.seeds:
        fedavg = run({**base, "method": "fedavg", "seed": seed})
        curves.setdefault("FedAvg", {})[seed] = fedavg.acc
        for est in args.estimator:
            tr = run({**base, "seed": seed, "q-estimator": est})
            dump[f"{est}-s{seed}"] = tr.__dict__
            curves.setdefault(f"{est}, no guard", {})[seed] = tr.acc
            for p in patience:
                for z in args.margin:
                    curves.setdefault(f"{est}, guard p{p} z{z:g}, ends", {})[seed] = \
                        replay_guard(tr, cfg.start_round, p, z)
            if args.fallback_all:
                for p in patience:
                    fb = run({**base, "seed": seed, "q-estimator": est}, fallback_patience=p)
                    curves.setdefault(f"{est}, guard p{p}, then all data", {})[seed] = fb.acc
        print(f"seed {seed} done", flush=True)
    ref = {s: stats(c) for s, c in curves["FedAvg"].items()}
    print(f"{'variant':34s} {'final':>6s} {'last10':>6s}  diff to FedAvg per seed (final/last10)")
    for name, by_seed in curves.items():
        st = {s: stats(c) for s, c in by_seed.items()}
        d = {s: (100 * (st[s][0] - ref[s][0]), 100 * (st[s][1] - ref[s][1])) for s in st}
        below = sum(a < -1 for a, _ in d.values())
        print(f"{name:34s} {100 * statistics.mean(v[0] for v in st.values()):6.1f} "
              f"{100 * statistics.mean(v[1] for v in st.values()):6.1f}  "
              + " ".join(f"{a:+.1f}/{b:+.1f}" for a, b in d.values())
              + f"  ({below} of {len(d)} more than 1 point below)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": base, "curves": curves, "runs": dump}, fh)


if __name__ == "__main__":
    main()
