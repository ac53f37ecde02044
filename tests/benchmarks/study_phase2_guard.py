"""Study: FedEFC's phase 2 under full participation, with and without the phase-2 guard.

The choices of docs/FEDEFC.md §3.4 and §4.8 (the guard's signal and rule, what it does
when it fires, the estimator) were measured with this script. It runs the project's
clients in one process, as bench_simulation.py's plain loop does (the same
``MethodClient``, data plan, sampling, client seeds and prestopping rule; weights
averaged by sample count), and records every round's test accuracy and A(t), the mean
of the accuracies the clients report: with ``phase-2-guard`` on they report in phase 2
too, the guard's signal (the received model's prediction of the share's observed
labels through the Q each client trained it with), and the script records beside it
the plain held-out accuracy of the received model (the signal before it, for the
comparison). The run itself never stops: the guard's rule (``fedefc_server/guard.py``)
is replayed on the recorded signals for each patience and margin (a margin of z
standard errors of A(t), from the shares' sizes). When it fires in round t (round t's
A(t) measures the model of round t - 1), the guarded run ends with the best model, so
its final accuracy is that model's and its last records are rounds up to t. Per seed it
runs FedAvg, FedEFC for each ``--estimator``, and with ``--fallback-all`` FedEFC whose
guard (online) restores the best model and then trains cross-entropy on all the data,
the share included.

Signals observed labels cannot bend (docs/FEDEFC.md §3.9, "Without clean labels"): with
``--trusted 0.8 ...`` the script also records, from round T_e + 1 on, each client's
plain held-out accuracy restricted to its TRUSTED classes, the observed classes i whose
row and column of the Q it counted in its first phase-2 round stay near the identity
(Q[i, i] >= tau and Q[i, i] / sum_j Q[i, j] >= tau), fixed for the rest of the run; the
guard's rule is replayed on it with its scale starting at T_e + 1, as the guard starts a
new scale there (``rebase``), so that phase 2's models must beat phase 1's last. It
also records, from T_e + 1 on, the plain held-out accuracy of the clients whose first
phase-2 Q is DOMINANT (every column's largest entry on its diagonal, ``dominant``: where
the noise keeps each class's label most, a model of the true classes scores the best
plain accuracy any prediction can, whatever Q phase 2 trained it with). Two
signals that read no label are recorded too: the share's fraction on which the twin and
the probe predict the same class (with ``--twin``), and from T_e + 1 on the fraction on
which the received model predicts what phase 1's last model predicted. Besides each
signal's own guard (its best model kept, as today's guard keeps the best A(t)), the
report replays today's guard with a VETO (``replay_veto``): a phase-2 model whose veto
signal falls below phase 1's last model's reading by more than a margin cannot become
the best and counts against phase 2. ``--report A.json ...`` pools stored studies over
every rule. With
``--twin`` FedEFC runs the defaults' twin (docs/FEDEFC.md §3.8: the test accuracy is the
twin's, the signals the probe's); ``--chance`` runs FedAvg again with the learning rate
one part in a million larger, whose least differences to FedAvg are the chance envelope
(docs/RESULTS.md, "How far apart two runs of one method end"), and counts the runs of
each variant below FedAvg beyond it.

It prints per variant the mean final accuracy and mean of the last 10 rounds, their
differences to FedAvg per seed, and how many seeds ended more than 1 point below.
``--fedavg-from STUDY.json`` takes FedAvg's curves from a study of
``study_full_data_twin.py`` on the same config (results/study-full-data-twin/) instead of
running FedAvg again; with ``--twin`` the twin's curve of each seed must then equal the
stored one round for round (the same loop on the same machine), or the script stops.
The ``--json`` file is written after every seed, so that a study cut short keeps the
seeds it finished.

    python tests/benchmarks/study_phase2_guard.py --set num-clients=5 --set fraction=1.0 \\
        [--preset cross-silo] [--seeds 0 1 2] [--patience 2 3] [--margin 0 1] \\
        [--fallback-all] [--twin] [--chance] [--trusted 0.7 0.8] [--json OUT.json] \\
        [--fedavg-from results/study-full-data-twin/NAME.json]
    python tests/benchmarks/study_phase2_guard.py --report A.json B.json ... \\
        [--veto-margin 0 0.01 0.02]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import RecordDict

from common.data_plan import data_plan
from common.methods import load_run_config
from common.params import get_weights, set_weights
from common.runtime import initial_model, model_for
from common.training import configure_threads, pick_device
from common.twin import delivered, halves, paired
from fedefc_cli.run_configs import resolve_run_config
from fedefc_client.node_state import load_vector
from fedefc_client.client import MethodClient
from fedefc_client.job import NOISE_MODEL, LocalJob
from fedefc_client.local_data import partition_data
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.plan import round_config, sample_round
from fedefc_server.prestopping import Prestopper
from tests.plain_loop import sample_weighted_mean

SIGNALS = ("guard", "plain")  # the guard's A(t), and the plain held-out accuracy


@dataclass
class Trajectory:
    """Per round 0..T: the global model's test accuracy; per round 1..T the A(t) of each
    signal (a measure of the model of the round before; None where no share); T_e; the
    shares' sizes; the round the online guard fired in (fallback runs)."""

    acc: list[float]
    signals: dict[str, list[float | None]] = field(default_factory=dict)
    t_e: int | None = None
    shares: list[int] = field(default_factory=list)
    fired: int | None = None
    rebase: dict[str, int] = field(default_factory=dict)  # signal -> round its scale starts


def share_predictions(client: MethodClient, weights, config) -> tuple | None:
    """The received model's argmax predictions on the client's share, the share's
    observed labels, and with a twin the twin's predictions there (None without a
    twin; the first are then the probe's); None without a share."""
    local = client.local
    if local.validation is None:
        return None

    def predict(arrays):
        model = model_for(client.cfg, local.data.task, local.x.device)
        set_weights(model, arrays)
        job = LocalJob(client.cfg, local, model, 1, int(config["round"]), int(config["seed"]))
        return job.probs[job.guard_positions].argmax(1), job.labels[job.guard_positions]

    if not client.cfg.twinned:
        return (*predict(weights), None)
    twin, probe = halves(weights)
    return (*predict(probe), predict(twin)[0])


def trusted_classes(q: np.ndarray, tau: float) -> np.ndarray:
    """The observed classes i whose row and column of ``q`` (rows observed, columns true)
    stay near the identity: Q[i, i] >= tau and Q[i, i] / sum_j Q[i, j] >= tau."""
    diag = np.diag(q)
    return np.flatnonzero((diag >= tau) & (diag >= tau * q.sum(axis=1)))


def dominant(q: np.ndarray) -> bool:
    """Whether every column of ``q`` (rows observed, columns true) has its largest entry on
    the diagonal: the noise keeps each class's label more often than it moves it to any
    one other class, and a model predicting the true class then scores the best plain
    accuracy any prediction can (docs/RESULTS.md, "A signal observed labels cannot
    bend")."""
    off = q - np.diag(np.diag(q))
    return bool(np.all(np.diag(q) > off.max(axis=0)))


def mean_reading(values) -> float | None:
    """The mean of the clients' readings that exist (None without any)."""
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def trusted_accuracy(pred: np.ndarray, labels: np.ndarray, classes: np.ndarray) -> float | None:
    """The plain accuracy on the samples whose observed label is one of ``classes``."""
    keep = np.isin(labels, classes)
    return float(np.mean(pred[keep] == labels[keep])) if keep.any() else None


def run(flat: dict, fallback_patience: int | None = None, twin: bool = False,
        trusted: tuple[float, ...] = (), t_e: int | None = None) -> Trajectory:
    """One run; with ``fallback_patience`` the guard runs online and, when it fires,
    restores the best model and trains cross-entropy on all the data from then on.
    One model per client (twin-model = "off": the guard's choices were studied on the
    model it judges, before the twin, docs/FEDEFC.md §3.8) unless ``twin``; ``trusted``:
    the thresholds of the trusted-class signals to record (module docstring); ``t_e``:
    the prestopping point to take instead of finding one (``--t-e``)."""
    cfg = load_run_config({**flat, **({} if twin else {"twin-model": "off"})})
    configure_threads(cfg.client_threads)
    fed = data_plan(cfg)
    device = pick_device(cfg.device)
    evaluator = TestSetEvaluator(cfg, fed.data)
    weights = get_weights(initial_model(cfg, fed.data.task))
    weights = paired(weights) if cfg.twinned else weights
    stopper = Prestopper(cfg.start_round, cfg.gamma_thr, enabled=cfg.prestopping)
    states = {pid: RecordDict() for pid in range(cfg.num_clients)}
    locals_ = [partition_data(cfg, pid, device) for pid in range(cfg.num_clients)]
    names = [*SIGNALS, *(f"trusted {tau:g}" for tau in trusted)]
    tr = Trajectory([evaluator(delivered(weights, cfg.twinned))[1]], {n: [None] for n in names})
    tr.shares = [0 if lo.validation is None else len(lo.validation) for lo in locals_]
    seen: dict[int, dict[int, tuple]] = {}  # round -> client -> (predictions, labels)
    q_first: dict[int, np.ndarray] = {}  # client -> the Q of its first phase-2 round
    best, best_w, worse = -1.0, None, 0
    for rnd in range(1, cfg.rounds + 1):
        replies, plain = [], []
        for pid in sample_round(cfg, list(range(cfg.num_clients)), rnd):
            client = MethodClient(cfg, pid, lambda p=pid: locals_[p], states[pid])
            config = round_config(cfg, pid, rnd)
            if tr.fired is None and cfg.method != "fedavg":
                config["phase"] = stopper.phase(rnd)
                shared = share_predictions(client, weights, config)
                plain.append(None if shared is None else float(np.mean(shared[0] == shared[1])))
                if shared is not None:
                    seen.setdefault(rnd, {})[pid] = shared
            replies.append(client.fit(weights, config))  # no phase: all data, cross-entropy
            k = fed.data.num_classes
            q = load_vector(states[pid], NOISE_MODEL, k * k)
            if q is not None and pid not in q_first:
                q_first[pid] = q.reshape(k, k)
        accs = [m["accuracy"] for _, _, m in replies if "accuracy" in m]
        a_t = float(np.mean(accs)) if accs else None
        tr.signals["guard"].append(a_t)
        tr.signals["plain"].append(float(np.mean(plain)) if plain and None not in plain
                                   else None)
        if t_e is not None:
            stopper.t_e = t_e if rnd >= t_e else None
        elif stopper.phase(rnd) == 1 and a_t is not None:
            stopper.observe(rnd, a_t)
        new = sample_weighted_mean(replies, weights)
        if fallback_patience is not None and tr.fired is None and a_t is not None \
                and rnd > cfg.start_round:
            if a_t > best:
                best, best_w, worse = a_t, weights, 0
            elif stopper.t_e is not None and rnd - 1 > stopper.t_e:
                worse += 1
                if worse >= fallback_patience:
                    tr.fired, new = rnd, best_w
        weights = new
        tr.acc.append(evaluator(delivered(weights, cfg.twinned))[1])
    tr.t_e = stopper.t_e
    for tau in trusted:  # read on the classes each client fixed at its first phase-2 round
        name = f"trusted {tau:g}"
        for rnd in range(1, cfg.rounds + 1):
            tr.signals[name].append(mean_reading(
                trusted_accuracy(*seen[rnd][pid][:2], trusted_classes(q_first[pid], tau))
                for pid in seen.get(rnd, {}) if pid in q_first and rnd > tr.t_e))
        if tr.t_e is not None:
            tr.rebase[name] = tr.t_e + 1
    # the plain accuracy of the clients whose first phase-2 Q keeps every class's label most
    tr.signals["plain, dominant Q"] = [None] * (cfg.rounds + 1)
    if tr.t_e is not None:
        for rnd in range(tr.t_e + 1, cfg.rounds + 1):
            tr.signals["plain, dominant Q"][rnd] = mean_reading(
                float(np.mean(seen[rnd][pid][0] == seen[rnd][pid][1]))
                for pid in seen.get(rnd, {}) if pid in q_first and dominant(q_first[pid]))
        tr.rebase["plain, dominant Q"] = tr.t_e + 1
    for name, score in label_free(seen, tr.t_e, cfg.rounds).items():
        tr.signals[name] = score
        if tr.t_e is not None and name == "phase-1 agreement":
            tr.rebase[name] = tr.t_e + 1
    return tr


def label_free(seen: dict[int, dict[int, tuple]], t_e: int | None,
               rounds: int) -> dict[str, list[float | None]]:
    """Two signals that read no label, per round 1..T (module docstring): the share's
    fraction on which the twin and the probe predict the same class (a twinned run),
    and from T_e + 1 on the fraction on which the received model predicts what phase
    1's last model (the one round T_e + 1 received) predicted; means over the clients."""
    twin_probe, phase1 = [None], [None]
    ref = seen.get(t_e + 1, {}) if t_e is not None else {}
    for rnd in range(1, rounds + 1):
        now = seen.get(rnd, {})
        twin_probe.append(mean_reading(float(np.mean(p == t)) for p, _, t in now.values()
                               if t is not None))
        phase1.append(mean_reading(float(np.mean(now[pid][0] == ref[pid][0]))
                           for pid in now if pid in ref) if t_e is not None and rnd > t_e
                      else None)
    return {"twin-probe agreement": twin_probe, "phase-1 agreement": phase1}


def replay_guard(tr: Trajectory, signal: str, start_round: int, patience: int,
                 z: float, veto: str | None = None, delta: float = 0.0) -> list[float]:
    """The test-accuracy records of the guarded run (docs/FEDEFC.md §3.4), the model it
    delivered held to the last planned round: the rule of
    ``Phase2Guard`` on the recorded signal, a round counting against phase 2 when its
    A(t) is below the best by more than ``z`` standard errors (z = 0: not beating it).
    With a ``veto`` signal (module docstring), a phase-2 round whose veto reading is below
    its reading at T_e + 1 (phase 1's last model) by more than ``delta`` counts against
    phase 2 and cannot become the best, whatever its A(t): the model restored is then the
    best the veto let through. A veto with no reading at T_e + 1 bars nothing."""
    a_of = tr.signals[signal]
    if tr.t_e is None:
        return tr.acc
    v_of = tr.signals[veto] if veto else []
    ref = v_of[tr.t_e + 1] if tr.t_e + 1 < len(v_of) else None
    best, best_round, worse = -1.0, None, 0
    for t in range(tr.rebase.get(signal, start_round + 1), len(tr.acc)):
        a = a_of[t]
        if a is None:
            continue
        vetoed = (ref is not None and t - 1 > tr.t_e and v_of[t] is not None
                  and v_of[t] < ref - delta)
        if a > best and not vetoed:
            best, best_round, worse = a, t, 0
            continue
        if t - 1 <= tr.t_e:
            continue
        margin = z * float(np.sqrt(sum(best * (1 - best) / n for n in tr.shares))) / len(
            tr.shares)
        worse = worse + 1 if vetoed or a <= best - margin else 0
        if worse >= patience:  # round t restores the model round best_round received,
            # which the federation then holds in the rounds it did not run (so that the
            # last 10 rounds are read as paired.md reads them: common/results.py:
            # mean_last10_held)
            return tr.acc[:t] + [tr.acc[best_round - 1]] * (len(tr.acc) - t)
    return tr.acc


def replay_veto(tr: Trajectory, veto: str, start_round: int, patience: int,
                delta: float) -> list[float]:
    """Today's guard (A(t) through Q, z = 0) with ``veto``: :func:`replay_guard`."""
    return replay_guard(tr, "guard", start_round, patience, 0.0, veto, delta)


VETOES = ("plain", "plain, dominant Q", "trusted 0.5", "trusted 0.7", "twin-probe agreement")


def report(paths: list[str], patience: int, deltas: list[float]) -> None:
    """Pool the stored trajectories of ``--json`` files (one or more seeds each): per
    rule, the final and last-10 differences to FedAvg of the same run, their means and
    least, the runs more than a point below, and where FedAvg memorized (its final 3
    points or more below its best) the mean final difference (docs/RESULTS.md)."""
    rows: dict[str, list[tuple[float, float, bool]]] = {}
    for path in paths:
        stored = json.loads(Path(path).read_text())
        for key, run_ in stored["runs"].items():
            tr = Trajectory(**run_)
            fedavg = stored["curves"]["FedAvg"][key.rsplit("-s", 1)[1]]
            memorized = max(fedavg) - fedavg[-1] >= 0.03
            start = int(stored["config"]["start-round"])
            rules = {"no guard": tr.acc,
                     "today's guard (A(t) through Q)": replay_guard(tr, "guard", start,
                                                                    patience, 0.0)}
            for signal in tr.signals:
                if signal != "guard":
                    rules[f"best of {signal}"] = replay_guard(tr, signal, start, patience, 0.0)
            for veto in VETOES:
                for delta in deltas:
                    if veto in tr.signals:
                        rules[f"guard, veto {veto} -{100 * delta:g}"] = replay_veto(
                            tr, veto, start, patience, delta)
            for name, curve in rules.items():
                rows.setdefault(name, []).append(
                    (100 * (curve[-1] - fedavg[-1]),
                     100 * (float(np.mean(curve[-10:])) - float(np.mean(fedavg[-10:]))),
                     memorized))
    print(f"{'rule':44s} runs  final: mean least >1 below | last 10: mean least >1 below "
          "| FedAvg memorized: runs, final")
    for name, diffs in rows.items():
        final, last = [d[0] for d in diffs], [d[1] for d in diffs]
        mem = [d[0] for d in diffs if d[2]]
        print(f"{name:44s} {len(diffs):4d}  {np.mean(final):+5.1f} {min(final):+5.1f} "
              f"{sum(f < -1 for f in final):3d} | {np.mean(last):+5.1f} {min(last):+5.1f} "
              f"{sum(x < -1 for x in last):3d} | {len(mem):3d}, "
              + (f"{np.mean(mem):+5.1f}" if mem else "  –"))


def stored_fedavg(path: str, base: dict) -> dict:
    """The runs of a ``study_full_data_twin.py`` JSON whose config is ``base`` on every
    key both hold (the keys this study sets itself and where the results go aside);
    refused naming the keys that differ."""
    stored = json.loads(Path(path).read_text())
    own = {"phase-2-guard", "twin-model", "method", "seed", "q-estimator", "out-dir"}
    differ = sorted(k for k in base.keys() & stored["config"].keys() if k not in own
                    and base[k] != stored["config"][k])
    if differ:
        raise SystemExit(f"--fedavg-from {path}: its config differs in {', '.join(differ)}; "
                         "give the study of this config")
    return stored["runs"]


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
    ap.add_argument("--twin", action="store_true", help="FedEFC with the defaults' twin")
    ap.add_argument("--chance", action="store_true",
                    help="FedAvg again, learning rate 1e-6 larger: the chance envelope")
    ap.add_argument("--trusted", type=float, nargs="*", default=[],
                    help="thresholds of the trusted-class signals")
    ap.add_argument("--json", help="write every trajectory here")
    ap.add_argument("--fedavg-from", help="FedAvg's curves from this study_full_data_twin "
                    "JSON of the same config (module docstring)")
    ap.add_argument("--t-e", type=int, help="FedEFC's prestopping point, taken instead of "
                    "found: a Flower run's T_e, where this loop's sums (in another order) "
                    "would find another")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="pool stored --json files: every rule and veto, replayed")
    ap.add_argument("--veto-margin", type=float, nargs="+", default=[0.0, 0.01, 0.02],
                    help="with --report: the vetoes' margins (fractions of accuracy)")
    args = ap.parse_args()
    if args.report:
        report(args.report, (args.patience or [3])[0], args.veto_margin)
        return
    base = resolve_run_config(args.preset, [*args.overrides, 'phase-2-guard="on"'], "")
    cfg = load_run_config(base)
    patience = args.patience or [cfg.gamma_thr]
    curves: dict[str, dict[int, list[float]]] = {}
    dump = {}
    stored = stored_fedavg(args.fedavg_from, base) if args.fedavg_from else None
    for seed in args.seeds:
        if stored is None:
            curves.setdefault("FedAvg", {})[seed] = run({**base, "method": "fedavg",
                                                          "seed": seed}).acc
        else:
            curves.setdefault("FedAvg", {})[seed] = stored[str(seed)]["acc"]["fedavg"]
        if args.chance:
            again = run({**base, "method": "fedavg", "seed": seed, "lr": cfg.lr + 1e-6 * cfg.lr})
            curves.setdefault("FedAvg again", {})[seed] = again.acc
        for est in args.estimator:
            tr = run({**base, "seed": seed, "q-estimator": est}, twin=args.twin,
                     trusted=tuple(args.trusted), t_e=args.t_e)
            if stored is not None and args.twin and tr.acc != stored[str(seed)]["acc"]["twin"]:
                raise SystemExit(f"seed {seed}: the twin's curve differs from the one stored in "
                                 f"{args.fedavg_from}: its FedAvg is not this machine's; "
                                 "run without --fedavg-from")
            dump[f"{est}-s{seed}"] = tr.__dict__
            curves.setdefault(f"{est}, no guard", {})[seed] = tr.acc
            for signal in tr.signals:
                for p in patience:
                    for z in args.margin:
                        curves.setdefault(f"{est}, {signal} p{p} z{z:g}, ends", {})[seed] = \
                            replay_guard(tr, signal, cfg.start_round, p, z)
            if args.fallback_all:
                for p in patience:
                    fb = run({**base, "seed": seed, "q-estimator": est}, fallback_patience=p)
                    curves.setdefault(f"{est}, guard p{p}, then all data", {})[seed] = fb.acc
        print(f"seed {seed} done", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"config": base, "curves": curves,
                                                   "runs": dump}))
    ref = {s: stats(c) for s, c in curves["FedAvg"].items()}

    def diffs(by_seed):
        st = {s: stats(c) for s, c in by_seed.items()}
        return st, {s: (100 * (st[s][0] - ref[s][0]), 100 * (st[s][1] - ref[s][1]))
                    for s in st}

    # the chance envelope: the least differences of FedAvg run again (final, last 10)
    envelope = (min(a for a, _ in diffs(curves["FedAvg again"])[1].values()),
                min(b for _, b in diffs(curves["FedAvg again"])[1].values())
                ) if "FedAvg again" in curves else None
    if envelope:
        print(f"chance envelope (FedAvg again - FedAvg, least): final {envelope[0]:+.1f}, "
              f"last 10 {envelope[1]:+.1f}")
    print(f"{'variant':34s} {'final':>6s} {'last10':>6s}  diff to FedAvg per seed (final/last10)")
    for name, by_seed in curves.items():
        st, d = diffs(by_seed)
        below = sum(a < -1 for a, _ in d.values())
        beyond = "" if envelope is None else (
            f", {sum(a < envelope[0] or b < envelope[1] for a, b in d.values())} "
            "beyond chance")
        print(f"{name:34s} {100 * statistics.mean(v[0] for v in st.values()):6.1f} "
              f"{100 * statistics.mean(v[1] for v in st.values()):6.1f}  "
              + " ".join(f"{a:+.1f}/{b:+.1f}" for a, b in d.values())
              + f"  ({below} of {len(d)} more than 1 point below{beyond})")


if __name__ == "__main__":
    main()
