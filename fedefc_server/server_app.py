"""The ServerApp: the method's server hooks, the round pipeline and the round loop, built
from the run config.

Everything is validated before round 1 (config, data, model, output folder,
checkpoint), so a bad run fails at once. A run with ``resume-from`` continues after its
checkpoint's round, in its own folder (docs/RELIABILITY.md).

With a server test set (``evaluation = server | both``) the server loads the run's
dataset: the test set, and the training data for its facts (realized noise rate,
client sizes, the sizes its nodes must declare); with own data and no ``data-path``
(the nodes hold the training data) only the coordinator's test set (``test-path``), a
node's declared size then bounded by ``max-client-samples`` only. With ``evaluation =
federated`` it loads no data at all: the round-0 model is built from the input shape
and K of :func:`common.datasets.task_shape` (``input-shape`` and ``num-classes``, or
the header of ``data-path`` when this machine has that file; docs/OWN-DATA.md, "The
server holds no data"), and a node's declared size is bounded by
``max-client-samples`` only (in a simulation, by the data plan, which the server then
builds).
With ``allowlist`` the operator's file (:mod:`.allowlist`) decides which node may serve
which partition; it is read and checked before round 1. A deployment without one is
refused unless ``open-deployment = true``; in a simulation the server builds the data plan
even when it evaluates nothing itself, so that every simulated node's declaration is
checked against it (:func:`.declarations.admission`; docs/THREAT-MODEL.md, "Identity and
partitions").

The app is Flower's workflow style (``@app.main()``), since secure aggregation needs
the grid: :func:`main` builds the round loop and runs it with Flower's ``start_grid``
(what a ``server_fn`` app does); with ``secure-aggregation = true`` the loop's rounds
go through Flower's SecAgg+ workflow (:mod:`.secure_round`). One loop, both modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common import Context, ndarrays_to_parameters
from flwr.common.logger import log
from flwr.server import ServerApp, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat import start_grid
from flwr.serverapp.grid import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from torch import nn

from common.config import OWN_DATASETS, ConfigError, RunConfig
from common.data_files import shape_text
from common.data_plan import data_plan
from common.datasets import load_dataset, task_shape
from common.flower_log import timestamp_flower_lines
from common.methods import load_object, load_run_config, method_of, short_run_warning
from common.models import TaskShape, classifier_shape
from common.params import get_weights
from common.results import RunRecorder, atomic_write_json, run_folder
from common.runtime import initial_model
from common.training import configure_threads
from common.twin import paired
from common.update_bound import float_size

from . import checkpoint
from .allowlist import Allowlist
from .clean_set import attach_clean_set
from .guard import delivery_rule
from .declarations import SizeRule, admission
from .dishonest import DishonestGrid, with_server_faults
from .evaluation import TestSetEvaluator
from .link_watch import LinkWatchGrid
from .method_server import MethodServer
from .pipeline import RoundPipeline
from .registry import PartitionRegistry
from .resumes import resume_event
from .round_loop import RoundLoop
from .secure_round import SecureRound
from .summary import admission_text


def data_summary(cfg: RunConfig) -> dict[str, Any]:
    """The realized noise and partition sizes (the simulator knows the true labels)."""
    plan = data_plan(cfg)
    sizes = [len(ix) for ix in plan.client_indices]
    return {"realized_noise_rate": plan.realized_noise_rate, "train_samples": len(plan.true_labels),
            "client_sizes_min": min(sizes), "client_sizes_max": max(sizes),
            "noise_matrices": [m.tolist() for m in plan.noise_matrices]}


def coordinator_test_set_only(cfg: RunConfig) -> bool:
    """Whether the server holds only a test set: own data, a ``test-path`` and no
    ``data-path`` (the nodes bring theirs; docs/OWN-DATA.md)."""
    return cfg.dataset in OWN_DATASETS and bool(cfg.test_path) and not cfg.data_path


def is_simulation(grid: Grid | None) -> bool:
    """Whether ``grid`` (under a dishonest server's, :mod:`.dishonest`) is the grid of
    Flower's simulation engine, whose nodes serve the run's own partitions."""
    inner = grid.grid if isinstance(grid, DishonestGrid) else grid
    return isinstance(inner, InMemoryGrid)


@dataclass(frozen=True)
class DataSource:
    """What the server reads of the run's data: the task's shape, the facts
    ``data.json`` keeps, its test set (None: the server evaluates nothing itself), the
    rule that bounds the sizes nodes declare, and the run header's words for it."""

    task: TaskShape
    info: dict[str, Any]
    evaluator: TestSetEvaluator | None
    rule: SizeRule
    text: str


def data_source(cfg: RunConfig) -> DataSource:
    """The data the server holds: the coordinator's clean test set alone (own data
    held by the nodes), the run's dataset (its test set, and the data plan whose
    partitions bound the nodes' sizes), or nothing but the task's shape (``evaluation =
    federated``; the module docstring)."""
    if cfg.server_evaluation and coordinator_test_set_only(cfg):
        # the nodes hold the training data, the coordinator its clean test set
        data = load_dataset(cfg)
        task, info = data.task, {"test_samples": len(data.test_y)}
        evaluator, rule = TestSetEvaluator(cfg, data), SizeRule.for_run(cfg, None)
        text = (f"{cfg.dataset} (training data held by the clients; the coordinator's "
                f"test set: {len(data.test_y)} samples of {shape_text(task.input_shape)}, "
                f"K={task.num_classes})")
    elif cfg.server_evaluation:
        # the noise the run config puts on the dataset's partitions; a deployed node with
        # its own data-path keeps its own labels, whose noise the server cannot know
        data = load_dataset(cfg)
        task, info = data.task, data_summary(cfg)
        evaluator, rule = TestSetEvaluator(cfg, data), SizeRule.for_run(cfg, data_plan(cfg))
        text = (f"{cfg.dataset} ({len(data.train_y)} train / {len(data.test_y)} test) | "
                f"realized noise rate {info['realized_noise_rate']:.4f} on the data plan's "
                "partitions" + (" (a node serving its own data-path keeps its own labels)"
                                if cfg.dataset in OWN_DATASETS else ""))
    else:  # the clients hold the data: nothing is read here but the shape and K
        task, info, evaluator = task_shape(cfg, "the server"), {}, None
        rule = SizeRule.for_run(cfg, None)
        text = (f"{cfg.dataset} (held by the clients: {shape_text(task.input_shape)} "
                f"inputs, K={task.num_classes})")
    info.update(evaluation=cfg.evaluation_mode, input_shape=list(task.input_shape),
                num_classes=task.num_classes)
    return DataSource(task, info, evaluator, rule, text)


@dataclass(frozen=True)
class Admission:
    """Which nodes the run admits: the rule their declared sizes must meet, the
    operator's allowlist (None: none), and the summary's record of both."""

    rule: SizeRule
    allowlist: Allowlist | None
    record: dict[str, Any]


def admission_for(cfg: RunConfig, simulation: bool, rule: SizeRule) -> Admission:
    """The run's admission (:func:`.declarations.admission`): in a simulation whose data
    the server does not read, the data plan's partitions bound the simulated nodes."""
    if simulation and rule.max_private is None and not coordinator_test_set_only(cfg):
        # Flower's simulated nodes serve partitions of the run's data: the plan bounds them
        rule = SizeRule.for_run(cfg, data_plan(cfg))
    record = admission(cfg, simulation, rule)
    allowlist = Allowlist.load(cfg.allowlist, cfg.num_clients) if cfg.allowlist else None
    return Admission(rule, allowlist, record)


def resume_point(cfg: RunConfig, shapes: list[tuple[int, ...]]) -> checkpoint.Checkpoint | None:
    """The checkpoint a ``resume-from`` run continues after (None: the run starts at
    round 1), checked against the run's config and model ``shapes``; a resumed run
    writes in its own folder."""
    if not cfg.resume_from:
        return None
    ckpt = checkpoint.load(cfg.resume_from)
    checkpoint.check_compatible(ckpt, cfg.to_flat(), cfg.resume_from, shapes)
    if cfg.out_dir and cfg.out_dir != cfg.resume_from:
        raise ConfigError(f"out-dir={cfg.out_dir!r} differs from resume-from="
                          f"{cfg.resume_from!r}: a resumed run continues in its own folder; "
                          "leave out-dir empty or equal to resume-from")
    log(INFO, "resuming %s after round %d", cfg.resume_from, ckpt.round)
    return ckpt


def announce(cfg: RunConfig, source: DataSource, out_dir: str, admitted: Admission) -> None:
    """The run's header in the log: what runs on which data, where its results go, who
    is admitted, and the warnings of its config."""
    log(INFO, "FedEFC run | method %s | %s | %d clients, %d per round | %d rounds | "
        "evaluation: %s | delivers %s | results -> %s", cfg.method, source.text,
        cfg.num_clients, cfg.clients_per_round, cfg.rounds, cfg.evaluation_mode,
        delivery_rule(cfg), out_dir)
    log(INFO, "%s", admission_text(admitted.record))
    if cfg.twinned:
        log(INFO, "each client also trains a twin of the global model on all its data but "
            "the guard slice of its share: the model the run delivers and the guard reads "
            "(twin-model; docs/FEDEFC.md §3.8)")
    short = short_run_warning(cfg)
    if short:
        log(WARNING, "%s", short)


def pipeline_for(cfg: RunConfig, model: nn.Module, source: DataSource, admitted: Admission,
                 ckpt: checkpoint.Checkpoint | None, simulation: bool) -> RoundPipeline:
    """The round pipeline: the method's server hooks, the partition registry of the
    run's admission and its test set, the coordinator's clean validation set where the
    run has one (docs/FEDEFC.md §3.9), with a resumed run's state put back."""
    server_hooks: type[MethodServer] = load_object(method_of(cfg).server)
    pipeline = RoundPipeline(cfg, method_of(cfg),
                             server_hooks(cfg, classifier_shape(model, source.task)),
                             PartitionRegistry(admitted.rule, allowlist=admitted.allowlist,
                                               wait_for_nodes=cfg.wait_for_nodes),
                             source.evaluator)
    attach_clean_set(pipeline.server, cfg, simulation)
    if ckpt:
        pipeline.load_state(ckpt.strategy)
        pipeline.server.load_models(ckpt.models)
    return pipeline


def build(context: Context, grid: Grid, link: LinkWatchGrid | None = None
          ) -> tuple[RoundLoop, ServerConfig]:
    """Validate everything before round 1, then build the method's server hooks, the
    round pipeline and a round loop that starts at round 1 or after the checkpoint's
    round; ``link``: a deployment's watched grid under ``grid`` (:mod:`.link_watch`).
    Each step is a function named for what it decides."""
    cfg = load_run_config(context.run_config)
    configure_threads(cfg.client_threads)
    source = data_source(cfg)
    simulation = is_simulation(grid)
    admitted = admission_for(cfg, simulation, source.rule)
    model = initial_model(cfg, source.task)
    init = paired(get_weights(model)) if cfg.twinned else get_weights(model)
    ckpt = resume_point(cfg, [w.shape for w in init])
    out_dir = run_folder(cfg.out_dir, cfg.resume_from, cfg.method, cfg.dataset, cfg.seed)
    resumed = resume_event(out_dir, ckpt.round) if ckpt else None  # before the recorder
    recorder = RunRecorder(out_dir, {**cfg.recorded(), "out-dir": out_dir},
                           resume_round=ckpt.round if ckpt else None)
    announce(cfg, source, out_dir, admitted)
    pipeline = pipeline_for(cfg, model, source, admitted, ckpt, simulation)
    pipeline.initial_size = float_size(init)  # a resumed run's bound is the same
    atomic_write_json(Path(out_dir) / "data.json", source.info)
    manager = SimpleClientManager()
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(ckpt.weights if ckpt else init),
                     cfg=cfg, recorder=recorder, model=model,
                     run_info={**{k: v for k, v in source.info.items()
                                  if k != "noise_matrices"},
                               "admission": admitted.record,
                               **({"site_names": admitted.allowlist.site_names()}
                                  if admitted.allowlist else {})},
                     first_round=ckpt.round + 1 if ckpt else 1,
                     elapsed_before=ckpt.elapsed_s if ckpt else 0.0,
                     secure_round=(SecureRound(grid, context, manager, cfg)
                                   if cfg.secure_aggregation else None),
                     link=link, resumed=resumed)
    return loop, ServerConfig(num_rounds=cfg.rounds, round_timeout=cfg.client_timeout or None)


timestamp_flower_lines()
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the run (:func:`build`) and run its round loop on Flower's grid: in a
    deployment watched for a SuperLink that restarts mid-exchange (:mod:`.link_watch`);
    with a ``server-faults`` run, below a dishonest server's (:mod:`.dishonest`)."""
    link = LinkWatchGrid.over(grid)
    grid = with_server_faults(link or grid, load_run_config(context.run_config))
    loop, config = build(context, grid, link)
    start_grid(grid=grid, server=loop, config=config)
