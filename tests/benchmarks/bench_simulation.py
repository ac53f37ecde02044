"""Benchmark: the same FL job through Flower's simulation vs a plain single-process loop.

Both sides run the same clients (MethodClient.fit), model, data plan, client sampling,
per-client seeds, prestopping and test evaluation; the plain loop just calls the client
objects one after another in one process and averages weights with NumPy, with no
Flower, no Ray and no SuperLink. Each side is timed as a whole process (interpreter
start, imports and data loading included), alternating A B A B, and the script prints
the wall times, their ratio (target: Flower <= 1.3x the plain loop on 2 cores) and both
final accuracies.

Every side reports the peak memory of all its processes (the sum of their proportional
set sizes, sampled twice a second: bench_gpu.py's sampler).

It also times Flower's floor: a no-op Flower app (FedAvg over 10 of 100 simulated nodes,
one-element weights, clients that return what they get, no torch, no data) for the same
number of rounds, through the same launcher. No FL app can run faster through Flower's
simulation engine, so ``(floor + the plain loop's time in rounds) / plain`` is a lower
bound on the ratio that any implementation of the job could reach.

    python tests/benchmarks/bench_simulation.py --data-dir /abs/path/to/data [--rounds 10]
        [--preset mnist-lite] [--set KEY=VALUE ...]
        [--sides flower,plain,floor]

``--preset mnist --set device="cuda" --sides plain,flower`` is the GPU session's set
(tests/benchmarks/gpu_session.sh, step ``floor``): the paper's MNIST preset as a plain
loop on the device and through Flower, on the same data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_gpu import run_and_sample

from fedefc_cli.flower import LocalSimulation
from fedefc_cli.run_configs import resolve_run_config
from tests.plain_loop import plain_loop

NOOP_APP = {
    "pyproject.toml": """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "noopapp"
version = "0.1.0"
dependencies = ["flwr[simulation]==1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["noopapp"]

[tool.flwr.app]
publisher = "bench"

[tool.flwr.app.components]
serverapp = "noopapp.apps:server"
clientapp = "noopapp.apps:client"

[tool.flwr.app.config]
rounds = 1
""",
    "noopapp/__init__.py": "",
    "noopapp/apps.py": """import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


class Noop(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}


def server_fn(context):
    strategy = FedAvg(fraction_fit=0.1, fraction_evaluate=0.0, min_available_clients=100,
                      initial_parameters=ndarrays_to_parameters([np.zeros(1, np.float32)]))
    rounds = int(context.run_config["rounds"])
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


server = ServerApp(server_fn=server_fn)
client = ClientApp(client_fn=lambda context: Noop().to_client())
""",
}


def noop_flower_run(app_dir: Path, rounds: int) -> None:
    """Run the no-op app for ``rounds`` rounds on 100 simulated nodes (internal mode)."""
    with tempfile.TemporaryDirectory() as tmp, LocalSimulation(Path(tmp)) as sim:
        _, status = sim.run({"rounds": rounds}, 100, 1, 0.0, app_dir=app_dir,
                            log_path=Path(tmp) / "log")
    if status != "finished:completed":
        raise SystemExit(f"the no-op Flower app ended {status!r}")


def timed(cmd: list[str], log: Path) -> tuple[float, str, float]:
    """(wall seconds, stdout, peak MB of all its processes) of ``cmd`` run whole."""
    measured = run_and_sample(cmd, log)
    return measured.wall_s, log.read_text(errors="replace"), measured.peak_sum


SIDES = ("flower", "plain", "floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="absolute folder holding MNIST/raw")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--preset", default="mnist-lite", help="configs/<preset>.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override for both sides (repeatable)")
    ap.add_argument("--sides", default="flower,plain,floor",
                    help="which of flower, plain, floor to run (comma-separated)")
    ap.add_argument("--plain-config", help=argparse.SUPPRESS)  # internal: run the plain loop
    ap.add_argument("--noop-app", help=argparse.SUPPRESS)  # internal: run the no-op app
    args = ap.parse_args()
    if args.plain_config:
        print(json.dumps(plain_loop(json.loads(Path(args.plain_config).read_text()))))
        return
    if args.noop_app:
        noop_flower_run(Path(args.noop_app), args.rounds)
        return
    asked = args.sides.split(",")
    if set(asked) - set(SIDES) or not asked:
        raise SystemExit(f"--sides {args.sides!r}: give some of {', '.join(SIDES)}")
    sides = [side for side in SIDES if side in asked]
    times = {side: [] for side in sides}
    peaks = {side: [] for side in sides}
    results = {}
    overrides = [f'data-dir="{args.data_dir}"', f"rounds={args.rounds}", "start-round=3",
                 *args.set]
    with tempfile.TemporaryDirectory() as tmp:
        noop_dir = Path(tmp) / "noop"
        for name, text in NOOP_APP.items():
            (noop_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (noop_dir / name).write_text(text)
        for rep in range(args.repeats):
            for side in sides:
                log = Path(tmp) / f"{side}-{rep}.log"
                if side == "flower":
                    out = Path(tmp) / f"{side}-{rep}"
                    sets = [arg for o in overrides for arg in ("--set", o)]
                    seconds, _, peak = timed([sys.executable, "-m", "fedefc_cli", "run",
                                              args.preset, *sets, "--out-dir", str(out)], log)
                    results[side] = json.loads((out / "summary.json").read_text())
                    results[side]["round_s"] = [
                        json.loads(line)["round_s"]
                        for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
                elif side == "plain":
                    cfg = resolve_run_config(args.preset, overrides,
                                             str(Path(tmp) / f"plain-{rep}"))
                    cfg_file = Path(tmp) / "plain.json"
                    cfg_file.write_text(json.dumps(cfg))
                    seconds, stdout, peak = timed([sys.executable, __file__, "--data-dir",
                                                   args.data_dir, "--plain-config",
                                                   str(cfg_file)], log)
                    results["plain"] = json.loads(next(  # the log holds stderr too
                        line for line in reversed(stdout.splitlines()) if line.startswith("{")))
                else:
                    seconds, _, peak = timed([sys.executable, __file__, "--data-dir",
                                              args.data_dir, "--rounds", str(args.rounds),
                                              "--noop-app", str(noop_dir)], log)
                times[side].append(seconds)
                peaks[side].append(peak)
                print(f"{side}: {seconds:.1f} s", flush=True)  # a step cut later keeps it
            print(f"repeat {rep}: " + ", ".join(f"{side} {times[side][-1]:.1f} s"
                                                for side in sides), flush=True)
    print(f"{args.preset}, {args.rounds} rounds (start-round 3), overrides {args.set}")
    for side in sides:
        print(f"{side}: peak memory of all its processes, MB: median "
              f"{statistics.median(peaks[side]):.0f} {[round(p) for p in peaks[side]]}")
        if side == "floor":
            continue
        rs = results[side]["round_s"]
        print(f"{side}: wall s {statistics.median(times[side]):.1f} {times[side]}; steady "
              f"round s {statistics.median(rs[1:] or rs):.2f}; round 1 s {rs[0]:.1f}; "
              f"outside rounds s {statistics.median(times[side]) - sum(rs):.1f}; final "
              f"accuracy {results[side]['final_acc']:.4f}, T_e {results[side]['t_e']}")

    def steady(side: str) -> float:
        return statistics.median(results[side]["round_s"][1:] or results[side]["round_s"])

    if "flower" in times and "plain" in times:
        ratios = [f / p for f, p in zip(times["flower"], times["plain"])]
        print(f"ratio flower/plain: wall, median {statistics.median(ratios):.2f} "
              f"{[round(r, 2) for r in ratios]} (target <= 1.3); steady round "
              f"{steady('flower') / steady('plain'):.2f}")
    if "floor" in times:
        floor = statistics.median(times["floor"])
        print(f"no-op Flower app wall s: median {floor:.1f} {times['floor']} (Flower's floor "
              f"for {args.rounds} rounds, 100 nodes)")
        if "plain" in times:
            plain_rounds = sum(results["plain"]["round_s"])
            print(f"best reachable ratio: "
                  f"{(floor + plain_rounds) / statistics.median(times['plain']):.2f}"
                  f" ((floor + plain time in rounds {plain_rounds:.1f} s) / plain)")


if __name__ == "__main__":
    main()
