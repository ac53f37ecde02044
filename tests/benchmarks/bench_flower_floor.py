"""Benchmark: FedEFC in deployment against Flower's own floor, on the same federation.

One :class:`fedefc_cli.deploy_local.LocalDeployment` on 127.0.0.1 (a SuperLink and its
SuperExec, one SuperNode and SuperExec per client, ``--isolation process``: a fresh app
process per message). On it, one after the other:

- **FedEFC**: mnist-embedded, LeNet, every client sampled every round, 1 local epoch,
  ``client-threads=1``, prepared data from the node's disk cache;
- **Flower's floor**: tests/flower_apps/noop, a ServerApp / ClientApp pair that sends
  the same messages (one ``query`` per node first, then one ``train`` per node per
  round) carrying as many float32 values as LeNet has weights, and does nothing with
  them.

Then FedEFC once more on a second federation whose SuperExecs start a fresh process per
task as Flower's do (``FEDEFC_APP_ZYGOTE=off``; the first forks each app process from
its zygote, which imported torch and Flower once: fedefc_cli/app_zygote.py).

Printed: each app's seconds per round (round 1 apart: it holds the node registry and
FedEFC's data preparation), the messages each SuperNode received (they must match), the
ratio FedEFC / floor and the difference per round, FedEFC's local update (the slowest
``fit-s``: training only, timed inside the client), and what remains: the project's own
per-message cost above the floor. Wall times follow the machine's load; so last, in CPU
seconds, what one message costs in a fresh app process, the no-op's and FedEFC's, split
into the ClientApp module's import and the message's handling (clientapp_message.py;
``--messages-only`` runs just that).

``--compare DIR`` runs FedEFC once more from another copy of this project (e.g. an
earlier commit, ``git archive COMMIT | tar -x -C DIR``) on the same federation: a
before/after under the same load. Its ClientApps run that copy's code (the app travels
with ``flwr run``).

    python tests/benchmarks/bench_flower_floor.py [--rounds 5] [--clients 3] [--repeats 5]
        [--compare DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.methods import load_run_config
from common.models import TaskShape, build_model
from fedefc_cli.app_zygote import ZYGOTE_SWITCH
from fedefc_cli.deploy_local import LocalDeployment, NodeSpec
from fedefc_cli.run_configs import APP_DIR, resolve_run_config

NOOP_APP = APP_DIR / "tests" / "flower_apps" / "noop"


def fedefc_config(out: Path, args: argparse.Namespace) -> dict:
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist-embedded"', "model": '"lenet"', "num-clients": args.clients,
        "fraction": 1.0, "rounds": args.rounds, "local-epochs": 1, "batch-size": 32,
        "start-round": 2, "gamma-thr": 2, "rho": 0.4, "zeta": 0.4, "client-threads": 1,
        "accuracy-signal": '"global"', "open-deployment": "true",  # no allowlist
    }.items()]
    return resolve_run_config(None, overrides, str(out))


def model_floats(run_config: dict) -> int:
    """The number of values of the run's model (LeNet on 1 x 28 x 28 MNIST, 10 classes)."""
    cfg = load_run_config(run_config)
    model = build_model(cfg.model, TaskShape((1, 28, 28), 10), cfg.seed)
    return sum(p.numel() for p in model.state_dict().values())


def received(dep: LocalDeployment) -> dict[str, int]:
    """Messages each SuperNode has received so far, by type."""
    counts: dict[str, int] = {}
    for folder in sorted(dep.work_dir.glob("node-*")):
        for kind in re.findall(r"Receiving: (\w+) message", (folder / "supernode.log").read_text()):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def rounds_of(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["round"] > 0]


def run(dep: LocalDeployment, run_config: dict, app_dir: Path) -> tuple[float, dict]:
    """Run an app on the federation: its wall time and the messages the nodes received."""
    before = received(dep)
    start = time.monotonic()
    outcome = dep.submit(run_config, timeout=3600, app_dir=app_dir)
    wall = time.monotonic() - start
    if not outcome.completed:
        raise SystemExit(f"{app_dir.name}: run ended {outcome.verdict}; logs in {dep.work_dir}")
    after = received(dep)
    return wall, {k: after.get(k, 0) - before.get(k, 0) for k in after}


@contextlib.contextmanager
def zygote_off():
    """The federations started inside: their SuperExecs start a process per task, as
    Flower's do (fedefc_cli/app_zygote.py)."""
    os.environ[ZYGOTE_SWITCH] = "off"
    try:
        yield
    finally:
        del os.environ[ZYGOTE_SWITCH]


def message_cpu(kind: str, app: Path, work: Path, forked: bool = False) -> dict[str, float]:
    """CPU seconds of a fresh process (``forked``: one forked from the zygote, what it
    imported already there) handling one message of ``kind`` (noop | fedefc) from the app
    copy ``app``: its import, its handling (clientapp_message.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(app), str(APP_DIR)])}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("clientapp_message.py")),
                          kind, str(work / "cache"), str(work / f"out-{time.monotonic_ns()}"),
                          *(["--forked"] if forked else [])],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_message(apps: dict[str, Path], work: Path, repeats: int) -> None:
    """Per message, in CPU seconds (what load does not change much): the no-op's and each
    FedEFC copy's ClientApp process, interleaved, after one warm-up each (data cache,
    bytecode), medians."""
    kinds = {"Flower's floor (noop)": ("noop", NOOP_APP, False),
             **{n: ("fedefc", a, False) for n, a in apps.items()},
             "FedEFC, forked from the zygote": ("fedefc", APP_DIR, True)}
    for kind, app, forked in kinds.values():
        message_cpu(kind, app, work, forked)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in kinds}
    for _ in range(repeats):
        for name, (kind, app, forked) in kinds.items():
            samples[name].append(message_cpu(kind, app, work, forked))
    print(f"\nCPU seconds of one message's app process (median of {repeats}):")
    print(f"{'':36} import  handling  total  above the floor")
    floor = None
    for name, runs in samples.items():
        imp = statistics.median(r["import_cpu_s"] for r in runs)
        msg = statistics.median(r["message_cpu_s"] for r in runs)
        floor = imp + msg if floor is None else floor
        print(f"{name:36} {imp:6.2f}  {msg:8.2f}  {imp + msg:5.2f}  {imp + msg - floor:+15.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5,
                    help="repetitions of the per-message CPU measurement")
    ap.add_argument("--messages-only", action="store_true",
                    help="only the per-message CPU measurement (no federation)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another copy of this project to run FedEFC from as well")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    apps = {"FedEFC": APP_DIR}
    if args.compare:
        apps[f"FedEFC ({args.compare})"] = args.compare.resolve()
    if args.messages_only:
        with tempfile.TemporaryDirectory(prefix="fedefc-bench-msg-") as tmp:
            per_message(apps, Path(tmp), args.repeats)
        return 0
    results: dict[str, tuple[list[dict], float, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="fedefc-bench-floor-") as tmp:
        work = Path(tmp)
        floats = model_floats(fedefc_config(work / "probe", args))
        noop = {"mode": "ok", "rounds": args.rounds, "nodes": args.clients, "floats": floats,
                "query": True, "out-dir": str(work / "noop")}
        nodes = [NodeSpec({"partition-id": k, "num-partitions": args.clients,
                           "cache-dir": str(work / f"cache-{k}")}) for k in range(args.clients)]
        with LocalDeployment(work / "federation", nodes) as dep:
            dep.wait_online(args.clients)
            wall, msgs = run(dep, noop, NOOP_APP)
            results["Flower's floor (noop)"] = (rounds_of(work / "noop"), wall, msgs)
            for i, (name, app) in enumerate(apps.items()):
                out = work / f"fedefc-{i}"
                wall, msgs = run(dep, fedefc_config(out, args), app)
                results[name] = (rounds_of(out), wall, msgs)
        with zygote_off(), LocalDeployment(work / "federation-off", nodes) as dep:
            dep.wait_online(args.clients)
            out = work / "fedefc-off"
            wall, msgs = run(dep, fedefc_config(out, args), APP_DIR)
            results[f"FedEFC, {ZYGOTE_SWITCH}=off"] = (rounds_of(out), wall, msgs)
    floor = results["Flower's floor (noop)"]
    floor_later = statistics.mean(r["round_s"] for r in floor[0][1:])
    print(f"\nmodel: LeNet, {floats} float32 values per message; {args.clients} nodes, "
          f"{args.rounds} rounds; messages received by the SuperNodes per run:")
    for name, (_, _, msgs) in results.items():
        print(f"  {name}: {msgs}")
    print(f"{'':36} round 1 s  later rounds s (mean)  run wall s  later / floor")
    for name, (recs, wall, _) in results.items():
        later = statistics.mean(r["round_s"] for r in recs[1:])
        print(f"{name:36} {recs[0]['round_s']:9.2f}  {later:21.2f}  {wall:10.1f}  "
              f"{later / floor_later:12.2f}x")
        if "fit_s" in recs[-1]:
            fit = statistics.mean(max(r["fit_s"]) for r in recs[1:])
            print(f"{'':36} above the floor per later round {later - floor_later:+.2f} s: "
                  f"local training (slowest fit-s) {fit:.2f} s, the rest "
                  f"{later - floor_later - fit:+.2f} s (the ClientApp's start-up: imports, "
                  "data from the cache, model; the server's evaluation)")
    with tempfile.TemporaryDirectory(prefix="fedefc-bench-msg-") as tmp:
        per_message(apps, Path(tmp), args.repeats)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
