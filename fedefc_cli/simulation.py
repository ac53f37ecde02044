"""One job on Flower's simulation engine, end to end (``fedefc run``, ``fedefc resume``, grids).

In order:

1. :func:`preflight`, in a child process: load the data, build the partitions and the
   noise (stored for the run's processes, ``common/data_plan.py``), build the model (an
   import path must import and give (N, K) logits), check a checkpoint to resume, so
   that bad data, a bad model or an unusable checkpoint fails before any Flower process
   starts, and the launcher, which waits for the whole run, never holds the data
   (docs/BENCHMARKS.md, "Memory");
2. a private ``flower-superlink --simulation`` on free loopback ports
   (:class:`.flower.LocalSimulation`);
3. ``flwr run <app> --stream`` with the run config and ``num-supernodes = num-clients``;
   the ServerApp's log streams to the terminal (or a log file);
4. ``flwr ls`` must report ``finished:completed`` and the summary must not say
   ``"status": "failed"`` (docs/DEPLOYMENT.md, "When a run fails"); the SuperLink is
   stopped by PID and the run's summary returned (``"status": "degraded"`` included: it
   has a model, and its summary says which partition missed which rounds).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common.data_plan import data_plan
from common.methods import load_object, load_run_config, method_of
from common.params import get_weights
from common.private_files import make_private_dir
from common.results import RESULT_FILES, read_records
from common.runtime import initial_model
from fedefc_server import checkpoint, curves

from .errors import LaunchError
from .flower import LocalSimulation


def preflight(run_config: dict[str, Any]) -> None:
    """Fail now, naming the problem, on anything that would fail the run before round 1."""
    cfg = load_run_config(run_config)
    model = initial_model(cfg, data_plan(cfg).data.task)
    if cfg.resume_from:
        ckpt = checkpoint.load(cfg.resume_from)
        checkpoint.check_compatible(ckpt, cfg.to_flat(), cfg.resume_from,
                                    [w.shape for w in get_weights(model)])
        load_object(method_of(cfg).server).check_checkpoint(ckpt.strategy, cfg)


def preflight_in_child(run_config: dict[str, Any]) -> None:
    """:func:`preflight` in a spawned process; its error, if any, is raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(preflight, run_config).result()


RAY_START_TIMEOUT = "The current node timed out during startup"  # Ray's fixed 30 s wait
RAY_START_ATTEMPTS = 4  # a run whose Ray did not start is started at most three times more
RAY_START_PAUSE_S = 15  # doubled after each attempt: a busy machine gets time to settle


def ray_failed_to_start(run_log: str, out_dir: Path) -> bool:
    """The run failed because Ray's node did not register within Ray's fixed 30 s (a
    busy machine: the raylet or the GCS too slow to start), before round 1. The ServerApp
    evaluates the initial model (round 0) while Ray starts, so round 0 may be recorded;
    nothing was trained, so starting the run again loses nothing."""
    trained = any(r.get("round", 0) > 0 for r in read_records(out_dir))
    return (RAY_START_TIMEOUT in run_log and not trained
            and not (out_dir / checkpoint.FILE).exists())


def clear_unstarted_run(out_dir: Path) -> None:
    """Remove what a run that never reached round 1 wrote (its config, its round-0
    record), so that the next attempt finds an unused out-dir; ``run.log`` stays."""
    for name in ("config.json", *RESULT_FILES, curves.FILE):
        (out_dir / name).unlink(missing_ok=True)


def run_simulation_job(run_config: dict[str, Any], client_cpus: int = 1,
                       client_gpus: float = 0.0, log_path: Path | None = None,
                       checked: bool = False,
                       ray_address: str | None = None) -> dict[str, Any]:
    """Run one job through ``flwr run`` and return its summary (LaunchError on failure).

    The run's log is appended to ``log_path`` when given; else it is shown on stdout,
    folded (:class:`.log_view.LogView`), and its whole text appended to ``run.log`` in
    the out-dir. ``checked``: the caller already ran :func:`preflight_in_child`;
    ``ray_address``: the clients run on that Ray cluster's nodes (:mod:`.ray_cluster`),
    else on this machine. A run whose Ray did not start in time
    (:func:`ray_failed_to_start`) is started again, at most three times, saying so."""
    if not checked:
        preflight_in_child(run_config)
    out_dir = Path(run_config["out-dir"])
    kept = log_path or make_private_dir(out_dir) / "run.log"
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        start = kept.stat().st_size if kept.exists() else 0
        with tempfile.TemporaryDirectory(prefix="fedefc-flwr-") as tmp:
            with LocalSimulation(Path(tmp), ray_address) as sim:
                run_id, status = sim.run(run_config, int(run_config["num-clients"]),
                                         client_cpus, client_gpus, log_path=log_path,
                                         full_log=kept)
            if status == "finished:completed":
                break
            run_log = (kept.read_bytes()[start:].decode(errors="replace")
                       if kept.exists() else "")
            if attempt < RAY_START_ATTEMPTS and ray_failed_to_start(run_log, out_dir):
                pause = RAY_START_PAUSE_S * 2 ** (attempt - 1)
                print(f"fedefc: run {run_id}: Ray's node did not start within Ray's 30 s "
                      f"(a busy machine), before round 1; starting the run again in {pause} s "
                      f"(attempt {attempt + 1} of {RAY_START_ATTEMPTS})",
                      file=sys.stderr, flush=True)
                clear_unstarted_run(out_dir)
                time.sleep(pause)
                continue
            link_tail = sim.log_path.read_text(errors="replace")[-3000:]
            run_tail = f"Run log tail ({kept}):\n{run_log[-4000:]}\n" if run_log else ""
            raise LaunchError(f"run {run_id} ended {status!r}, not finished:completed.\n"
                              f"{run_tail}SuperLink log tail:\n{link_tail}")
    summary_path = out_dir / "summary.json"
    if not summary_path.exists():
        raise LaunchError(f"run completed but wrote no {summary_path}")
    summary = json.loads(summary_path.read_text())
    if summary.get("status", "completed") == "failed":  # a hollow run: never a success
        raise LaunchError(f"run {run_id} FAILED: {summary.get('failure', 'no reason given')} "
                          f"(Flower reported {status}; {summary_path})")
    return summary
