"""The recipes of docs/ARCHITECTURE.md ("Where to add"), followed to the letter on a copy
of the project: a new method, a new named dataset and a new built-in model, each one
registration plus its own files, run end to end through Flower's simulation, the grid
runner and the report, without touching any other table."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The method's own files: its server hooks and its local update.
TOY_SERVER = '''
"""A toy method's server: counts the rounds it aggregated."""

from common.messages import FitConfig

from ..method_server import MethodServer


class ToyServer(MethodServer):
    def __init__(self, cfg, model_shape):
        super().__init__(cfg, model_shape)
        self.aggregated = 0

    def client_config(self, server_round, partition_id):
        return {"toy-scale": 0.5}

    def after_aggregate(self, result):
        self.aggregated += result.parameters is not None
        return result.parameters, {"toy_aggregated": self.aggregated}

    def state(self):
        return {"toy": self.aggregated}

    def load_state(self, state):
        self.aggregated = state["toy"]
'''
TOY_UPDATE = '''
"""A toy method's local update: FedAvg's, reporting how many samples it saw."""

from common.messages import FitReply

from ..job import LocalJob
from ..local_update import Update


def toy(job: LocalJob) -> Update:
    assert job.config["toy-scale"] == 0.5
    stats = job.train()
    return len(job.labels), {FitReply.LOSS: "toy", "toy-seen": len(job.labels)}, stats
'''
# The three registrations, appended to the registries.
METHOD_ENTRY = '''
METHODS["toy"] = Method("toy", "Toy", "fedefc_server.baselines.toy:ToyServer",
                        "fedefc_client.baselines.toy:toy",
                        reply=(ReplyMetric("toy-seen", "count", ("sum",)),))
'''
DATASET_ENTRY = '''

@register_dataset("toy-blobs", num_classes=3, input_shape=(1, 8, 8), mean=(0.5,), std=(0.25,),
                  model="toy-mlp")
def load_toy_blobs(data_dir: str, download: bool) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 400)
    x = np.clip(rng.normal(60 + 60 * y[:, None, None, None], 20, (400, 1, 8, 8)), 0, 255)
    x, y = x.astype(np.uint8), y.astype(np.int64)
    return x[:300], y[:300], x[300:], y[300:]
'''
MODEL_ENTRY = '''

@register_model("toy-mlp", images=False)
def toy_mlp(task: TaskShape) -> FeatureClassifier:
    return MLP(math.prod(task.input_shape), task.num_classes)
'''
GRID = '''
name = "toy-grid"
title = "the recipes' toy method"
seeds = [0]

[rows]
"Toy" = { method = "toy" }

[columns.blobs]
dataset = "toy-blobs"
num-clients = 3
fraction = 1.0
rounds = 2
start-round = 1
local-epochs = 1
batch-size = 16
rho = 0.2
zeta = 0.5
client-threads = 1
'''


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> Path:
    """A copy of the project with the toy method, dataset and model added as the recipes
    say, and its toy grid run and reported by the copy's own ``fedefc``."""
    copy = tmp_path_factory.mktemp("extended") / "app"
    for name in ("common", "fedefc_server", "fedefc_client", "fedefc_cli", "configs"):
        shutil.copytree(ROOT / name, copy / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    (copy / "fedefc_server/baselines/toy.py").write_text(textwrap.dedent(TOY_SERVER))
    (copy / "fedefc_client/baselines/toy.py").write_text(textwrap.dedent(TOY_UPDATE))
    for path, entry in (("common/methods.py", METHOD_ENTRY),
                        ("common/named_datasets.py", DATASET_ENTRY),
                        ("common/models.py", MODEL_ENTRY)):
        with open(copy / path, "a") as fh:
            fh.write(entry)
    grid = copy / "toy-grid.toml"
    grid.write_text(GRID)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    cmd = [sys.executable, "-m", "fedefc_cli.main", "grid", "run", str(grid),
           "--results-dir", str(copy / "results")]
    done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return copy / "results" / "toy-grid"


def cell(results: Path, row: str) -> Path:
    """The folder of the grid's only seed of ``row`` (<grid>/<row>/<column>/s<seed>)."""
    (folder,) = [p.parent for p in (results / row).rglob("summary.json")]
    return folder


@pytest.mark.flower
def test_a_new_method_dataset_and_model_run_through_simulation_grid_and_report(extended):
    toy = cell(extended, "toy")
    rounds = [json.loads(x) for x in (toy / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rounds if r["round"] > 0]
    # the method's server hooks ran in the ServerApp, its update in every ClientApp ...
    assert [r["toy_aggregated"] for r in trained] == [1, 2]
    assert all(r["client_loss"] == ["toy"] * 3 for r in trained)
    # ... and the reply metric it declared was checked and folded as declared
    assert all(r["toy_seen"] == sum(r["num_examples"]) for r in trained)
    # the dataset's loader and the model's builder were used by name
    data = json.loads((toy / "data.json").read_text())
    assert data["train_samples"] == 300 and data["input_shape"] == [1, 8, 8]
    config = json.loads((toy / "config.json").read_text())
    assert (config["dataset"], config["model"]) == ("toy-blobs", "auto")
    summary = json.loads((toy / "summary.json").read_text())
    assert 0.0 <= summary["final_acc"] <= 1.0
    # the report tabulates the new row
    assert "| Toy |" in (extended / "table.md").read_text()
