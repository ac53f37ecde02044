"""CUDA check: every method's real strategy and clients on a GPU, plus throughputs.

For machines without Ray (or to debug), the federation runs in one process: the method's
real server hooks and round pipeline inside the app's round loop (:class:`RoundLoop`), and real
MethodClient objects behind in-process ClientProxies (each with its own persistent
``context.state``). Everything trains on ``cuda``. Then it times local training of
the paper's models (9-conv CNN on MNIST; ResNet-18 / ResNet-34 at batch 10 on
CIFAR-shaped data) and extrapolates the wall time of a paper-scale run.

    python tests/benchmarks/gpu_check.py --data-dir /abs/data --out /abs/out
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.common import Code, GetPropertiesRes, Status, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from common.data_plan import data_plan
from common.losses import cross_entropy
from common.methods import load_object, load_run_config, method_of
from common.models import TaskShape, build_model, classifier_shape
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from common.training import BatchTransform, SGDSettings, TrainingSet, train
from fedefc_cli.run_configs import read_app_defaults, read_preset
from fedefc_client.client import MethodClient
from fedefc_client.local_data import partition_data
from fedefc_server.declarations import SizeRule
from fedefc_server.evaluation import TestSetEvaluator
from fedefc_server.pipeline import RoundPipeline
from fedefc_server.registry import PartitionRegistry
from fedefc_server.round_loop import RoundLoop


class InProcessProxy(ClientProxy):
    """A node served by a MethodClient in this process (state kept across rounds)."""

    def __init__(self, cfg, pid: int, device):
        super().__init__(f"node-{pid}")
        self.cfg, self.pid, self.device, self.state = cfg, pid, device, RecordDict()

    def _client(self):
        return MethodClient(self.cfg, self.pid, lambda: partition_data(self.cfg, self.pid,
                                                                       self.device), self.state)

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(Status(Code.OK, ""), self._client().get_properties({}))

    def fit(self, ins, timeout, group_id):
        return self._client().to_client().fit(ins)

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError


def run_in_process(flat: dict) -> dict:
    cfg = load_run_config(flat)
    device = torch.device(cfg.device if cfg.device != "auto" else "cuda")
    manager = SimpleClientManager()
    for pid in range(cfg.num_clients):
        manager.register(InProcessProxy(cfg, pid, device))
    plan = data_plan(cfg)
    data = plan.data
    model = initial_model(cfg, data.task)
    hooks = load_object(method_of(cfg).server)(cfg, classifier_shape(model, data.task))
    pipeline = RoundPipeline(cfg, method_of(cfg), hooks,
                             PartitionRegistry(SizeRule.for_run(cfg, plan)),
                             TestSetEvaluator(cfg, data))
    server = RoundLoop(client_manager=manager, pipeline=pipeline,
                       parameters=ndarrays_to_parameters(get_weights(model)), cfg=cfg,
                       recorder=RunRecorder(cfg.out_dir, cfg.recorded()), model=model,
                       run_info={})
    server.set_max_workers(1)  # clients share the process's model cache: one at a time
    start = time.monotonic()
    server.fit(cfg.rounds, None)
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    return {"method": cfg.method, "model": cfg.resolved_model(data.task.input_shape),
            "final_acc": summary["final_acc"],
            "t_e": summary.get("t_e"), "seconds": round(time.monotonic() - start, 1)}


def throughput(name: str, channels: int, size: int, classes: int, batch: int,
               device, n: int = 1000) -> float:
    """Local-training samples per second (E epochs of SGD, as a client does)."""
    model = build_model(name, TaskShape((channels, size, size), classes), seed=0).to(device)
    x = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, device=device)
    y = torch.randint(0, classes, (n,), device=device)
    mean, std = (0.5,) * channels, (0.25,) * channels
    settings = SGDSettings(epochs=2, batch_size=batch, lr=0.01, momentum=0.5)
    data = TrainingSet(x, y, BatchTransform(mean, std, device), augment=channels == 3)
    args = (model, data, cross_entropy, settings, torch.Generator().manual_seed(0))
    train(*args)  # warm-up (cuDNN autotuning, allocator)
    torch.cuda.synchronize()
    start = time.monotonic()
    train(*args)
    torch.cuda.synchronize()
    return 2 * n / (time.monotonic() - start)


def write_fake_cifar(root: Path, n_train: int = 500) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in [*[(f"data_batch_{i}", n_train // 5) for i in range(1, 6)], ("test_batch", 200)]:
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         "labels": rng.integers(0, 10, n).tolist()}, fh)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--paper-rounds", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the method checks only")
    args = ap.parse_args()
    out = Path(args.out)
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(json.dumps(report), flush=True)
    base = {**read_app_defaults(), "dataset": "mnist", "data-dir": args.data_dir,
            "device": args.device, "num-clients": 10, "fraction": 0.5, "rounds": 6,
            "start-round": 1, "gamma-thr": 1, "local-epochs": 2, "model": "lenet"}
    quick = {"fedcorr": {"fedcorr-iterations": 1, "fedcorr-finetune-share": 0.5},
             "fednoro": {"fednoro-warmup": 2, "fednoro-kd-begin": 2, "fednoro-kd-end": 5},
             "rofl": {"rofl-num-gradual": 2, "rofl-t-pl": 3}}
    methods = ["fedefc", "fedavg", "fedprox", "fedditto", "forward-correction",
               "confident-learning", "fedcorr", "fednoro", "rofl"]
    report["methods"] = []
    for method in methods:
        flat = {**base, **quick.get(method, {}), "method": method,
                "out-dir": str(out / f"method-{method}")}
        try:
            row = run_in_process(flat)
        except Exception:  # report and go on: one broken method must not hide the others
            row = {"method": method, "error": traceback.format_exc()[-2000:]}
        report["methods"].append(row)
        print(json.dumps(row), flush=True)
    if args.device != "cuda":
        sys.exit(0 if all("error" not in r for r in report["methods"]) else 1)
    device = torch.device("cuda")
    rates = {"cnn9 (MNIST, batch 64)": throughput("cnn9", 1, 28, 10, 64, device),
             "lenet (MNIST, batch 64)": throughput("lenet", 1, 28, 10, 64, device),
             "resnet18 (CIFAR-10, batch 10)": throughput("resnet18", 3, 32, 10, 10, device),
             "resnet34 (CIFAR-100, batch 10)": throughput("resnet34", 3, 32, 100, 10, device)}
    per_round = {"cnn9 (MNIST, batch 64)": (60000, 100),
                 "resnet18 (CIFAR-10, batch 10)": (50000, 200),
                 "resnet34 (CIFAR-100, batch 10)": (50000, 300)}
    report["throughput_samples_per_s"] = {k: round(v) for k, v in rates.items()}
    report["paper_run_training_hours"] = {
        k: round(n / 10 * 5 * rounds / rates[k] / 3600, 2) for k, (n, rounds) in per_round.items()}
    print(json.dumps({"throughput": report["throughput_samples_per_s"],
                      "paper_hours": report["paper_run_training_hours"]}), flush=True)
    paper = {**read_app_defaults(), **read_preset("mnist"), "data-dir": args.data_dir,
             "device": "cuda", "rounds": args.paper_rounds, "start-round": 5,
             "out-dir": str(out / "paper-mnist-cnn9")}
    try:
        report["paper_mnist_cnn9"] = run_in_process(paper)
    except Exception:
        report["paper_mnist_cnn9"] = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps(report["paper_mnist_cnn9"]), flush=True)
    cifar = write_fake_cifar(out / "fake-cifar")
    c10 = {**read_app_defaults(), **read_preset("cifar10"), "data-dir": str(cifar),
           "device": "cuda", "num-clients": 10, "fraction": 0.5, "rounds": 3, "start-round": 1,
           "gamma-thr": 1, "local-epochs": 1, "out-dir": str(out / "cifar10-resnet18")}
    try:
        report["cifar10_resnet18_smoke"] = run_in_process(c10)
    except Exception:
        report["cifar10_resnet18_smoke"] = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps(report["cifar10_resnet18_smoke"]), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    sys.exit(0 if all("error" not in r for r in report["methods"]) else 1)


if __name__ == "__main__":
    main()
