"""The ServerApp: builds the FedEFC strategy from the run config (legacy ServerApp style)."""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path

from flwr.common import Context, ndarrays_to_parameters
from flwr.common.logger import log
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from common.config import RunConfig, load_run_config
from common.datasets import load_dataset
from common.federation import federated_data
from common.params import get_weights
from common.results import RunRecorder, atomic_write_json
from common.runtime import initial_model
from common.training import configure_threads

from .evaluation import TestSetEvaluator
from .strategy import FedEFCStrategy


def default_out_dir(cfg: RunConfig) -> Path:
    """Where results go when ``out-dir`` is empty: ~/fedefc-runs/<method>-<dataset>-s<seed>-<time>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path.home() / "fedefc-runs" / f"{cfg.method}-{cfg.dataset}-s{cfg.seed}-{stamp}"


def data_summary(cfg: RunConfig) -> dict:
    """The realized noise and partition sizes (the simulator knows the true labels)."""
    fed = federated_data(cfg)
    sizes = [len(ix) for ix in fed.client_indices]
    return {"realized_noise_rate": fed.realized_noise_rate, "train_samples": len(fed.true_labels),
            "client_sizes_min": min(sizes), "client_sizes_max": max(sizes),
            "noise_matrices": [m.tolist() for m in fed.noise_matrices]}


def server_fn(context: Context) -> ServerAppComponents:
    cfg = load_run_config(context.run_config)
    configure_threads(cfg.client_threads)
    out_dir = cfg.out_dir or str(default_out_dir(cfg))
    recorder = RunRecorder(out_dir, {**cfg.to_flat(), "out-dir": out_dir})
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    info = data_summary(cfg)
    log(INFO, "FedEFC run | method %s | %s (%d train / %d test) | %d clients, %d per round | "
        "%d rounds | realized noise rate %.4f | results -> %s", cfg.method, cfg.dataset,
        len(data.train_y), len(data.test_y), cfg.num_clients,
        max(1, int(cfg.num_clients * cfg.fraction)), cfg.rounds, info["realized_noise_rate"],
        out_dir)
    strategy = FedEFCStrategy(
        cfg, TestSetEvaluator(cfg), recorder,
        ndarrays_to_parameters(get_weights(initial_model(cfg, data))),
        run_info={k: v for k, v in info.items() if k != "noise_matrices"})
    atomic_write_json(Path(out_dir) / "data.json", info)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=cfg.rounds))


app = ServerApp(server_fn=server_fn)
