"""The ServerApp: builds the FedEFC strategy from the run config (legacy ServerApp style)."""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path

from flwr.common import Context, ndarrays_to_parameters
from flwr.common.logger import log
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager

from common.config import ConfigError, RunConfig, load_run_config
from common.datasets import load_dataset
from common.federation import federated_data
from common.params import get_weights
from common.results import RunRecorder, atomic_write_json
from common.runtime import initial_model
from common.training import configure_threads

from . import checkpoint
from .evaluation import TestSetEvaluator
from .fedcorr import FedCorrStrategy
from .fednoro import FedNoRoStrategy
from .rofl import RoFLStrategy
from .server import ResumableServer
from .strategy import FedEFCStrategy

# Methods whose server differs from FedEFCStrategy (docs/BASELINES.md); others use it.
STRATEGIES: dict[str, type[FedEFCStrategy]] = {
    "fedcorr": FedCorrStrategy, "fednoro": FedNoRoStrategy, "rofl": RoFLStrategy}


def default_out_dir(cfg: RunConfig) -> Path:
    """Where results go when ``out-dir`` is empty:
    ~/fedefc-runs/<method>-<dataset>-s<seed>-<time>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path.home() / "fedefc-runs" / f"{cfg.method}-{cfg.dataset}-s{cfg.seed}-{stamp}"


def initial_weights(cfg: RunConfig) -> list:
    """The round-0 global model of ``cfg`` as arrays."""
    return get_weights(initial_model(cfg, load_dataset(cfg.dataset, cfg.data_dir, cfg.download)))


def data_summary(cfg: RunConfig) -> dict:
    """The realized noise and partition sizes (the simulator knows the true labels)."""
    fed = federated_data(cfg)
    sizes = [len(ix) for ix in fed.client_indices]
    return {"realized_noise_rate": fed.realized_noise_rate, "train_samples": len(fed.true_labels),
            "client_sizes_min": min(sizes), "client_sizes_max": max(sizes),
            "noise_matrices": [m.tolist() for m in fed.noise_matrices]}


def server_fn(context: Context) -> ServerAppComponents:
    """Validate everything (config, data, output folder, checkpoint) before round 1, then
    build the method's strategy and a server that starts at round 1 or after the
    checkpoint's round."""
    cfg = load_run_config(context.run_config)
    configure_threads(cfg.client_threads)
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    info = data_summary(cfg)
    init = initial_weights(cfg)
    ckpt = None
    if cfg.resume_from:
        ckpt = checkpoint.load(cfg.resume_from)
        checkpoint.check_compatible(ckpt, cfg.to_flat(), cfg.resume_from, [w.shape for w in init])
        if cfg.out_dir and cfg.out_dir != cfg.resume_from:
            raise ConfigError(f"out-dir={cfg.out_dir!r} differs from resume-from="
                              f"{cfg.resume_from!r}: a resumed run continues in its own folder; "
                              "leave out-dir empty or equal to resume-from")
    out_dir = cfg.resume_from or cfg.out_dir or str(default_out_dir(cfg))
    if ckpt:
        log(INFO, "resuming %s after round %d", out_dir, ckpt.round)
    recorder = RunRecorder(out_dir, {**cfg.to_flat(), "out-dir": out_dir},
                           resume_round=ckpt.round if ckpt else None)
    log(INFO, "FedEFC run | method %s | %s (%d train / %d test) | %d clients, %d per round | "
        "%d rounds | realized noise rate %.4f | results -> %s", cfg.method, cfg.dataset,
        len(data.train_y), len(data.test_y), cfg.num_clients,
        max(1, int(cfg.num_clients * cfg.fraction)), cfg.rounds, info["realized_noise_rate"],
        out_dir)
    strategy = STRATEGIES.get(cfg.method, FedEFCStrategy)(
        cfg, TestSetEvaluator(cfg), recorder,
        ndarrays_to_parameters(ckpt.weights if ckpt else init),
        run_info={k: v for k, v in info.items() if k != "noise_matrices"},
        max_samples=len(data.train_y))
    if ckpt:
        strategy.load_server_state(ckpt.strategy)
    atomic_write_json(Path(out_dir) / "data.json", info)
    server = ResumableServer(client_manager=SimpleClientManager(), strategy=strategy,
                             first_round=ckpt.round + 1 if ckpt else 1)
    return ServerAppComponents(server=server, config=ServerConfig(
        num_rounds=cfg.rounds, round_timeout=cfg.client_timeout or None))


app = ServerApp(server_fn=server_fn)
