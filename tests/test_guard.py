"""The phase-2 guard (docs/FEDEFC.md §3.4) and the short-run warning (§3.5).

The guard's rule on its own; the round loop with nodes whose held-out accuracy is
scripted, so every round it keeps, restores and ends in is known in advance; and the
project's real clients on real images with a phase 2 made to hurt (a transition matrix
that shifts every class to the next), which the guard must notice and undo.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

import fedefc_client.local_update as local_update
from common.methods import load_run_config, short_run_warning, shortest_useful_run
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from common.training import BatchTransform, predict_proba
from common.transition import cross_fitted_accuracy, estimate_transition
from common.twin import paired
from fedefc_cli import deploy_submit
from fedefc_cli.errors import UsageError
from fedefc_cli.main import main
from fedefc_client.client import MethodClient
from fedefc_client.job import LocalJob
from fedefc_client.local_data import partition_data
from fedefc_server import checkpoint, evaluation
from fedefc_server.checkpoint import CheckpointError
from fedefc_server.clean_set import attach_clean_set
from fedefc_server.guard import MARGIN, ModelGuard, Phase2Guard, delivery_rule, tells_apart
from fedefc_server.round_loop import RoundLoop
from fedefc_server.summary import run_report
from tests.helpers import IN_PROCESS_NODES, OK, FakeProxy, make_pipeline, records

CPU = torch.device("cpu")


# -- the rule ---------------------------------------------------------------------------------


def test_the_guard_keeps_the_best_model_and_fires_after_patience_phase_2_rounds():
    """Rounds up to start-round are not watched; phase-1 rounds may set the best but
    never count against it; a phase-2 model that does not beat the best counts, one that
    beats it becomes the best and clears the count; ``patience`` in a row fire it, once."""
    guard = Phase2Guard(start_round=2, patience=2)
    seen = [guard.observe(t, a, p2) for t, a, p2 in (
        (1, 0.9, False),   # before start-round: ignored
        (3, 0.5, False),   # the first watched round is the best
        (4, 0.4, False),   # phase 1, below: no count
        (5, 0.6, True),    # a phase-2 model beats it
        (6, 0.55, True),   # 1
        (7, 0.58, True),   # 2: below it, fired
        (8, 0.99, True),   # after firing: nothing
    )]
    assert seen == ["", "best", "", "best", "", "fired", ""]
    assert (guard.best_round, guard.best_a, guard.fired) == (5, 0.6, 7)


def test_a_signal_that_cannot_tell_does_not_choose():
    """A verdict is due, but the best reading leads the lowest by less than MARGIN
    standard errors of their difference (a tie, a set too small for its spread): no
    verdict ("unclear"), the count starts again and the run trains on; once the readings
    spread, the verdict restores the best."""
    se = 0.02  # each reading's: the difference's is 0.028
    guard = Phase2Guard(start_round=0, patience=2)
    seen = [guard.observe(t, a, p2, se=se) for t, a, p2 in (
        (1, 0.6, False),   # the best
        (2, 0.6, True), (3, 0.58, True),    # a tie, then 0.02 below: a flat signal
        (4, 0.59, True), (5, 0.55, True),   # 0.05 below the best, beyond 0.028: fired
    )]
    assert seen == ["best", "", "unclear", "", "fired"]
    assert (guard.unclear, guard.fired, guard.best_round) == ([3], 5, 1)
    assert guard.observe(6, 0.1, True, se=se) == ""  # nothing after the verdict


@pytest.mark.parametrize("last, se, restores", [
    (0.70, 0.01, False),   # the last model reads as well as the best: the later is kept
    (0.66, 0.01, True),    # below the best, the signal spread: the best replaces it
    (0.66, 0.05, False),   # 0.04 apart on an error of 0.071: a flat signal, the last stays
])
def test_the_end_of_the_run_is_a_verdict_too(last, se, restores):
    """A phase 2 shorter than gamma-thr is judged at the last round: the best model
    replaces the last where it reads higher and the signal tells its readings apart."""
    guard = Phase2Guard(start_round=0, patience=3)
    guard.observe(1, 0.70, False, se=se)
    guard.observe(2, last, True, se=se)
    assert guard.last_verdict(2, last) is restores
    assert guard.fired == (2 if restores else None)


def test_whatever_the_readings_the_delivered_model_reads_best_unless_the_signal_is_flat():
    """The property of the rule (docs/FEDEFC.md §3.4), on 300 random runs of random
    readings, patience and standard errors: the delivered model reads at least as well
    as every model the run had read when it was chosen (the model at T_e among them), a
    restore comes only from a signal whose readings spread beyond the margin, and a flat
    signal leaves the run its last model."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        rounds, t_e = int(rng.integers(4, 30)), int(rng.integers(1, 20))
        start = int(rng.integers(0, 3))
        guard = Phase2Guard(start_round=start, patience=int(rng.integers(1, 4)))
        se = float(rng.uniform(0.0, 0.1))
        readings = np.clip(rng.normal(0.6, 0.05, rounds + 1), 0, 1)
        delivered, seen = None, []
        for t in range(1, rounds + 1):
            verdict = guard.observe(t, readings[t], t - 1 > t_e, se=se)
            seen += [readings[t]] if t > start else []
            spread = max(seen, default=0) - min(seen, default=0)
            if verdict == "fired":
                assert spread > MARGIN * math.hypot(se, se)
                delivered = guard.best_a
                break
            if verdict == "unclear":
                assert spread <= MARGIN * math.hypot(se, se)
        if delivered is None:
            last = readings[rounds]
            delivered = guard.best_a if guard.last_verdict(rounds, last) else last
            if guard.flat():
                assert delivered == last
        if seen and not guard.flat():
            assert delivered >= max(seen)


# -- the round loop, scripted -----------------------------------------------------------------

# large enough that A(t)'s standard error (about a point) lets the guard tell the
# scripted differences (3-5 points) apart
SIZES = {0: 1000, 1: 2000, 2: 3000, 3: 4000}
# A(t) by round (start-round 1, gamma-thr 2): the best at round 2, patience 2 -> T_e = 4,
# phase 2 from round 5. A(5) measures round 4's (phase-1) model: no count; A(6) = 0.58:
# 1; A(7) = 0.65 beats 0.6: the model round 7 received (after round 6) is the best;
# A(8), A(9) below: 2 in a row, fired in round 9.
GUARDED = {1: 0.5, 2: 0.6, 3: 0.6, 4: 0.6, 5: 0.55, 6: 0.58, 7: 0.65, 8: 0.6, 9: 0.62,
           10: 0.9, 11: 0.9, 12: 0.9}


class HeldOutNode(FakeProxy):
    """Adds its partition id to every weight and reports the scripted held-out accuracy
    whenever the server sends a phase, as a client of a guarded run does."""

    script = GUARDED

    def fit(self, ins, timeout, group_id):
        weights = [w + self.partition_id for w in parameters_to_ndarrays(ins.parameters)]
        metrics = {"partition-id": self.partition_id, "loss": "cross-entropy"}
        if "phase" in ins.config:
            metrics["accuracy"] = self.script[int(ins.config["round"])]
        return FitRes(OK, ndarrays_to_parameters(weights), self.num_examples, metrics)


class RisingNode(HeldOutNode):
    """T_e = 4 as above; then every phase-2 model beats the last."""

    script = {**{t: GUARDED[t] for t in range(1, 6)}, **{t: 0.6 + 0.01 * t for t in range(6, 13)}}


def guarded_loop(tmp_path, node=HeldOutNode, rounds=12, stop=None, **keys):
    """The scripted loop of one model (``twin-model = "off"``; with a twin:
    tests/test_twin.py); ``stop``: the loop stops after that round, as an interrupted
    run does."""
    cfg = load_run_config({"num-clients": 4, "fraction": 1.0, "rounds": rounds,
                           "start-round": 1, "gamma-thr": 2, "out-dir": str(tmp_path),
                           "twin-model": "off", **keys})
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    init = get_weights(model)
    pipeline = make_pipeline(cfg, max_private=10**8,
                             evaluator=lambda weights: (1.0, float(weights[1][0])))
    manager = SimpleClientManager()
    for pid, size in SIZES.items():
        manager.register(node(f"node-{pid}", pid, size))
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(init), cfg=cfg,
                     recorder=RunRecorder(tmp_path, cfg.to_flat()), model=model,
                     run_info={})
    loop.set_max_workers(1)
    loop.fit(stop or rounds, None)
    return cfg, init


def test_the_guard_restores_the_best_model_and_ends_the_run(tmp_path, caplog):
    """Every round adds 2 (the size-weighted mean partition id) to the bias, whose first
    entry is the 'test accuracy': round 9 restores the model round 7 received, the
    initial one plus 6 rounds, and the run ends there, 3 rounds early."""
    cfg, init = guarded_loop(tmp_path)
    assert cfg.guarded
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == list(range(10))
    assert [r["t_e"] for r in recs][4:] == [4] * 6
    assert [r["A"] for r in recs[1:]] == [GUARDED[t] for t in range(1, 10)]
    assert [r["guard_best_round"] for r in recs[1:]] == [None, 2, 2, 2, 2, 2, 7, 7, 7]
    assert [r["guard_worse"] for r in recs[1:]] == [0, 0, 0, 0, 0, 1, 0, 1, 2]
    for r in recs[:9]:  # round t's model: t steps of FedAvg
        assert r["test_acc"] == pytest.approx(init[1][0] + r["round"] * step)
    restored = init[1][0] + 6 * step
    assert recs[9]["test_acc"] == pytest.approx(restored)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_acc"] == pytest.approx(restored)
    assert summary["phase_2_guard"] == "on"
    assert (summary["guard_restored_round"], summary["guard_ended_at"]) == (7, 9)
    assert "phase-2 guard restored that model" in summary["notes"][0]
    assert "after round 9 of 12" in summary["notes"][0]
    assert "PHASE-2 GUARD" in caplog.text
    saved = torch.load(tmp_path / "model.pt")
    np.testing.assert_allclose(saved["bias"].numpy(), init[1] + 6 * step, rtol=1e-6)
    ckpt = checkpoint.load(tmp_path)
    assert ckpt.round == 9 and ckpt.strategy["guard"]["fired"] == 9
    np.testing.assert_allclose(ckpt.models["guard-best"][1], init[1] + 6 * step, rtol=1e-6)
    with pytest.raises(CheckpointError, match="nothing remains to resume"):
        type(make_pipeline(cfg).server).check_checkpoint(ckpt.strategy, cfg)


class RescaledNode(HeldOutNode):
    """T_e = 4 as above; from round 5 the clients read A_k on a lower scale (the
    cross-fitted score of the model phase 1 made, then of phase 2's)."""

    script = {**{t: GUARDED[t] for t in range(1, 5)},
              5: 0.5, 6: 0.52, 7: 0.49, 8: 0.49, 9: 0.9, 10: 0.9, 11: 0.9, 12: 0.9}


@pytest.mark.parametrize("keys, best, ended", [
    ({}, [2, 2, 2, 2, 2, 2], 7),
    ({"guard-score": "cross-fit"}, [2, 2, 2, 5, 6, 6, 6], 8),
    ({"validation-phase-2": "guard-slice"}, [2, 2, 2, 5, 6, 6, 6], 8)])
def test_a_rescaled_guard_judges_phase_2_against_the_model_phase_1_made(tmp_path, keys,
                                                                        best, ended):
    """The same A(t) to round 4 (T_e), then lower: read on one scale (prior-q on the
    whole share) no phase-2 model reaches phase 1's best and the guard restores round 2's
    model after gamma-thr = 2 rounds; with ``guard-score = "cross-fit"`` (another score)
    or ``validation-phase-2 = "guard-slice"`` (other samples: half the share) round 5's
    A(t) starts the new scale, round 6's phase-2 model beats it, and the guard restores
    that one."""
    guarded_loop(tmp_path, node=RescaledNode, **keys)
    recs = records(tmp_path)
    assert [r["guard_best_round"] for r in recs[2:]] == best
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["t_e"] == 4
    assert (summary["guard_restored_round"], summary["guard_ended_at"]) == (best[-1], ended)


@pytest.mark.parametrize("phase", [1, 2])
def test_a_cross_fit_client_scores_its_share_through_the_other_halfs_q(phase):
    """A client of a run with ``guard-score = "cross-fit"``: in phase 2 its A_k is the
    cross-fitted score of the received model's predictions on its share, whatever Q it
    trained with (here one that would turn every prediction wrong); in phase 1 the
    plain accuracy on the share, as without it."""
    cfg = load_run_config({"num-clients": 4, "fraction": 1.0, "guard-score": "cross-fit"})
    local = partition_data(cfg, 0, CPU)
    job = LocalJob(cfg, local, initial_model(cfg, local.data.task), phase, 8, 8)
    probs = np.random.default_rng(1).dirichlet(np.ones(10), len(local.labels))
    job._probs = probs
    job.prior_q = np.roll(np.eye(10), 1, axis=0)
    share = local.validation
    expected = (cross_fitted_accuracy(probs[share], local.labels[share]) if phase == 2
                else np.mean(probs[share].argmax(1) == local.labels[share]))
    assert len(share) > 20 and job.validation_accuracy() == pytest.approx(expected)


# guard-fallback = "train": the guard falls back in round 9 as above (restoring the
# model round 7 received); round 10 measures that model again (not counted), round 11's
# model (cross-entropy from it) is the new best, rounds 12 and 13 miss: the run ends
# after round 13 with the model round 11 received.
FALLBACK = {**{t: GUARDED[t] for t in range(1, 10)}, 10: 0.62, 11: 0.7, 12: 0.6, 13: 0.6,
            14: 0.9, 15: 0.9, 16: 0.9}


class FallbackNode(HeldOutNode):
    """Scripted as :data:`FALLBACK`; records the phase each round sent it."""

    script = FALLBACK
    phases: dict[int, int] = {}

    def fit(self, ins, timeout, group_id):
        FallbackNode.phases[int(ins.config["round"])] = int(ins.config["phase"])
        return super().fit(ins, timeout, group_id)


def test_the_fallback_trains_on_with_cross_entropy_from_the_restored_model(tmp_path):
    cfg, init = guarded_loop(tmp_path, node=FallbackNode, rounds=16, **{
        "validation-labels": "verified", "guard-fallback": "train"})
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == list(range(14))
    assert [FallbackNode.phases[t] for t in range(1, 14)] == [1] * 4 + [2] * 5 + [1] * 4
    assert [r["phase"] for r in recs[1:]] == [1] * 4 + [2] * 5 + [1] * 4
    assert recs[9]["test_acc"] == pytest.approx(init[1][0] + 6 * step)  # restored in 9
    assert recs[10]["test_acc"] == pytest.approx(init[1][0] + 7 * step)  # then trained on
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["guard_fell_back_at"], summary["guard_restored_round"],
            summary["guard_ended_at"]) == (9, 11, 13)
    assert summary["final_acc"] == pytest.approx(init[1][0] + 7 * step)  # round 11's
    assert "went on with cross-entropy" in summary["notes"][0]
    assert "cross-entropy after the fallback did not beat" in summary["notes"][1]
    assert "after round 13 of 16" in summary["notes"][1]


@pytest.mark.parametrize("phase", [1, 2])
def test_a_guard_slice_client_reads_half_its_share_and_trains_on_the_rest(phase):
    """``validation-phase-2 = "guard-slice"``: in phase 1 the whole share is held out and
    A_k read on it; in phase 2 only its guard slice (every second position) is, A_k is
    read on the slice (through the Q the client trained with), the client trains on
    every other sample, and Q is counted on the slice (predictions out of sample)."""
    cfg = load_run_config({"num-clients": 4, "fraction": 1.0, "q-pooling": "none",
                           "q-estimator": "counted", "validation-phase-2": "guard-slice"})
    local = partition_data(cfg, 0, CPU)
    share = local.validation
    probs = np.random.default_rng(1).dirichlet(np.ones(10), len(local.labels))
    job = LocalJob(cfg, local, initial_model(cfg, local.data.task), phase, 8, 8)
    job._probs = probs
    job.prior_q = np.roll(np.eye(10), 1, axis=0)
    read = share if phase == 1 else share[::2]
    through = probs if phase == 1 else probs @ job.prior_q.T
    expected = np.mean(through[read].argmax(1) == local.labels[read])
    assert len(read) > 20 and job.validation_accuracy() == pytest.approx(expected)
    held = np.zeros(len(local), dtype=bool)
    held[read] = True
    trained = job.training_set()
    assert torch.equal(trained.x, local.x[torch.as_tensor(np.flatnonzero(~held))])
    if phase == 2:
        np.testing.assert_array_equal(job.estimation_positions(), read)
        job._probs = None  # the update reads the received model's own predictions
        local_update.fedefc(job)
        model_probs = predict_proba(initial_model(cfg, local.data.task), local.x,
                                    BatchTransform.of(local.spec, CPU))
        np.testing.assert_allclose(job.last_q, estimate_transition(
            model_probs[read], local.labels[read]), atol=1e-6)


def test_a_guard_slice_needs_the_guard_and_observed_labels():
    """The slice is kept out of training only for the guard: refused where no guard reads
    it, and beside verified labels (whose share never joins training)."""
    with pytest.raises(ValueError, match="guard off") as err:
        load_run_config({"validation-phase-2": "guard-slice", "num-clients": 4,
                         "fraction": 1.0, "phase-2-guard": "off"})
    assert 'set validation-phase-2="estimate"' in str(err.value)
    with pytest.raises(ValueError, match="verified share must stay out") as err:
        load_run_config({"validation-phase-2": "guard-slice", "num-clients": 4,
                         "fraction": 1.0, "validation-labels": "verified",
                         "validation-max-per-class": 5})
    assert "'guard-slice'" in str(err.value)
    assert load_run_config({"validation-phase-2": "guard-slice", "num-clients": 4,
                            "fraction": 1.0}).guarded


def test_a_cross_fit_guard_needs_the_guard_reading_observed_labels():
    for keys, state in (({}, "the guard is off"),
                        ({"num-clients": 4, "fraction": 1.0, "validation-labels": "verified",
                          "validation-max-per-class": 5}, "validation-labels='verified'")):
        with pytest.raises(ValueError, match=state) as err:
            load_run_config({"guard-score": "cross-fit", **keys})
        assert 'set guard-score="prior-q"' in str(err.value)
    assert load_run_config({"guard-score": "cross-fit", "num-clients": 4,
                            "fraction": 1.0}).guarded


def test_the_fallback_needs_the_guard_reading_verified_labels():
    for keys in ({"num-clients": 5, "fraction": 1.0},
                 {"num-clients": 5, "fraction": 1.0, "validation-labels": "verified",
                  "phase-2-guard": "off"}):
        with pytest.raises(ValueError, match="guard-fallback=\"train\" needs the phase-2 "
                                             "guard reading checked labels"):
            load_run_config({**keys, "guard-fallback": "train"})


def test_a_guarded_run_resumes_with_the_model_its_guard_kept(tmp_path):
    """Interrupted after round 8 (the kept model is round 7's received one), resumed from
    the checkpoint: the guard fires in round 9 and restores the very model it kept."""
    guarded_loop(tmp_path / "whole")
    guarded_loop(tmp_path / "part", stop=8)
    ckpt = checkpoint.load(tmp_path / "part")
    assert ckpt.strategy["guard"]["best_round"] == 7 and "guard-best" in ckpt.models
    cfg = load_run_config({"num-clients": 4, "fraction": 1.0, "rounds": 12,
                           "start-round": 1, "gamma-thr": 2, "out-dir": str(tmp_path / "part"),
                           "twin-model": "off"})
    pipeline = make_pipeline(cfg, max_private=10**8,
                             evaluator=lambda weights: (1.0, float(weights[1][0])))
    pipeline.load_state(ckpt.strategy)
    pipeline.server.load_models(ckpt.models)
    manager = SimpleClientManager()
    for pid, size in SIZES.items():
        manager.register(HeldOutNode(f"node-{pid}", pid, size))
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(ckpt.weights), cfg=cfg,
                     recorder=RunRecorder(tmp_path / "part", cfg.to_flat(), resume_round=8),
                     model=torch.nn.Linear(2, 3), run_info={}, first_round=9)
    loop.set_max_workers(1)
    loop.fit(12, None)
    whole, part = (json.loads((tmp_path / d / "summary.json").read_text())
                   for d in ("whole", "part"))
    assert part["final_acc"] == whole["final_acc"] and part["guard_ended_at"] == 9
    with pytest.raises(CheckpointError, match="holds no 'guard-best' model"):
        pipeline.server.load_models({})


def test_a_phase_2_that_keeps_improving_runs_to_the_end(tmp_path):
    guarded_loop(tmp_path, node=RisingNode)
    recs = records(tmp_path)
    assert len(recs) == 13 and recs[-1]["guard_worse"] == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["t_e"] == 4 and summary["guard_ended_at"] is None and summary["notes"] == []


def test_without_the_guard_phase_2_sends_no_accuracy_and_runs_to_the_end(tmp_path):
    """``phase-2-guard = "off"``: the paper's protocol, phase-2 replies carry no A_k."""
    cfg, _ = guarded_loop(tmp_path, **{"phase-2-guard": "off"})
    assert not cfg.guarded
    recs = records(tmp_path)
    assert len(recs) == 13 and all(r.get("A") is None for r in recs[5:])
    assert json.loads((tmp_path / "summary.json").read_text())["phase_2_guard"] == "off"


@pytest.mark.parametrize("keys, guard", [
    ({"num-clients": 5, "fraction": 1.0}, "on"),       # every client, every round: held-out
    ({}, "off"),                                        # 10 of 20: the paper's signal
    ({"num-clients": 100, "fraction": 0.1}, "off"),     # the paper's settings
    ({"num-clients": 5, "fraction": 1.0, "accuracy-signal": "global"}, "off"),
    ({"num-clients": 5, "fraction": 1.0, "phase-2-guard": "off"}, "off"),
    ({"accuracy-signal": "held-out"}, "on"),            # a share, so a guard
])
def test_the_guard_watches_exactly_the_runs_with_a_validation_share(keys, guard):
    assert load_run_config(keys).phase_2_guard_mode == guard


def test_the_guard_needs_the_held_out_signal():
    with pytest.raises(ValueError, match="phase-2-guard=\"on\" with accuracy-signal='global'"):
        load_run_config({"phase-2-guard": "on", "accuracy-signal": "global"})


# -- real clients, a phase 2 made to hurt -----------------------------------------------------


class ClientNode(FakeProxy):
    """A node whose replies come from the project's MethodClient (in this process)."""

    def __init__(self, cid, partition_id, cfg):
        self.cfg = cfg
        self.state = RecordDict()
        local = partition_data(cfg, partition_id, CPU)
        super().__init__(cid, partition_id, len(local))

    def fit(self, ins, timeout, group_id):
        client = MethodClient(self.cfg, self.partition_id,
                              lambda: partition_data(self.cfg, self.partition_id, CPU),
                              self.state)
        with IN_PROCESS_NODES:
            weights, n, metrics = client.fit(parameters_to_ndarrays(ins.parameters),
                                             ins.config)
        return FitRes(OK, ndarrays_to_parameters(weights), n, metrics)


def hurt_run(tmp_path, monkeypatch, transition, **keys):
    """Three clients of the embedded MNIST, every one every round, whose phase-2 Q is
    ``transition(counts, labels, weighting)``; (records, summary) of the run."""
    monkeypatch.setattr(local_update, "transition_from_counts", transition)
    cfg = load_run_config({"num-clients": 3, "fraction": 1.0, "rounds": 14,
                           "start-round": 2, "gamma-thr": 2, "local-epochs": 1,
                           "q-estimator": "counted", "client-threads": 1,
                           "prestopping-min-gain": 3, "out-dir": str(tmp_path), **keys})
    data = partition_data(cfg, 0, CPU).data
    model = initial_model(cfg, data.task)
    pipeline = make_pipeline(cfg, max_private=10**6,
                             evaluator=evaluation.TestSetEvaluator(cfg, data))
    attach_clean_set(pipeline.server, cfg, simulation=True)  # where the keys ask for one
    manager = SimpleClientManager()
    for pid in range(3):
        manager.register(ClientNode(f"node-{pid}", pid, cfg))
    init = get_weights(model)  # with the twin (the default here): the pair, twin first
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(paired(init) if cfg.twinned else init),
                     cfg=cfg, recorder=RunRecorder(tmp_path, cfg.to_flat()), model=model,
                     run_info={})
    loop.set_max_workers(1)
    loop.fit(cfg.rounds, None)
    return records(tmp_path), json.loads((tmp_path / "summary.json").read_text())


def test_a_phase_2_made_to_hurt_is_undone(tmp_path, monkeypatch):
    """In phase 2 each client's Q is a new permutation of the classes every round (an
    estimator that keeps changing its mind), so the forward-corrected loss drags the
    model from one relabelling to the next: its test accuracy collapses, so does the
    held-out accuracy the clients report (through the Q they trained with), and the
    guard restores the best model it kept, the test accuracy of that model's round. A
    minimum gain of 3 standard errors (about 4 points here) fixes T_e once the large
    rises are over: with the strict rule A(t) creeps up by tenths of a point for rounds,
    and whether T_e comes in time is then decided by the last bits of the machine's
    float sums."""
    k = 10

    def changing_its_mind(counts, labels, weighting):
        """Each call a new derangement: true j is observed as sigma(j) != j."""
        rng = np.random.default_rng(int(counts.sum()))
        while True:
            sigma = rng.permutation(k)
            if not np.any(sigma == np.arange(k)):
                return np.eye(k)[sigma].T  # Q[sigma(j), j] = 1

    recs, summary = hurt_run(tmp_path, monkeypatch, changing_its_mind)
    t_e, best, end = summary["t_e"], summary["guard_restored_round"], summary["guard_ended_at"]
    assert t_e is not None and end == t_e + 1 + 2  # two phase-2 models judged (gamma-thr 2)
    assert recs[-1]["round"] == end < 14
    phase_2 = [r for r in recs if r["phase"] == 2 and r["round"] < end]
    assert all(r["client_loss"] == ["forward-corrected"] * 3 for r in phase_2)
    assert max(r["test_acc"] for r in phase_2) < recs[best - 1]["test_acc"] - 0.2  # it hurt
    assert summary["final_acc"] == pytest.approx(recs[best - 1]["test_acc"])  # undone
    assert recs[best - 1]["test_acc"] > 0.6


@pytest.mark.parametrize("labels", ["observed", "verified", "coordinator's"])
def test_a_consistent_relabelling_is_seen_only_through_verified_labels(tmp_path, monkeypatch,
                                                                        labels):
    """The failure no signal on noisy labels can see (docs/FEDEFC.md §3.4, §3.7): every
    phase-2 Q is the same derangement (true j observed as j + 1), so the corrected loss
    teaches the model to predict j - 1 for an observed j. The test accuracy collapses;
    through that Q the model predicts the observed labels about as well as before, so
    the A(t) the guard reads on observed labels stays level with phase 1's best (whether
    a relabelled model then beats it by a sample, and is kept, or ties it is the last
    bits of the machine's float sums), while on a share of verified labels (5 per class
    and client) A(t) falls with the test accuracy and the guard restores the best
    phase-1 model; so does the accuracy on the coordinator's clean set (10 per class,
    docs/FEDEFC.md §3.9), which the guard then reads instead of A(t)."""
    def shifted(counts, labels, weighting):
        return np.roll(np.eye(counts.shape[0]), 1, axis=0)  # Q[(j + 1) % K, j] = 1

    clean = {"clean-validation-per-class": 10} if labels == "coordinator's" else {
        "validation-labels": labels}
    recs, summary = hurt_run(tmp_path, monkeypatch, shifted, **{
        **clean, "validation-max-per-class": 5, "local-epochs": 4})
    t_e = summary["t_e"]
    assert t_e is not None
    best_phase_1 = max(r["test_acc"] for r in recs if r["phase"] == 1)
    hurt = [r["test_acc"] for r in recs if r["phase"] == 2 and t_e + 1 < r["round"]
            and r["round"] != summary["guard_ended_at"]]
    assert max(hurt) < best_phase_1 - 0.3  # the relabelling hurt
    # A(t) of round t reads the model round t - 1 made: from T_e + 2 on a relabelled one
    best_a = max(r["A"] for r in recs if r["phase"] == 1 and r["round"] > 0)
    relabelled_a = [r["A"] for r in recs if r["round"] >= t_e + 2]
    if labels == "coordinator's":  # A(t) is blind, the clean set the guard reads is not
        best_a = max(r["guard_acc"] for r in recs if r["phase"] == 1 and "guard_acc" in r)
        relabelled_a = [r["guard_acc"] for r in recs if r["round"] >= t_e + 2]
        assert summary["guard_signal"].startswith("the coordinator's clean validation set")
    if labels == "observed":
        assert max(relabelled_a) > best_a - 0.1  # blind to the collapse
    else:
        assert max(relabelled_a) < best_a - 0.3  # the verified share (clean set) sees it
        assert summary["guard_ended_at"] == t_e + 1 + 2 < 14
        assert summary["final_acc"] == pytest.approx(
            recs[summary["guard_restored_round"] - 1]["test_acc"])
        # the phase-1 model of the best reading (of a tie the earlier), far above the
        # relabelled ones
        restored = recs[summary["guard_restored_round"]]
        assert restored["round"] - 1 <= t_e
        if labels == "coordinator's":
            assert restored["guard_acc"] == pytest.approx(best_a)
        else:  # the guard reads the twin's verified slice, the model the run delivers
            phase_1 = [r["guard_acc"] for r in recs if 2 < r["round"] <= t_e + 1]
            assert restored["guard_acc"] == pytest.approx(max(phase_1))
        assert summary["final_acc"] > max(hurt) + 0.3


# -- runs too short for a phase 2 (docs/FEDEFC.md §3.5) ---------------------------------------


@pytest.mark.parametrize("keys, least, too_few", [
    ({"rounds": 7, "start-round": 2, "gamma-thr": 2}, 10, True),
    ({"rounds": 8, "start-round": 2, "gamma-thr": 2}, 10, False),
    ({"rounds": 12, "start-round": 5, "gamma-thr": 3}, 16, True),
    ({"rounds": 15, "start-round": 5, "gamma-thr": 3}, 16, False),
    ({"rounds": 16, "start-round": 5, "gamma-thr": 3}, None, False),
    ({"rounds": 8, "start-round": 2, "gamma-thr": 2, "method": "fedavg"}, None, False),
    ({"rounds": 8, "start-round": 2, "gamma-thr": 2, "prestopping": False}, None, False),
    ({"rounds": 7, "start-round": 2, "gamma-thr": 2, "method": "confident-learning"}, 10,
     True),
])
def test_a_run_too_short_for_its_phase_2_is_told_with_the_rounds_it_needs(keys, least,
                                                                          too_few):
    """Below start-round + 2 gamma-thr + 2 rounds even the earliest T_e leaves fewer than
    gamma-thr + 1 phase-2 rounds: "too few"; from there to the shortest useful run, the
    run has a phase 2 only if A(t) stops rising at once, and is told so."""
    cfg = load_run_config(keys)
    warning = short_run_warning(cfg)
    if least is None:
        assert warning is None
        return
    earliest = cfg.start_round + cfg.gamma_thr + 1
    assert shortest_useful_run(cfg) == least
    assert f"rounds >= {least}" in warning and f"rounds={cfg.rounds}" in warning
    assert f"round {earliest} at the earliest" in warning
    assert ("is too few" in warning) == too_few
    assert (cfg.rounds < earliest + cfg.gamma_thr + 1) == too_few
    assert (f"phase 2 then from round {earliest + 1}" in warning) != too_few


def test_the_deployment_quick_starts_settings_are_told_the_t_e_its_docs_promise():
    """Issue 49: DEPLOYMENT.md's quick start (rounds=5 start-round=1 gamma-thr=1)
    promises `PRESTOPPING POINT T_e = 3` and phase 2 in rounds 4-5, and the warning
    said the run was "too few for phase 2" and would never leave phase 1. Its settings
    and its promise, read from the doc, now agree with the warning."""
    doc = (Path(__file__).parents[1] / "docs" / "DEPLOYMENT.md").read_text()
    block = doc[doc.index("## Quick start on one machine"):]
    block = block[:block.index("kill $(jobs -p)")]
    keys = dict(re.findall(r"--set ([a-z-]+)=(\S+)", block))
    cfg = load_run_config({k: keys[k] for k in ("num-clients", "fraction", "rounds",
                                                "start-round", "gamma-thr")})
    [promised] = {int(t) for t in re.findall(r"PRESTOPPING POINT T_e = (\d+)", doc[
        doc.index("## Quick start on one machine"):doc.index("kill $(jobs -p)") + 3000])}
    warning = short_run_warning(cfg)
    assert "too few" not in warning
    assert f"round {promised} at the earliest" in warning
    assert f"phase 2 then from round {promised + 1}" in warning and promised < cfg.rounds


def test_the_defaults_and_the_paper_presets_are_long_enough():
    from fedefc_cli.run_configs import resolve_run_config
    for preset in (None, "mnist", "cifar10", "cifar100", "cross-silo"):
        flat = resolve_run_config(preset, ["data-dir=/data"] if preset in (
            "mnist", "cifar10", "cifar100") else [], "")
        assert short_run_warning(load_run_config(flat)) is None, preset


def test_fedefc_run_and_submit_say_it_before_anything_starts(tmp_path, capsys, monkeypatch):
    """``fedefc run`` prints the warning before its preflight (which fails here on a model
    that does not import); ``fedefc deploy submit`` before it contacts the SuperLink."""
    short = ["--set", "rounds=7", "--set", "start-round=2", "--set", "gamma-thr=2"]
    assert main(["run", *short, "--set", "model=no_such_module:net",
                 "--out-dir", str(tmp_path / "run")]) != 0
    assert "WARNING: rounds=7 is too few" in capsys.readouterr().out

    def unreachable(*args, **kwargs):
        raise UsageError("no SuperLink here")

    monkeypatch.setattr(deploy_submit, "wait_for_superlink", unreachable)
    assert main(["deploy", "submit", "nowhere", *short,
                 "--set", f"out-dir={tmp_path / 'srv'}"]) != 0
    assert "WARNING: rounds=7 is too few" in capsys.readouterr().err


@pytest.mark.parametrize("keys, words", [
    ({}, "the last round's model (no guard signal)"),           # cross-device: the paper's
    ({"num-clients": 4, "fraction": 1.0},
     "the model that reads best on the held-out accuracy on the twin's guard slices, "
     "through Q"),
    ({"num-clients": 4, "fraction": 1.0, "twin-model": "off"},
     "the model that reads best on the held-out accuracy on the clients' shares, through Q"),
    ({"num-clients": 4, "fraction": 1.0, "validation-labels": "verified"},
     "the model that reads best on the verified labels of the twin's guard slices"),
    ({"num-clients": 4, "fraction": 1.0, "clean-validation-per-class": 10},
     "the model that reads best on the coordinator's clean set "
     "(clean-validation-per-class=10)"),
    ({"num-clients": 4, "fraction": 1.0, "method": "fedavg",
      "clean-validation-per-class": 10, "deliver": "best-read"},
     "the model that reads best on the coordinator's clean set"),
])
def test_the_header_says_which_model_the_run_delivers_and_on_what_signal(keys, words):
    assert delivery_rule(load_run_config(keys)).startswith(words)


def test_the_closing_lines_say_which_model_was_delivered_its_reading_and_why():
    summary = {"status": "completed", "rounds": 30, "rounds_run": 30, "t_e": 12,
               "A_max": 0.8, "phase_2_guard": "on", "delivered_after_round": 11,
               "delivered_reading": 0.8123, "guard_signal": "the coordinator's set",
               "delivered_why": "the best model read (round 12 received it): at the end "
                                "of the run it read above the last model"}
    lines = run_report(summary)
    assert ("  delivered: the model after round 11, reading 0.8123 on the coordinator's "
            "set; the best model read (round 12 received it): at the end of the run it "
            "read above the last model") in lines
    assert not any("delivered" in line for line in run_report({"status": "completed"}))


def test_a_rounds_log_line_names_the_guards_best_only_once_it_keeps_one():
    """Before start-round the guard reads but keeps no model: its log line gives the
    reading alone, never a best of -1 from round None."""
    guard = ModelGuard(Phase2Guard(6, 3), "held-out")
    assert guard.describe({"guard_acc": 0.5648, "guard_best_round": None}) == \
        " | guard reads 0.5648"
    guard.rule.best_a = 0.61
    assert guard.describe({"guard_acc": 0.6, "guard_best_round": 7, "guard_worse": 1}) == \
        " | guard reads 0.6000  best 0.6100 (round 7)  not beaten 1/3"
    assert guard.describe({}) == ""


def test_on_the_same_samples_the_paired_error_tells_what_independent_errors_cannot():
    """Two models read on one clean set of 100 samples, 0.75 and 0.69: as independent
    readings their difference (6 points) is inside one standard error (6.3); but they
    disagree on only 6 samples, all in the first's favour, and the paired error of the
    difference (2.4 points) tells them apart. Models that disagree on as many samples
    each way are never told apart, whatever the errors."""
    first = np.zeros(100, dtype=bool)
    first[:75] = True
    second = first.copy()
    second[:6] = False  # the second gets 6 of the first's right samples wrong
    a, b = first.mean(), second.mean()
    se_a, se_b = (math.sqrt(p * (1 - p) / 100) for p in (a, b))
    assert not tells_apart(a, se_a, b, se_b)
    assert tells_apart(a, se_a, b, se_b, first, second)
    swapped = first.copy()
    swapped[:3], swapped[75:78] = False, True  # 3 each way: the same accuracy
    assert not tells_apart(a, se_a, swapped.mean(), se_a, first, swapped)
