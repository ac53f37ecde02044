"""The coordinator's clean validation set (docs/FEDEFC.md §3.9): the draw a simulation
makes from the clients' samples, the file a coordinator gives and every refusal, the
accuracy the server reads on it (against a recomputation by hand), and the phase-2 guard
of a scripted round loop that follows it where the clients' A(t) says otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.common import ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager

from common.config import ConfigError
from common.data_files import DatasetError
from common.data_plan import build_data_plan, data_plan
from common.datasets import load_dataset
from common.methods import load_run_config
from common.params import get_weights
from common.results import RunRecorder
from common.runtime import initial_model
from fedefc_server.clean_set import CleanSet, attach_clean_set, load_clean_set, shared_samples
from fedefc_server.evaluation import TestSetEvaluator as Evaluator
from fedefc_server.method_server import Aggregated, MethodServer
from fedefc_server.round_loop import RoundLoop
from tests.helpers import make_pipeline, records
from tests.test_guard import GUARDED, SIZES, RisingNode

SILO = {"num-clients": 5, "fraction": 1.0}


def write_digits(path, x, y):
    np.savez(path, images=x, labels=y)
    return str(path)


@pytest.fixture(scope="module")
def digit_files(tmp_path_factory):
    """Train, test and clean files of 8 x 8 uint8 'images', K = 4: {name: path}, and the
    arrays."""
    base = tmp_path_factory.mktemp("clean-set")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(200, 8, 8), dtype=np.uint8)
    y = np.arange(200) % 4
    files = {"train": write_digits(base / "train.npz", x[:120], y[:120]),
             "test": write_digits(base / "test.npz", x[120:160], y[120:160]),
             "clean": write_digits(base / "clean.npz", x[160:], y[160:])}
    return files, x, y, base


def own(files, **keys):
    return load_run_config({**SILO, "num-clients": 4, "dataset": "npz",
                            "data-path": files["train"], "test-path": files["test"],
                            "zeta": 0.5, **keys})


# -- the draw of a simulation -----------------------------------------------------------------


def test_the_draw_takes_n_true_samples_per_class_from_the_clients_and_nothing_else():
    """10 per TRUE class, seeded, none of them left to any client; every other sample
    stays with its client and keeps its observed label, as in the run without the set."""
    cfg = load_run_config({**SILO, "clean-validation-per-class": 10})
    base = load_run_config(SILO)
    data = load_dataset(cfg)
    drawn, plain = build_data_plan(data, cfg), build_data_plan(data, base)
    chosen = drawn.coordinator_indices
    assert np.bincount(drawn.true_labels[chosen], minlength=10).tolist() == [10] * 10
    assert np.any(drawn.noisy_labels[chosen] != drawn.true_labels[chosen])  # noise was there
    np.testing.assert_array_equal(drawn.noisy_labels, plain.noisy_labels)
    for mine, theirs in zip(drawn.client_indices, plain.client_indices):
        assert not np.isin(mine, chosen).any()
        np.testing.assert_array_equal(mine, np.setdiff1d(theirs, chosen))
    assert sum(map(len, drawn.client_indices)) + 100 == sum(map(len, plain.client_indices))
    again = build_data_plan(data, cfg).coordinator_indices
    other = build_data_plan(data, load_run_config({**SILO, "seed": 1,
                                                   "clean-validation-per-class": 10}))
    np.testing.assert_array_equal(again, chosen)
    assert not np.array_equal(other.coordinator_indices, chosen)
    assert cfg.data_key() != base.data_key()  # the clients' data differ: another plan


def test_the_server_reads_the_drawn_samples_with_their_true_labels():
    cfg = load_run_config({**SILO, "clean-validation-per-class": 3})
    clean, data = load_clean_set(cfg, simulation=True)
    plan = data_plan(cfg)
    idx = plan.coordinator_indices
    assert torch.equal(clean.x, data.train_x[torch.as_tensor(idx)])
    np.testing.assert_array_equal(clean.y.numpy(), plan.true_labels[idx])
    assert "30 samples" in clean.summary


def test_a_draw_that_would_take_half_a_class_is_refused(digit_files):
    """The file holds 30 samples per class: 16 would leave the clients fewer."""
    files, *_ = digit_files
    cfg = own(files, **{"clean-validation-per-class": 16})
    with pytest.raises(DatasetError, match="clients hold 30 samples of class 0.*at most 15"):
        load_clean_set(cfg, simulation=True)
    assert len(load_clean_set(own(files, **{"clean-validation-per-class": 15}),
                              simulation=True)[0].y) == 60


def test_a_deployment_cannot_draw_from_a_training_pool():
    cfg = load_run_config({**SILO, "clean-validation-per-class": 10})
    with pytest.raises(ConfigError, match="in a deployment each node holds its own data: "
                                          "give clean-validation-path"):
        load_clean_set(cfg, simulation=False)


# -- a coordinator's file ---------------------------------------------------------------------


def test_a_file_of_checked_samples_is_read_as_given(digit_files):
    files, x, y, _ = digit_files
    clean, data = load_clean_set(own(files, **{"clean-validation-path": files["clean"]}),
                                 simulation=False)
    np.testing.assert_array_equal(clean.x.numpy()[:, 0], x[160:])
    np.testing.assert_array_equal(clean.y.numpy(), y[160:])
    assert files["clean"] in clean.summary and data.num_classes == 4


@pytest.mark.parametrize("make, match", [
    (lambda f, x, y, base: f["test"], "is the same file as test-path"),
    (lambda f, x, y, base: str(base / "sub" / ".." / "test.npz"), "the same file as test-path"),
    (lambda f, x, y, base: write_digits(base / "copy.npz", x[120:160][::-1], y[120:160][::-1]),
     "shares 40 of its 40 samples with test-path"),
    (lambda f, x, y, base: write_digits(base / "less.npz", x[121:160], y[121:160]),
     "shares 39 of its 39 samples with test-path"),
    (lambda f, x, y, base: write_digits(base / "half.npz", np.concatenate(
        [x[120:140], x[160:]]), np.concatenate([y[120:140], y[160:]])),
     r"shares 20 of its \d+ samples with test-path \(its sample 0 first"),
    (lambda f, x, y, base: write_digits(base / "relabel.npz", np.concatenate(
        [x[160:], x[125:126]]), np.concatenate([y[160:], (y[125:126] + 1) % 4])),
     r"shares 1 of its \d+ samples with test-path"),
    (lambda f, x, y, base: write_digits(base / "train-copy.npz", x[:120], y[:120]),
     "shares 120 of its 120 samples with data-path"),
    (lambda f, x, y, base: write_digits(base / "train-less.npz", x[1:120], y[1:120]),
     "shares 119 of its 119 samples with data-path"),
    (lambda f, x, y, base: f["train"], "the same file as data-path"),
    (lambda f, x, y, base: write_digits(base / "k5.npz", x[160:], y[160:] + 1),
     r"labels 1..4 are not all among the run's 4 classes"),
    (lambda f, x, y, base: write_digits(base / "wide.npz", np.zeros((5, 9, 8), np.uint8),
                                        np.zeros(5, int)), "1x9x8"),
])
def test_a_file_that_is_not_a_clean_set_of_this_run_is_refused(digit_files, make, match):
    """The test set (by path, by another path to it, or any of its samples in another
    file, order and label: the whole, less one, half of it beside checked samples, one
    sample relabelled; issue 58: all but the whole went through), the clients' training
    data (whole or less one), a label outside K, another shape."""
    files, x, y, base = digit_files
    (base / "sub").mkdir(exist_ok=True)
    path = make(files, x, y, base)
    with pytest.raises((ConfigError, DatasetError), match=match):
        load_clean_set(own(files, **{"clean-validation-path": path}), simulation=False)


def test_a_shared_sample_is_found_by_its_input_in_any_order_label_or_dtype():
    x = np.random.default_rng(1).integers(0, 256, size=(20, 3), dtype=np.uint8)
    other = np.random.default_rng(2).integers(0, 256, size=(30, 3), dtype=np.uint8)
    assert shared_samples(x, other) == []
    other[[4, 17]] = x[[9, 2]]
    assert shared_samples(x, other) == [2, 9]
    assert shared_samples(x.astype(np.float32), other) == [2, 9]
    assert shared_samples(x.astype(np.float32) + 0.5, other) == []
    assert shared_samples(x, other[:, :2]) == []


@pytest.mark.parametrize("keys, match", [
    ({"clean-validation-path": "/c.npz", "clean-validation-per-class": 5}, "not both"),
    ({"clean-validation-path": "c.npz"}, "is not absolute"),
    ({"clean-validation-per-class": 5, "fraction": 0.4}, "this run has none"),
    ({"clean-validation-per-class": 5, "phase-2-guard": "off"}, "this run has none"),
    ({"clean-validation-per-class": 5, "prestopping": False}, "this run has none"),
    ({"clean-validation-per-class": 5, "method": "fedcorr"}, "has its own server steps"),
    ({"clean-validation-per-class": 5, "validation-labels": "verified"},
     'with validation-labels="verified"'),
    ({"clean-validation-per-class": 5, "guard-score": "cross-fit"},
     'with guard-score="cross-fit"'),
    ({"clean-validation-per-class": 5, "validation-phase-2": "guard-slice"},
     'with validation-phase-2="guard-slice"'),
    ({"clean-validation-per-class": 5, "dataset": "npz", "num-classes": 3,
      "input-shape": "4", "evaluation": "federated"}, "does not hold"),
    ({"clean-validation-path": "/c.npz", "dataset": "npz", "num-classes": 3,
      "input-shape": "4", "evaluation": "federated"}, "neither data-path nor test-path"),
])
def test_a_clean_set_where_it_makes_no_sense_is_refused_naming_the_fix(keys, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config({**SILO, **keys})


def test_the_fallback_may_train_on_where_the_guard_reads_the_clean_set():
    cfg = load_run_config({**SILO, "clean-validation-per-class": 5, "guard-fallback": "train"})
    assert cfg.guard_reads_clean and cfg.guarded


# -- the accuracy it reads --------------------------------------------------------------------


def a_few_steps(cfg, data):
    """The run's initial model after a few Adam steps on 512 training samples (it then
    predicts more than one class)."""
    model = initial_model(cfg, data.task)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    some = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))[:512]
    xs = (data.train_x[some].float() / 255 - data.spec.mean[0]) / data.spec.std[0]
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), data.train_y[some]).backward()
        opt.step()
    return model.eval()


def by_hand(model, clean, data) -> float:
    """The model's argmax against the clean labels, the embedded MNIST's normalization
    applied to the raw pixels by hand."""
    with torch.no_grad():
        x = (clean.x.float() / 255 - data.spec.mean[0]) / data.spec.std[0]
        return int((model(x).argmax(1) == clean.y).sum()) / len(clean.y)


def test_the_accuracy_on_the_clean_set_is_the_models_own_argmax_against_its_labels():
    """The server's evaluator on the drawn set against a recomputation by hand."""
    cfg = load_run_config({**SILO, "clean-validation-per-class": 20})
    clean, data = load_clean_set(cfg, simulation=True)
    model = a_few_steps(cfg, data)
    loss, acc = Evaluator(cfg, data, (clean.x, clean.y))(get_weights(model))
    assert acc == pytest.approx(by_hand(model, clean, data), abs=1e-9)
    assert 0.2 < acc < 1.0


# -- FedAvg reports it ------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [1.0, 0.4])
def test_fedavg_holds_the_clients_data_of_the_fedefc_run_it_pairs_with(fraction):
    """FedAvg with the coordinator's draw trains on exactly the clients' samples of the
    FedEFC run with the same draw (the paired baseline of docs/FEDEFC.md §3.9), in a run
    of every client (FedEFC's guard reads the set) and of 2 of 5 (FedAvg only reports)."""
    keys = {**SILO, "fraction": fraction, "clean-validation-per-class": 10}
    fedavg = load_run_config({**keys, "method": "fedavg"})
    fedefc = build_data_plan(load_dataset(fedavg), load_run_config(SILO | {
        "clean-validation-per-class": 10}))
    plan = data_plan(fedavg)
    np.testing.assert_array_equal(plan.coordinator_indices, fedefc.coordinator_indices)
    for mine, theirs in zip(plan.client_indices, fedefc.client_indices):
        np.testing.assert_array_equal(mine, theirs)
        assert not np.isin(mine, plan.coordinator_indices).any()


def test_fedavg_reports_each_rounds_new_model_on_the_clean_set():
    """The server of FedAvg measures the model the round made (not the one it received)
    on the drawn set: the by-hand argmax accuracy, in the round's fields; the global
    model is FedAvg's, untouched; the summary names the set."""
    cfg = load_run_config({**SILO, "method": "fedavg", "clean-validation-per-class": 20})
    server = MethodServer(cfg, None)
    attach_clean_set(server, cfg, simulation=True)
    clean, data = load_clean_set(cfg, simulation=True)
    made = a_few_steps(cfg, data)
    received = [np.zeros_like(w) for w in get_weights(made)]
    new = ndarrays_to_parameters(get_weights(made))
    kept, fields = server.after_aggregate(Aggregated(
        3, [], new, {}, False, received=ndarrays_to_parameters(received)))
    assert kept is new
    assert fields == {"clean_acc": pytest.approx(by_hand(made, clean, data), abs=1e-9)}
    assert 0.2 < fields["clean_acc"] < 1.0
    assert server.summary_fields()["clean_set"].startswith(
        "the coordinator's clean validation set (200 samples")
    skipped = server.after_aggregate(Aggregated(4, [], None, {}, False))
    assert skipped == (None, {})


def test_fedavg_without_a_clean_set_adds_nothing():
    server = MethodServer(load_run_config({**SILO, "method": "fedavg"}), None)
    new = ndarrays_to_parameters([np.ones(3)])
    assert server.after_aggregate(Aggregated(1, [], new, {}, False)) == (new, {})
    assert server.summary_fields() == {}


# -- the guard reads it -----------------------------------------------------------------------


class ScriptedClean:
    """The clean set's accuracy of a scripted model: the round whose model it is, read
    off its bias (the scripted nodes add the size-weighted mean partition id to every
    weight each round), looked up in ``script``."""

    def __init__(self, init_bias: float, step: float, script: dict[int, float],
                 samples: int = 1000):
        self.init, self.step, self.script, self.samples = init_bias, step, script, samples
        self.seen: list[int] = []

    def made_by(self, weights) -> int:
        return int(round((float(weights[1][0]) - self.init) / self.step))

    def __call__(self, weights):
        self.seen.append(self.made_by(weights))
        return 0.0, self.script[self.made_by(weights)]

    def correct(self, weights):
        """Which of the set's samples the model gets right: its scripted share of them,
        at places drawn anew for each model (two models disagree both ways)."""
        t = self.made_by(weights)
        self.seen.append(t)
        right = np.zeros(self.samples, dtype=bool)
        right[np.random.default_rng(t).permutation(self.samples)[
            :round(self.script[t] * self.samples)]] = True
        return right


def scripted_loop(out, cfg, model, clean: ScriptedClean, source: str) -> None:
    """12 rounds of the scripted nodes of tests/test_guard.py (rising A(t)) with the
    server reading ``clean``'s scripted accuracies on a set of its size."""
    pipeline = make_pipeline(cfg, max_private=10**8,
                             evaluator=lambda weights: (1.0, float(weights[1][0])))
    pipeline.server.read_clean_set(clean, CleanSet(torch.zeros(clean.samples),
                                                   torch.zeros(clean.samples), source))
    manager = SimpleClientManager()
    for pid, size in SIZES.items():
        manager.register(RisingNode(f"node-{pid}", pid, size))
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(get_weights(model)), cfg=cfg,
                     recorder=RunRecorder(out, cfg.to_flat()), model=model, run_info={})
    loop.set_max_workers(1)
    loop.fit(12, None)


# the clean set's accuracy of the model after round r: rises past T_e = 4 (which the
# clients' A(t) of tests/test_guard.py fixes), peaks after round 7, then falls while the
# clients' A(t) keeps rising
CLEAN = {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8, 5: 0.85, 6: 0.8, 7: 0.9, 8: 0.6,
         9: 0.5, 10: 0.4, 11: 0.3}


def test_the_guard_follows_the_clean_set_where_the_clients_a_t_rises(tmp_path):
    """The clients' A(t) rises in every phase-2 round (the guard of tests/test_guard.py
    never fires on it). Read on the clean set instead, round t judges the model after
    round t - 1: round 7's reading (0.8) does not beat round 6's (0.85), round 8's (0.9)
    does; rounds 9 and 10 read 0.6 and 0.5, gamma-thr = 2 rounds not beating it: the
    guard restores the model round 8 received after round 10 and the run ends."""
    cfg = load_run_config({"num-clients": 4, "fraction": 1.0, "rounds": 12,
                           "start-round": 1, "gamma-thr": 2, "out-dir": str(tmp_path),
                           "twin-model": "off", "clean-validation-per-class": 1})
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    init = get_weights(model)
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    # a set of 1,000: its readings' standard error (under 1.6 points) tells the script's
    # differences of 5 points and more apart
    clean = ScriptedClean(float(init[1][0]), step, CLEAN)
    scripted_loop(tmp_path, cfg, model, clean, "scripted")
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == list(range(11))
    assert recs[4]["t_e"] == 4 and recs[5]["A"] == GUARDED[5]  # A(t) still found T_e
    assert [r.get("guard_acc") for r in recs[1:]] == [CLEAN[t - 1] for t in range(1, 11)]
    assert clean.seen == list(range(10))
    assert [r["guard_best_round"] for r in recs[2:]] == [2, 3, 4, 5, 6, 6, 8, 8, 8]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["guard_restored_round"], summary["guard_ended_at"]) == (8, 10)
    assert summary["final_acc"] == pytest.approx(float(init[1][0]) + 7 * step)
    assert summary["guard_signal"].startswith("the coordinator's clean validation set")
    assert "the coordinator's clean validation set (1000 samples" in summary["notes"][0]
    assert summary["delivered_after_round"] == 7 and summary["delivered_reading"] == 0.9


# the clean set's accuracy of FedAvg's model after round r (FedAvg reads the model each
# round made): the best after round 7, the last 5 points below it
FEDAVG_CLEAN = {**CLEAN, 12: 0.85}
# a set of 40 that reads every model within 2 samples: it tells none apart
FLAT_CLEAN = {t: 0.85 + 0.025 * (t % 2) for t in range(13)}


@pytest.mark.parametrize("deliver, samples, script, after", [
    ("best-read", 1000, FEDAVG_CLEAN, 7),   # 0.90 against the last 0.85: round 7's model
    ("final", 1000, FEDAVG_CLEAN, 12),      # FedAvg's own rule: the last model
    ("best-read", 40, FLAT_CLEAN, 12),      # a flat signal does not choose: the last
])
def test_fedavg_can_deliver_the_model_that_reads_best_on_the_clean_set(tmp_path, deliver,
                                                                      samples, script, after):
    """``deliver = "best-read"`` (docs/FEDEFC.md §3.9): FedAvg's server reads every
    round's new model on the coordinator's set and, at the end of the run, delivers the
    best where it reads above the last, unless the set tells no two models apart; model.pt,
    the final accuracy and the summary say so."""
    cfg = load_run_config({**SILO, "num-clients": 4, "method": "fedavg", "rounds": 12,
                           "deliver": deliver,
                           "out-dir": str(tmp_path), "clean-validation-per-class": 1})
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    init = get_weights(model)
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    scripted_loop(tmp_path, cfg, model,
                  ScriptedClean(float(init[1][0]), step, script, samples), "s")
    recs = records(tmp_path)
    assert [r["clean_acc"] for r in recs[1:]] == [script[t] for t in range(1, 13)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_acc"] == pytest.approx(float(init[1][0]) + after * step)
    saved = torch.load(tmp_path / "model.pt")
    np.testing.assert_allclose(saved["bias"].numpy(), init[1] + after * step, rtol=1e-6)
    if deliver == "final":
        assert "delivered_after_round" not in summary
    else:
        assert summary["delivered_after_round"] == after
        assert summary["delivered_reading"] == script[after]


@pytest.mark.parametrize("keys, match", [
    ({"method": "fedavg", "deliver": "best-read"}, "this run has none"),
    ({"method": "fedefc", "deliver": "best-read", "clean-validation-per-class": 10},
     "already delivers the model that reads best"),
    ({"method": "fedcorr", "deliver": "best-read"}, "has server steps of its own"),
])
def test_best_read_needs_the_clean_set_and_a_method_without_a_guard(keys, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config({**SILO, **keys})
