"""``fedefc``: run the app on Flower's simulation engine through ``flwr run``, end to end.

What it does, in order (see ../shared/notes/FLOWER.md for why each step exists):

1. Merge the preset (``configs/<name>.toml`` or a path) with ``--set`` overrides and
   validate the result locally, so a bad key or value fails before anything starts.
2. Resolve ``out-dir`` to an absolute, unused folder (nothing is ever overwritten).
3. Start a private ``flower-superlink --simulation`` on free loopback ports, with a
   project-local ``FLWR_HOME``, runtime dependency installation disabled, and no
   telemetry or update check (works offline).
4. ``flwr run <app> <connection> --stream`` with the run config and
   ``num-supernodes = num-clients``; the ServerApp's log streams to this terminal.
5. Check ``flwr ls`` for ``finished:completed`` (``flwr run`` exits 0 even when the
   run failed), stop the SuperLink by PID, print the summary; exit non-zero on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from common.config import ConfigError, load_run_config
from common.datasets import DatasetError
from common.noise import NoiseError
from common.partition import PartitionError
from common.results import OutputDirError, check_output_dir

from .checkpoint import CheckpointError
from .procs import stop_tree

APP_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = APP_DIR / "configs"


class LaunchError(RuntimeError):
    """The run could not be started or did not complete."""


def read_app_defaults(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The run-config keys and defaults declared in the app's pyproject.toml."""
    with open(app_dir / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])


def read_preset(preset: str | None) -> dict[str, Any]:
    """A preset by name (``configs/<name>.toml``) or by path; {} for none."""
    if not preset:
        return {}
    path = Path(preset)
    if not path.suffix:
        path = CONFIGS_DIR / f"{preset}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
        raise ConfigError(f"preset {preset!r} not found (looked for {path}); known: {known}")
    try:
        with open(path, "rb") as fh:
            return dict(tomllib.load(fh))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"preset {path} is not valid TOML: {err}") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, values parsed as TOML scalars (strings may be bare)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not key=value; write e.g. --set rounds=50")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key.strip()] = value
    return out


def resolve_run_config(preset: str | None, overrides: list[str],
                       out_dir: str | None) -> dict[str, Any]:
    """Defaults < preset < overrides, validated; ``out-dir`` made absolute and checked."""
    merged = {**read_app_defaults(), **read_preset(preset), **parse_overrides(overrides)}
    if out_dir:
        merged["out-dir"] = str(Path(out_dir).expanduser().resolve())
    if merged.get("resume-from") and not merged.get("out-dir"):
        merged["out-dir"] = merged["resume-from"]  # a resumed run continues in its folder
    if not merged.get("out-dir"):
        name = Path(preset).stem if preset else "default"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        merged["out-dir"] = str(Path.cwd().resolve() / "runs" / f"{name}-{stamp}")
    cfg = load_run_config(merged)
    if not cfg.resume_from:
        check_output_dir(cfg.out_dir)
    return cfg.to_flat()


def resume_config(folder: str, overrides: list[str]) -> dict[str, Any]:
    """The config of the run in ``folder`` (its config.json), set to resume it there."""
    path = Path(folder).expanduser().resolve()
    try:
        stored = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot resume {str(path)!r}: its config.json is unreadable ({err}); "
                          "give the out-dir of an earlier run") from None
    merged = {**stored, **parse_overrides(overrides), "resume-from": str(path),
              "out-dir": str(path)}
    return load_run_config(merged).to_flat()


def preflight(run_config: dict[str, Any]) -> None:
    """Load the data, build the partitions and noise, and check a checkpoint to resume,
    so that bad data or an unusable checkpoint fails before any Flower process starts."""
    from common.federation import federated_data

    from .app import initial_weights
    from .checkpoint import check_compatible, load

    cfg = load_run_config(run_config)
    federated_data(cfg)
    if cfg.resume_from:
        ckpt = load(cfg.resume_from)
        check_compatible(ckpt, cfg.to_flat(), cfg.resume_from,
                         [w.shape for w in initial_weights(cfg)])
        if cfg.method == "fedcorr":
            from .fedcorr import check_resume_plan, config_plan

            check_resume_plan(ckpt.strategy, config_plan(cfg))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for offline, private Flower processes."""
    env = dict(os.environ)
    # Flower's processes start each other by name (the SuperLink runs flower-superexec,
    # which runs flwr-simulation): put this environment's scripts first on PATH, so a
    # venv works without being activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(FLWR_HOME=str(flwr_home), FLWR_DISABLE_UPDATE_CHECK="1",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    return env


def _bin(name: str) -> str:
    """A Flower executable next to this interpreter (works without an activated venv)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def write_run_config(path: Path, run_config: dict[str, Any]) -> Path:
    """``run_config`` as a TOML file for ``flwr run --run-config``."""
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
    return path


class LocalSimulation:
    """A private simulation SuperLink and its FLWR_HOME; stopped by PID on exit."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.flwr_home = work_dir / "flwr-home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.control_port = _free_port()
        self.env = flwr_env(self.flwr_home)
        self.proc: subprocess.Popen | None = None
        (self.flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "fedefc-sim"\n\n[superlink.fedefc-sim]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')

    def __enter__(self) -> LocalSimulation:
        with open(self.work_dir / "superlink.log", "wb") as log:
            self.proc = subprocess.Popen(
                [_bin("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1",
                 "--port", str(self.port), "--control-api-address",
                 f"127.0.0.1:{self.control_port}", "--disable-runtime-dependency-installation",
                 "--database", str(self.work_dir / "state.db")],
                env=self.env, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"flower-superlink exited with code {self.proc.returncode}; "
                                  f"see {self.work_dir / 'superlink.log'}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.2)
        raise LaunchError("flower-superlink did not open its port within 60 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_tree(self.proc)

    def run(self, run_config: dict[str, Any], num_supernodes: int, client_cpus: int,
            client_gpus: float, app_dir: Path = APP_DIR,
            log_path: Path | None = None) -> tuple[int, str]:
        """Submit the app, stream its log, and return (run id, status) once it ends."""
        cfg_file = write_run_config(self.work_dir / "run-config.toml", run_config)
        fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={int(client_cpus)} "
               f"client-resources-num-gpus={client_gpus}")
        cmd = [_bin("flwr"), "run", str(app_dir), "fedefc-sim", "--stream",
               "--run-config", str(cfg_file), "--federation-config", fed]
        if log_path is None:
            code = subprocess.call(cmd, env=self.env, cwd=self.work_dir)
        else:
            with open(log_path, "ab") as log:
                code = subprocess.call(cmd, env=self.env, cwd=self.work_dir, stdout=log,
                                       stderr=subprocess.STDOUT)
        if code != 0:
            raise LaunchError(f"flwr run exited with code {code}")
        return self.latest_status()

    def latest_status(self) -> tuple[int, str]:
        out = subprocess.run([_bin("flwr"), "ls", "fedefc-sim", "--format", "json"],
                             env=self.env, cwd=self.work_dir, capture_output=True, text=True)
        try:
            runs = json.loads(out.stdout)["runs"]
        except (json.JSONDecodeError, KeyError):
            raise LaunchError(f"flwr ls gave no run list: {out.stdout}{out.stderr}") from None
        last = max(runs, key=lambda r: r.get("created-at", ""))
        return int(last["run-id"]), str(last["status"])


def run_simulation_job(run_config: dict[str, Any], client_cpus: int = 1,
                       client_gpus: float = 0.0, log_path: Path | None = None) -> dict[str, Any]:
    """Run one job through ``flwr run`` and return its summary (raises on failure).

    The run's log streams to stdout, or is appended to ``log_path`` when given."""
    preflight(run_config)
    out_dir = Path(run_config["out-dir"])
    with tempfile.TemporaryDirectory(prefix="fedefc-flwr-") as tmp:
        with LocalSimulation(Path(tmp)) as sim:
            run_id, status = sim.run(run_config, int(run_config["num-clients"]), client_cpus,
                                     client_gpus, log_path=log_path)
        if status != "finished:completed":
            log_tail = (Path(tmp) / "superlink.log").read_text(errors="replace")[-4000:]
            raise LaunchError(f"run {run_id} ended {status!r}, not finished:completed.\n"
                              f"SuperLink log tail:\n{log_tail}")
    summary_path = out_dir / "summary.json"
    if not summary_path.exists():
        raise LaunchError(f"run completed but wrote no {summary_path}")
    return json.loads(summary_path.read_text())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fedefc", description="Run FedEFC on Flower's simulation engine (flwr run).")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one simulation job")
    run.add_argument("preset", nargs="?", default=None,
                     help="configs/<preset>.toml name or a .toml path "
                          "(default: pyproject defaults)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a run-config key (repeatable), e.g. --set rho=0.4")
    run.add_argument("--out-dir", default=None,
                     help="results folder (made absolute; must be unused)")
    run.add_argument("--client-cpus", type=int, default=1, help="CPUs per simulated client")
    run.add_argument("--client-gpus", type=float, default=None,
                     help="GPUs per simulated client (default 0.25 when CUDA is visible, else 0)")
    res = sub.add_parser("resume", help="continue an interrupted run from its checkpoint")
    res.add_argument("folder", help="the out-dir of the run to continue")
    res.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="e.g. --set rounds=200 to extend the run")
    res.add_argument("--client-cpus", type=int, default=1)
    res.add_argument("--client-gpus", type=float, default=None)
    sub.add_parser("presets", help="list the presets in configs/")
    sub.add_parser("grid", help="run or tabulate a grid of runs: fedefc grid {run,report,list} "
                   "GRID [--set KEY=VALUE] (see fedefc grid -h)")
    return ap


def _exit_on_signal(signum, _frame) -> None:
    """SIGTERM/SIGHUP unwind the stack, so every SuperLink we started is stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    if argv[:1] == ["grid"]:
        from .grid import main as grid_main

        return grid_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "presets":
        for path in sorted(CONFIGS_DIR.glob("*.toml")):
            print(path.stem)
        return 0
    try:
        if args.command == "resume":
            run_config = resume_config(args.folder, args.overrides)
        else:
            run_config = resolve_run_config(args.preset, args.overrides, args.out_dir)
        preflight(run_config)
    except (ConfigError, OutputDirError, DatasetError, NoiseError, PartitionError,
            CheckpointError) as err:
        print(f"fedefc: error: {err}", file=sys.stderr)
        return 2
    gpus = args.client_gpus
    if gpus is None:
        import torch

        gpus = 0.25 if torch.cuda.is_available() and run_config["device"] != "cpu" else 0.0
    print(f"fedefc: results -> {run_config['out-dir']}", flush=True)
    try:
        summary = run_simulation_job(run_config, args.client_cpus, gpus)
    except LaunchError as err:
        print(f"fedefc: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(f"fedefc: results in {summary['out_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
