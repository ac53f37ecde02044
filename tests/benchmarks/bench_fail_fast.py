"""Benchmark: how soon ``fedefc deploy submit`` ends a run that every node refuses for a
reason waiting does not change (docs/RELIABILITY.md, "A run that trained nothing fails";
issue 49: 117 s on a busy machine, where the docs promised half a minute).

One :class:`fedefc_cli.deploy_local.LocalDeployment` on 127.0.0.1 whose ``--clients``
SuperNodes were started with ``num-partitions`` = ``--clients``; on it, in turn,
``--repeats`` times each:

- **FedEFC refused**: ``fedefc deploy submit`` of mnist-embedded with ``num-clients`` one
  more than the nodes have (every node refuses it: a config mismatch), timed from the
  command's start to its exit, with when its steps were seen (submitted, the ServerApp's
  first line, the nodes' refusals logged, ``RUN FAILED``);
- **Flower's floor**: tests/flower_apps/noop in ``fail`` mode through the same
  ``submit_run`` (its ServerApp logs ``RUN FAILED`` and raises at once, no node asked):
  what any failing run costs on this federation, Flower's start-up of a run and of its
  ServerApp process and the end of its log stream.

``--compare DIR`` also runs the refused submission from another copy of this project
(e.g. an earlier commit: ``git archive COMMIT | tar -x -C DIR``), its ``fedefc`` and its
app, in turn with this one's: a before/after under the same load.

Printed: each attempt's seconds and steps, the medians, the ratios against the floor and
the differences. Run it under load as the issue's trial was (a busy machine):

    python tests/load_harness.py -- python tests/benchmarks/bench_fail_fast.py
        [--clients 3] [--repeats 3] [--compare DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedefc_cli.deploy_local import LocalDeployment, NodeSpec
from fedefc_cli.flower import submit_run
from fedefc_cli.run_configs import APP_DIR

NOOP_APP = APP_DIR / "tests" / "flower_apps" / "noop"
STEPS = {  # what a line of submit's output says, in the order a run goes
    "config checked": re.compile(r"asking the SuperLink"),
    "packing": re.compile(r"packing the app"),
    "submitted": re.compile(r"run \d+ submitted"),
    "serverapp": re.compile(r"\bINFO :"),
    "refused": re.compile(r"refused|failed to declare"),
    "RUN FAILED": re.compile(r"RUN FAILED: "),
    "told": re.compile(r"did not complete"),
}


def refused(dep: LocalDeployment, out: Path, clients: int, project: Path = APP_DIR
            ) -> tuple[float, dict[str, float]]:
    """``fedefc deploy submit`` (``project``'s) of a run of one client more than the nodes
    serve; its seconds and when each step was first seen."""
    env = {**os.environ, "FLWR_HOME": dep.cli_env["FLWR_HOME"]}
    cmd = [sys.executable, "-m", "fedefc_cli", "deploy", "submit", dep.CONNECTION,
           "--set", 'dataset="mnist-embedded"', "--set", f"num-clients={clients + 1}",
           "--set", "client-threads=1", "--set", "open-deployment=true",
           "--set", f'out-dir="{out}"']
    seen: dict[str, float] = {}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail[-30:], line]
        for step, pattern in STEPS.items():
            if step not in seen and pattern.search(line):
                seen[step] = time.monotonic() - start
    code = proc.wait()
    took = time.monotonic() - start
    if code != 1 or "RUN FAILED" not in seen:
        raise SystemExit(f"submit exited {code} without RUN FAILED:\n{''.join(tail)}")
    return took, seen


def floor(dep: LocalDeployment, work: Path) -> float:
    """The no-op app's failing run through submit_run, in seconds."""
    start = time.monotonic()
    outcome = submit_run(dep.CONNECTION, {"mode": "fail"}, dep.cli_env, dep.cli_dir,
                         NOOP_APP, log=work / "noop.log", timeout=3600)
    took = time.monotonic() - start
    if outcome.status != "finished:failed":
        raise SystemExit(f"the no-op's failing run ended {outcome.status}")
    return took


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", type=Path, default=None,
                        help="another copy of this project, run in turn with this one")
    args = parser.parse_args()
    sides = {"FedEFC refused": APP_DIR}
    if args.compare:
        sides[f"FedEFC refused ({args.compare})"] = args.compare.resolve()
    times: dict[str, list[float]] = {name: [] for name in [*sides, "Flower's floor"]}
    with tempfile.TemporaryDirectory(prefix="bench-fail-fast-") as tmp:
        work = Path(tmp)
        nodes = [NodeSpec({"partition-id": k, "num-partitions": args.clients,
                           "cache-dir": str(work / f"cache-{k}")}) for k in range(args.clients)]
        with LocalDeployment(work / "federation", nodes) as dep:
            dep.wait_online(args.clients)
            for i in range(args.repeats):
                print(f"load average {loadavg()}", flush=True)
                for j, (name, project) in enumerate(sides.items()):
                    took, seen = refused(dep, work / f"run-{i}-{j}", args.clients, project)
                    steps = "  ".join(f"{k} {v:.0f} s" for k, v in seen.items())
                    print(f"{name:40s} {took:6.1f} s   ({steps})", flush=True)
                    times[name].append(took)
                times["Flower's floor"].append(floor(dep, work))
                floor_name, floor_s = "Flower's floor", times["Flower's floor"][-1]
                print(f"{floor_name:40s} {floor_s:6.1f} s", flush=True)
    base = statistics.median(times["Flower's floor"])
    print(f"\nmedians of {args.repeats} (load average at the end {loadavg()}):")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:40s} {med:6.1f} s   {med / base:5.2f}x the floor, {med - base:+.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
