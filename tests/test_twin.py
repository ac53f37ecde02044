"""The twin (``twin-model``, docs/FEDEFC.md §3.8): under full participation FedEFC's
clients also train a twin of the global model on all their data but the guard slice of
their share, the model the run delivers and the guard reads. Checked against independent
truths: in phase 1 the twin is the cross-entropy update of every sample but the slice
and the probe the client without a twin; the twin's reading is the received twin's
accuracy on the slice; in phase 2 the twin is the forward-corrected update of those
samples with the Q the probe counted; the server reads the twin (test set, federated
evaluation, ``model.pt``); a real simulation with a twin delivers it, read."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

from common.config import ConfigError
from common.losses import forward_corrected_loss
import common.methods
from common.methods import METHODS, changed_keys, default_config, load_run_config
from common.params import get_weights, set_weights
from common.results import RunRecorder
from common.runtime import initial_model, model_for
from common.training import BatchTransform, predict_proba
from common.twin import delivered, halves, paired
from fedefc_client.client import MethodClient
from fedefc_client.job import NOISE_MODEL, LocalJob
from fedefc_client.local_data import partition_data
from fedefc_client.local_update import POOLED_COUNTS
from fedefc_client.node_state import load_vector
from fedefc_server import checkpoint
from fedefc_server.plan import round_config
from fedefc_server.round_evaluation import RoundEvaluation
from fedefc_server.round_loop import RoundLoop
from tests.helpers import make_pipeline, records, small_job
from tests.test_guard import GUARDED, SIZES, HeldOutNode

CPU = torch.device("cpu")
SILO = {"num-clients": 4, "fraction": 1.0, "local-epochs": 1}  # every client, every round
VERIFIED = {"validation-labels": "verified", "validation-max-per-class": 5, "rho": 0.4,
            "zeta": 0.8}  # a checked share of 5 per class, heavy noise on the rest


@pytest.mark.parametrize(("keys", "twinned"), [
    ({}, False),                                    # the paper's sampling: no share
    (SILO, True),                                   # every client, every round
    ({**SILO, "validation-labels": "verified"}, True),   # the checked share too
    ({**SILO, "method": "fedavg"}, False),
    ({**SILO, "method": "forward-correction"}, False),
    ({**SILO, "dp-clip": 1.0}, False),
    ({**SILO, "prestopping": False}, False),
    ({**SILO, "twin-model": "off"}, False),
    ({**SILO, "validation-labels": "verified", "twin-model": "off"}, False),
])
def test_auto_trains_a_twin_where_the_held_out_signal_keeps_a_share(keys, twinned):
    assert load_run_config(keys).twinned is twinned


@pytest.mark.parametrize(("keys", "names"), [
    ({"twin-model": "on"}, "keeps none"),
    ({**SILO, "twin-model": "on", "method": "confident-learning"}, "has no such phase"),
    ({**SILO, "twin-model": "on", "max-update-norm": 5.0}, "bound one model's update"),
])
def test_a_twin_that_cannot_be_trained_is_refused_naming_why(keys, names):
    with pytest.raises(ConfigError, match=names):
        load_run_config(keys)


def test_the_twin_rule_reads_the_methods_declaration_not_its_name(monkeypatch):
    """Whether a method's clients can train a twin is declared on its registry entry
    (``Method.twin``, common/methods.py), and the rule reads the entry: FedEFC declared
    without it trains none, forward correction declared with it trains one."""
    monkeypatch.setattr(common.methods, "_PARSED", {})  # no run config validated before
    monkeypatch.setattr(common.methods, "_LAST", [None, None])
    monkeypatch.setitem(METHODS, "fedefc", replace(METHODS["fedefc"], twin=False))
    monkeypatch.setitem(METHODS, "forward-correction",
                        replace(METHODS["forward-correction"], twin=True))
    assert not load_run_config(SILO).twinned
    with pytest.raises(ConfigError, match="has no such phase"):
        load_run_config({**SILO, "twin-model": "on"})
    assert load_run_config({**SILO, "method": "forward-correction"}).twinned


def test_a_stored_run_without_the_key_had_no_twin():
    wanted = load_run_config(SILO).to_flat()
    older = {k: v for k, v in wanted.items() if k != "twin-model"}
    assert changed_keys(older, wanted) == {"twin-model": ("off", "on")}
    assert changed_keys({**wanted, "twin-model": "on"}, wanted) == {}
    flat = default_config()  # the paper's sampling: auto trains none, as before the key
    assert changed_keys({k: v for k, v in flat.items() if k != "twin-model"}, flat) == {}


def test_a_run_records_the_twin_it_trained_and_an_older_auto_with_verified_labels_had_none(
        tmp_path):
    """A run records "on" or "off" (config.json, the checkpoint); a recorded "auto" with
    verified labels is from before "auto" trained a twin with them: it is read, and
    resumed, as "off" (docs/FEDEFC.md §3.8)."""
    from fedefc_cli.run_configs import resume_config
    verified = load_run_config({**SILO, **VERIFIED})
    wanted = verified.to_flat()
    assert wanted["twin-model"] == "auto" and verified.recorded()["twin-model"] == "on"
    assert changed_keys(verified.recorded(), wanted) == {}
    assert load_run_config(SILO).recorded()["twin-model"] == "on"
    assert load_run_config({}).recorded()["twin-model"] == "off"  # the paper's sampling
    older = {**wanted, "out-dir": str(tmp_path)}  # recorded "auto"
    folder = frozenset({"out-dir"})
    assert changed_keys(older, wanted, folder) == {"twin-model": ("off", "on")}
    assert changed_keys(older, {**wanted, "twin-model": "off"}, folder) == {}
    (tmp_path / "config.json").write_text(json.dumps(older))
    assert resume_config(str(tmp_path), [])["twin-model"] == "off"
    (tmp_path / "config.json").write_text(json.dumps(verified.recorded()))
    assert resume_config(str(tmp_path), [])["twin-model"] == "on"


def test_a_pair_is_the_twin_then_the_probe():
    assert paired([1, 2]) == [1, 2, 1, 2]
    assert halves([1, 2, 3, 4]) == ([1, 2], [3, 4])
    assert delivered([1, 2, 3, 4], True) == [1, 2] and delivered([1, 2], False) == [1, 2]
    with pytest.raises(ValueError, match="even number of arrays, not 3"):
        halves([1, 2, 3])


def clients(pid: int = 1, **keys):
    """(the twinned client, the same client without a twin, FedAvg's client) of one
    partition, each with a fresh node state, and the twinned run's config; ``keys``
    change the two FedEFC clients' config."""
    cfg = load_run_config({**SILO, **keys})
    plain = load_run_config({**SILO, **keys, "twin-model": "off"})
    fedavg = load_run_config({**SILO, "method": "fedavg"})
    data = {c: partition_data(c, pid, CPU) for c in (cfg, plain, fedavg)}
    return ([MethodClient(c, pid, lambda c=c: data[c], RecordDict())
             for c in (cfg, plain, fedavg)], cfg)


def equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def truth(cfg, local, start, seed, q=None, slice_out=True) -> list[np.ndarray]:
    """The twin's update by hand: cross-entropy (or the forward-corrected loss with
    ``q``) on every sample but the guard slice, every second position of the share (with
    ``slice_out``; else on every sample)."""
    keep = np.ones(len(local), dtype=bool)
    if slice_out:
        keep[local.validation[::2]] = False
    model = model_for(cfg, local.data.task, CPU, "truth")
    set_weights(model, start)
    everything = replace(local.roles, share=None, estimation=None)
    job = LocalJob(cfg, replace(local, roles=everything), model, 1 if q is None else 2, 9, seed)
    loss = {} if q is None else {"loss_fn": partial(
        forward_corrected_loss, q=torch.as_tensor(q, dtype=torch.float32))}
    job.train(keep=keep, **loss)
    return get_weights(model)


def test_in_phase_1_the_twin_trains_all_but_its_guard_slice_and_is_read_on_the_slice():
    (twinned, plain, fedavg), cfg = clients()
    local = twinned.local
    start = get_weights(initial_model(cfg, local.data.task))
    config = round_config(cfg, 1, 3)
    weights, n, metrics = twinned.fit(paired(start), {**config, "phase": 1})
    twin, probe = halves(weights)
    want_probe, want_n, want_metrics = plain.fit(start, {**config, "phase": 1})
    assert equal(probe, want_probe)
    assert equal(twin, truth(cfg, local, start, int(config["seed"])))
    assert not equal(twin, probe)  # the twin trained on half the share too
    assert n == want_n == len(local)
    assert metrics.keys() == {*want_metrics.keys(), "guard-accuracy"}
    assert metrics["accuracy"] == want_metrics["accuracy"]  # A_k: the probe's, on the share
    # the guard's reading: the RECEIVED twin's accuracy on the slice, by hand
    model = model_for(cfg, local.data.task, CPU, "truth")
    set_weights(model, start)
    slice_ = local.validation[::2]
    probs = predict_proba(model, local.x[torch.as_tensor(slice_)],
                          BatchTransform.of(local.spec, CPU), 1024)
    assert len(slice_) > 20 and metrics["guard-accuracy"] == pytest.approx(
        float(np.mean(probs.argmax(1) == local.labels[slice_])))


def test_where_the_guard_reads_the_coordinators_set_the_twin_trains_on_every_sample():
    """The clean set is read on the server (docs/FEDEFC.md §3.9): the twin needs no slice
    of its own and reports no reading; it is FedAvg's client update bit for bit."""
    (twinned, _, fedavg), cfg = clients(**{"clean-validation-per-class": 10})
    local = twinned.local
    start = get_weights(initial_model(cfg, local.data.task))
    config = {**round_config(cfg, 1, 3), "phase": 1}
    weights, _, metrics = twinned.fit(paired(start), config)
    twin = halves(weights)[0]
    assert "guard-accuracy" not in metrics and "accuracy" in metrics
    assert equal(twin, truth(cfg, local, start, int(config["seed"]), slice_out=False))


def trained_start(fedavg: MethodClient, cfg) -> list[np.ndarray]:
    """A global model a phase-1 round trained (a Q counted from it corrects something)."""
    start = get_weights(initial_model(cfg, fedavg.local.data.task))
    return fedavg.fit(start, round_config(cfg, 1, 1))[0]


@pytest.mark.parametrize("keys", [{}, VERIFIED], ids=["observed", "verified"])
def test_in_phase_2_the_twin_trains_all_but_its_slice_with_the_q_its_probe_counted(keys):
    """With verified labels (docs/FEDEFC.md §3.8) the samples trained on hold half the
    checked share with its true labels, which the probe keeps out of training and of
    Q's counts."""
    (twinned, plain, fedavg), cfg = clients(**keys)
    start = trained_start(fedavg, cfg)
    config = {**round_config(cfg, 1, 9), "phase": 2}
    counted = {}
    update = plain.local_update

    def keep_q(job):
        out = update(job)
        counted["q"] = job.last_q
        return out
    plain.local_update = keep_q
    want_probe, _, _ = plain.fit(start, config)
    weights, _, _ = twinned.fit(paired(start), config)
    twin, probe = halves(weights)
    assert equal(probe, want_probe)
    assert not np.allclose(counted["q"], np.eye(len(counted["q"])))  # a correction
    # the truth: the forward-corrected update of all but the slice, from the same seed
    local = twinned.local
    assert equal(twin, truth(cfg, local, start, int(config["seed"]), counted["q"]))
    assert len(local.validation) > 1  # ... which includes half the share
    if keys:  # ... whose labels are the true ones
        observed = partition_data(load_run_config({**SILO, **keys, "validation-labels":
                                                   "observed"}), 1, CPU).labels[local.validation]
        assert np.any(local.labels[local.validation] != observed)


def test_the_twin_leaves_the_nodes_state_as_the_probe_alone_does():
    """Pooled counts and the Q the guard reads next round are the probe's."""
    (twinned, plain, fedavg), cfg = clients()
    start = trained_start(fedavg, cfg)
    config = {**round_config(cfg, 1, 9), "phase": 2}
    twinned.fit(paired(start), config)
    plain.fit(start, config)
    k = twinned.local.data.task.num_classes
    for key in (POOLED_COUNTS, NOISE_MODEL):
        have, want = (load_vector(c.state, key, k * k) for c in (twinned, plain))
        assert want is not None and np.array_equal(have, want), key


class Evaluator:
    def __init__(self):
        self.seen = []

    def __call__(self, weights):
        self.seen.append(weights)
        return 0.0, 1.0


def test_the_server_evaluates_the_twin():
    cfg = load_run_config(SILO)
    twin, probe = [np.zeros(2)], [np.ones(2)]
    evaluator = Evaluator()
    step = RoundEvaluation(cfg, federation=None, evaluator=evaluator)
    step.central(ndarrays_to_parameters([*twin, *probe]))
    assert equal(evaluator.seen[0], twin)


@pytest.fixture(scope="module")
def twinned_run(tiny_mnist_dir, tmp_path_factory):
    """The small job with the held-out signal and a twin: its out-dir. Every client
    reports accuracy 0 in round 2 (an ``acc=0.0`` fault), which makes round 2 the
    prestopping point, so rounds 3.. run phase 2."""
    from fedefc_cli.simulation import run_simulation_job
    out = tmp_path_factory.mktemp("twin")
    run_simulation_job(small_job(tiny_mnist_dir, out, method='"fedefc"',
                                 **{"accuracy-signal": '"held-out"', "start-round": 0,
                                    "faults": '"acc=0.0@0-3@2"'}))
    return out


@pytest.mark.flower
def test_a_twinned_run_delivers_its_twin_read_on_its_guard_slices(twinned_run):
    """Through Flower: every round's record holds the guard's reading of the twin (the
    clients' guard slices), the summary says which model was delivered and on what
    signal, the server's test set read that model, and model.pt holds one model."""
    recs = records(twinned_run)
    assert [r["phase"] for r in recs[:4]] == [1, 1, 1, 2]
    assert all(0.0 <= r["guard_acc"] <= 1.0 for r in recs[1:])
    summary = json.loads((twinned_run / "summary.json").read_text())
    assert summary["twin_model"] == "on" and summary["t_e"] == 2
    assert summary["guard_signal"] == "the held-out accuracy on the twin's guard slices, through Q"
    after = summary["delivered_after_round"]
    assert summary["final_acc"] == pytest.approx(
        recs[-1]["test_acc"] if summary["guard_ended_at"] is not None
        else recs[after]["test_acc"])
    config = json.loads((twinned_run / "config.json").read_text())
    assert config["twin-model"] == "on"  # what ran, not "auto"
    assert checkpoint.load(twinned_run).config["twin-model"] == "on"
    saved = torch.load(twinned_run / "model.pt")
    cfg = load_run_config({**config, "out-dir": ""})
    want = initial_model(cfg, partition_data(cfg, 0, CPU).data.task).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in want.items()}


def test_round_evaluation_sends_the_nodes_the_twin():
    """Federated evaluation asks every node about the model the run delivers."""
    cfg = load_run_config({**SILO, "evaluation": "federated"})

    class Federation:
        registry = SimpleNamespace(declare=lambda pids, rnd: pids)

        def serving(self, manager, rnd):
            return {0: "node-0"}
    plan = RoundEvaluation(cfg, Federation()).plan(1, ndarrays_to_parameters(
        [np.zeros(2), np.ones(2)]), None)
    (_, ins), = plan.instructions
    assert equal(parameters_to_ndarrays(ins.parameters), [np.zeros(2)])


class PairNode(HeldOutNode):
    """A scripted node of tests/test_guard.py (its held-out accuracy by round) that adds
    its partition id to the twin's arrays and takes it from the probe's."""

    def fit(self, ins, timeout, group_id):
        res = super().fit(ins, timeout, group_id)  # + partition id to every array
        if "accuracy" in res.metrics:  # the twin's reading: the script's too
            res.metrics["guard-accuracy"] = res.metrics["accuracy"]
        twin, probe = halves(parameters_to_ndarrays(res.parameters))
        res.parameters = ndarrays_to_parameters(
            [*twin, *(w - 2 * self.partition_id for w in probe)])
        return res


def test_the_guards_verdict_restores_the_pair_and_the_run_delivers_its_twin(tmp_path):
    """The scripted run of tests/test_guard.py with a twin: the guard fires in round 9
    and restores the pair round 7 received; the server's test set read the twin in every
    round, and model.pt holds the twin of round 7."""
    cfg = load_run_config({**SILO, "rounds": 12, "start-round": 1, "gamma-thr": 2,
                           "out-dir": str(tmp_path)})
    assert cfg.twinned and cfg.guarded
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    init = get_weights(model)

    def evaluator(weights):  # one model: the twin; its "test accuracy" its bias's first entry
        assert len(weights) == len(init)
        return 1.0, float(weights[1][0])
    manager = SimpleClientManager()
    for pid, size in SIZES.items():
        manager.register(PairNode(f"node-{pid}", pid, size))
    loop = RoundLoop(client_manager=manager,
                     pipeline=make_pipeline(cfg, max_private=10**8, evaluator=evaluator),
                     parameters=ndarrays_to_parameters(paired(init)), cfg=cfg,
                     recorder=RunRecorder(tmp_path, cfg.to_flat()), model=model, run_info={})
    loop.set_max_workers(1)
    loop.fit(cfg.rounds, None)
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    recs = records(tmp_path)
    assert [r["A"] for r in recs[1:]] == [GUARDED[t] for t in range(1, 10)]
    for r in recs[:9]:  # round t's twin: t steps up (its probe went t steps down)
        assert r["test_acc"] == pytest.approx(init[1][0] + r["round"] * step)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["guard_restored_round"], summary["guard_ended_at"]) == (7, 9)
    assert summary["final_acc"] == pytest.approx(init[1][0] + 6 * step)
    saved = torch.load(tmp_path / "model.pt")
    np.testing.assert_allclose(saved["bias"].numpy(), init[1] + 6 * step, rtol=1e-6)
    kept = checkpoint.load(tmp_path).models["guard-best"]
    np.testing.assert_allclose(halves(kept)[1][1], init[1] - 6 * step, rtol=1e-6)
