"""Reliability: bad payloads, failing and lying clients, checkpoints, resume, bad input."""

import io
import json
import logging
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from common.exchange import pack_array
from common.faults import parse_faults
from common.methods import load_run_config
from common.results import RunRecorder
from fedefc_cli.flower import LocalSimulation
from fedefc_cli.main import main
from fedefc_cli.run_configs import resolve_run_config, resume_config
from fedefc_cli.simulation import run_simulation_job
from fedefc_server import checkpoint
from fedefc_server.accuracy import aggregate_accuracy
from fedefc_server.extra_messages import send_tasks
from tests.helpers import (
    GLOBAL,
    OK,
    PARAMS,
    FakeNode,
    make_driver,
    manager,
    partition_nodes,
    patience,
    records,
    small_job,
)


# -- payload validation, table-driven ------------------------------------------------
def good_reply(pid, rng, **metrics):
    """A twinned client's reply (every client in every round: docs/FEDEFC.md §3.8): A_k
    and the twin's reading on its guard slice."""
    arrays = [rng.normal(size=a.shape).astype(a.dtype) for a in GLOBAL]
    return arrays, 100, {"partition-id": pid, "accuracy": 0.5, "guard-accuracy": 0.5,
                         **metrics}


BAD = {
    "too few arrays": lambda w, n, m: (w[:1], n, m),
    "too many arrays": lambda w, n, m: (w + [w[0]], n, m),
    "wrong shape": lambda w, n, m: ([w[0].reshape(4, 3), w[1]], n, m),
    "wrong dtype": lambda w, n, m: ([w[0].astype(np.float64), w[1]], n, m),
    "NaN": lambda w, n, m: ([np.full_like(w[0], np.nan), w[1]], n, m),
    "Inf": lambda w, n, m: ([w[0], np.full_like(w[1], np.inf)], n, m),
    "zero samples": lambda w, n, m: (w, 0, m),
    "negative samples": lambda w, n, m: (w, -3, m),
    "absurd samples": lambda w, n, m: (w, 10**12, m),
    "inflated samples": lambda w, n, m: (w, n + 1, m),
    "deflated samples": lambda w, n, m: (w, n - 1, m),
    "missing accuracy": lambda w, n, m: (w, n, {k: v for k, v in m.items() if k != "accuracy"}),
    "accuracy above 1": lambda w, n, m: (w, n, {**m, "accuracy": 1.5}),
    "accuracy NaN": lambda w, n, m: (w, n, {**m, "accuracy": float("nan")}),
    "accuracy as text": lambda w, n, m: (w, n, {**m, "accuracy": "0.9"}),
    "partition id missing": lambda w, n, m: (w, n, {k: v for k, v in m.items()
                                                    if k != "partition-id"}),
    "partition id text": lambda w, n, m: (w, n, {**m, "partition-id": "7"}),
    "partition id not sampled": lambda w, n, m: (w, n, {**m, "partition-id": 99}),
    "partition id duplicated": lambda w, n, m: (w, n, {**m, "partition-id": 0}),
    "accuracy as bytes": lambda w, n, m: (w, n, {**m, "accuracy": b"0.5"}),
    "missing guard accuracy": lambda w, n, m: (w, n, {k: v for k, v in m.items()
                                                      if k != "guard-accuracy"}),
    "guard accuracy above 1": lambda w, n, m: (w, n, {**m, "guard-accuracy": 1.01}),
    "samples as text": lambda w, n, m: (w, "100", m),
    "train loss as text": lambda w, n, m: (w, n, {**m, "train-loss": "0.3"}),
    "noise rate as bool": lambda w, n, m: (w, n, {**m, "noise-rate": True}),
    "fit time as bytes": lambda w, n, m: (w, n, {**m, "fit-s": b"1.0"}),
}
REASON = {"too few arrays": "arrays, expected", "too many arrays": "arrays, expected",
          "wrong shape": "shape", "wrong dtype": "dtype", "NaN": "NaN", "Inf": "NaN or Inf",
          "zero samples": "sample count 0", "negative samples": "sample count -3",
          "absurd samples": "sample count 1000000000000 outside 1..100",
          "inflated samples": "sample count 101 outside 1..100",
          "deflated samples": "sample count 99 differs from the 100 samples",
          "missing accuracy": "accuracy missing",
          "accuracy above 1": "outside [0, 1]", "accuracy NaN": "outside [0, 1]",
          "accuracy as text": "not a number", "partition id missing": "malformed partition id",
          "partition id text": "malformed partition id", "partition id not sampled":
          "partition id 99 is not its node's registered partition 5",
          "partition id duplicated": "partition id 0 is not its node's registered partition 5",
          "accuracy as bytes": "accuracy missing or not a number",
          "missing guard accuracy": "guard-accuracy missing or not a number",
          "guard accuracy above 1": "guard-accuracy 1.01 outside [0, 1]",
          "samples as text": "sample count '100'",
          "train loss as text": "train-loss missing or not a number",
          "noise rate as bool": "noise-rate missing or not a number",
          "fit time as bytes": "fit-s missing or not a number"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_payload_is_rejected_and_the_round_aggregates_the_others(case):
    strategy = make_driver(**{"method": "fedefc", "num-clients": 6, "fraction": 1.0,
                              "rounds": 5, "start-round": 0, "prestopping": True})
    nodes = partition_nodes(6, sizes=[100] * 6)
    strategy.configure_fit(1, PARAMS, manager(nodes))
    rng = np.random.default_rng(0)
    replies = [good_reply(pid, rng) for pid in range(6)]
    replies[5] = BAD[case](*replies[5])
    results = [(nodes[i], FitRes(OK, ndarrays_to_parameters(w), n, m))
               for i, (w, n, m) in enumerate(replies)]
    params, _ = strategy.aggregate_fit(1, results, [])
    info = strategy.fields()
    assert info["rejected"] == 1 and REASON[case] in info["rejected_reasons"][0]["reason"]
    assert info["partition_ids"] == [0, 1, 2, 3, 4]
    good = [w for w, _, _ in replies[:5]]
    for layer, got in enumerate(parameters_to_ndarrays(params)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, np.mean([g[layer] for g in good], axis=0), rtol=1e-5,
                                   atol=1e-6)
    assert info["A"] == pytest.approx(0.5)


def method_metrics(method, pid, rng):
    """What a valid round-1 reply of a method adds (a stage-1 FedCorr reply; RoFL's K x D
    = GLOBAL's 3 x 4 centroids): the metrics its registry entry declares."""
    return {"fedcorr": {"fedcorr-lid": 1.0 + pid, "fedcorr-est-noise": 0.1},
            "fedditto": {"personal-acc": 0.5, "personal-updates": 2},
            "confident-learning": {"kept": 100, "removed": 0},
            "rofl": {"rofl-local-centroids": pack_array(rng.random((3, 4)).astype(np.float32))},
            }[method]


METHOD_BAD = {  # case: (method, metric, bad value or None to leave it out, reason)
    "fedcorr LID missing": ("fedcorr", "fedcorr-lid", None, "fedcorr-lid missing"),
    "fedcorr LID as text": ("fedcorr", "fedcorr-lid", "2.0", "fedcorr-lid missing or not a"),
    "fedcorr LID as bool": ("fedcorr", "fedcorr-lid", True, "fedcorr-lid missing or not a"),
    "fedcorr LID NaN": ("fedcorr", "fedcorr-lid", float("nan"), "fedcorr-lid nan outside"),
    "fedcorr LID Inf": ("fedcorr", "fedcorr-lid", float("inf"), "fedcorr-lid inf outside"),
    "fedcorr LID negative": ("fedcorr", "fedcorr-lid", -0.5, "fedcorr-lid -0.5 outside"),
    "fedcorr noise missing": ("fedcorr", "fedcorr-est-noise", None, "fedcorr-est-noise missing"),
    "fedcorr noise above 1": ("fedcorr", "fedcorr-est-noise", 1.5,
                              "fedcorr-est-noise 1.5 outside [0, 1]"),
    "fedcorr noise negative": ("fedcorr", "fedcorr-est-noise", -0.1, "outside [0, 1]"),
    "fedcorr noise as bytes": ("fedcorr", "fedcorr-est-noise", b"0.1", "missing or not a"),
    "rofl centroids missing": ("rofl", "rofl-local-centroids", None,
                               "undecodable rofl-local-centroids (TypeError)"),
    "rofl centroids as text": ("rofl", "rofl-local-centroids", "[[0.1]]", "undecodable"),
    "rofl centroids garbage": ("rofl", "rofl-local-centroids", b"\x93NUMPY garbage",
                               "undecodable rofl-local-centroids (ValueError)"),
    "rofl centroids wrong shape": ("rofl", "rofl-local-centroids",
                                   pack_array(np.ones((3, 2), np.float32)), "expected (3, 4)"),
    "rofl centroids transposed": ("rofl", "rofl-local-centroids",
                                  pack_array(np.ones((4, 3), np.float32)), "expected (3, 4)"),
    "rofl centroids integers": ("rofl", "rofl-local-centroids",
                                pack_array(np.ones((3, 4), np.int32)), "expected (3, 4) floats"),
    "rofl centroids NaN": ("rofl", "rofl-local-centroids",
                           pack_array(np.full((3, 4), np.nan, np.float32)), "NaN or Inf"),
    "rofl kept count as text": ("rofl", "rofl-kept", "10", "rofl-kept missing or not an int"),
    "rofl agree count negative": ("rofl", "rofl-agree", -2, "rofl-agree -2 outside"),
    "ditto personal accuracy Inf": ("fedditto", "personal-acc", float("inf"),
                                    "personal-acc inf outside"),
    "ditto updates as float": ("fedditto", "personal-updates", 2.5,
                               "personal-updates missing or not an integer"),
    "kept count as bytes": ("confident-learning", "kept", b"3",
                            "kept missing or not an integer"),
    "kept count as float": ("confident-learning", "kept", 3.5, "kept missing or not an integer"),
    "removed count negative": ("confident-learning", "removed", -1,
                               "removed -1 outside [0, inf]"),
}


@pytest.mark.parametrize("case", sorted(METHOD_BAD))
def test_bad_method_metrics_are_rejected_and_the_round_aggregates_the_others(case):
    method, key, value, reason = METHOD_BAD[case]
    strategy = make_driver(**{"method": method, "num-clients": 6, "fraction": 1.0,
                              "rounds": 5, "fedcorr-iterations": 1})
    nodes = partition_nodes(6, sizes=[100] * 6)
    assert [p.partition_id for p, _ in strategy.configure_fit(1, PARAMS, manager(nodes))
            ] == list(range(6))
    rng = np.random.default_rng(0)
    replies = [good_reply(pid, rng, **method_metrics(method, pid, rng)) for pid in range(6)]
    w, n, m = replies[5]
    replies[5] = (w, n, {k: v for k, v in m.items() if k != key} if value is None
                  else {**m, key: value})
    results = [(nodes[i], FitRes(OK, ndarrays_to_parameters(w), n, m))
               for i, (w, n, m) in enumerate(replies)]
    params, _ = strategy.aggregate_fit(1, results, [])
    info = strategy.fields()
    assert info["rejected"] == 1 and reason in info["rejected_reasons"][0]["reason"]
    assert info["partition_ids"] == [0, 1, 2, 3, 4]
    good = [w for w, _, _ in replies[:5]]
    for layer, got in enumerate(parameters_to_ndarrays(params)):
        np.testing.assert_allclose(got, np.mean([g[layer] for g in good], axis=0), rtol=1e-5,
                                   atol=1e-6)
    if method == "fedcorr":  # only the accepted clients' LIDs enter the detection
        assert strategy.server.lid_sum == {p: 1.0 + p for p in range(5)}
    elif method == "rofl":  # round 1: f_G is the plain mean of the accepted clients' f_k
        local = [np.load(io.BytesIO(m["rofl-local-centroids"])) for _, _, m in replies[:5]]
        np.testing.assert_allclose(strategy.server.centroids, np.mean(local, axis=0),
                                   rtol=1e-6)
    elif method == "fedditto":  # the record folds the accepted replies' values only
        assert info["personal_acc"] == 0.5 and info["personal_updates"] == [2] * 5
    else:
        assert info["kept"] == 500 and info["removed"] == 0


class HangingNode(FakeNode):
    """A node whose fit ignores its timeout and hangs until ``release`` is set;
    ``returned`` is set once its call has returned."""

    def __init__(self, pid, release):
        super().__init__(pid)
        self.release = release
        self.returned = threading.Event()

    def fit(self, ins, timeout, group_id):
        try:
            self.release.wait(patience(300))
            raise RuntimeError("released")
        finally:
            self.returned.set()


class BrokenNode(FakeNode):
    def fit(self, ins, timeout, group_id):
        raise ConnectionError("node gone")


class TimedNode(FakeNode):
    """A node that answers at once and records the timeout its call was given."""

    def fit(self, ins, timeout, group_id):
        self.timeouts.append(timeout)
        return super().fit(ins, timeout, group_id)


# the client-timeout of these exchanges: the prompt nodes answer well within it on a busy
# machine, the hung node never does
PROMPT_S = patience(2.0)


def _nodes_with_a_dead_one(release):
    nodes = [TimedNode(p, lambda config: {"answer": 1}) for p in (0, 1, 3)]
    for node in nodes:
        node.timeouts = []
    return nodes + [HangingNode(2, release), BrokenNode(4)]


def test_extra_messages_return_the_answers_despite_a_hung_and_a_failing_client():
    release = threading.Event()
    nodes = _nodes_with_a_dead_one(release)
    try:
        replies = send_tasks({n.pid: n for n in nodes}, PARAMS,
                             {n.pid: {"task": "t"} for n in nodes}, 3, timeout=PROMPT_S)
        assert not nodes[3].returned.is_set()  # it did not wait for the hung node
        assert sorted(replies) == [0, 1, 3]
        assert all(r.metrics["answer"] == 1 for r in replies.values())
        assert all(n.timeouts == [PROMPT_S] for n in nodes[:3])
    finally:
        release.set()


def test_a_node_late_for_an_extra_message_is_told_with_the_wait_in_words(caplog):
    """Issue 49 (5): waits were logged as a float's digits. A client-timeout of 0.1 + 0.2
    (0.30000000000000004 s to the clock) is logged as 0.3 s."""
    release = threading.Event()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        assert send_tasks({2: HangingNode(2, release)}, PARAMS, {2: {"task": "t"}}, 3,
                          timeout=0.1 + 0.2) == {}
    finally:
        flwr_logger.removeHandler(caplog.handler)
        release.set()
    # a set: where flwr's logger propagates, caplog sees each record twice
    assert {r.getMessage() for r in caplog.records if "no reply" in r.getMessage()} == {
        "partition 2: no reply to the extra message within 0.3 s"}


@pytest.mark.parametrize("client_timeout, expected", [(PROMPT_S, PROMPT_S), (0.0, None)])
def test_strategy_extra_messages_use_the_client_timeout(client_timeout, expected):
    release = threading.Event()
    nodes = _nodes_with_a_dead_one(release)
    if expected is None:  # no timeout: the exchange waits for the hung node (released below)
        nodes[3].release = threading.Event()
        nodes[3].release.set()
    pipeline = make_driver(**{"method": "fednoro", "num-clients": 5, "fraction": 1.0,
                              "rounds": 3, "fednoro-warmup": 1,
                              "client-timeout": client_timeout}).pipeline
    try:
        serving = pipeline.registry.refresh(manager(nodes), 2)
        replies = pipeline.task_sender(serving, PARAMS, 2)({p: {"task": "t"} for p in range(5)})
        assert sorted(replies) == [0, 1, 3]
        assert all(n.timeouts == [expected] for n in nodes[:3])
    finally:
        release.set()


def test_task_sender_counts_only_the_messages_it_sent():
    """A task for a partition that no node serves is not sent, and a method that asks
    for no task sends none: the round then records no extra-message time."""
    nodes = [TimedNode(p, lambda config: {"answer": 1}) for p in range(5)]
    for node in nodes:
        node.timeouts = []
    pipeline = make_driver(**{"method": "fednoro", "num-clients": 5, "fraction": 1.0,
                              "rounds": 3, "fednoro-warmup": 1}).pipeline
    serving = pipeline.registry.refresh(manager(nodes), 2)
    sent: list[int] = []
    send = pipeline.task_sender(serving, PARAMS, 2, sent)
    replies = send({p: {"task": "t"} for p in (0, 2, 7)})  # no node serves partition 7
    assert sorted(replies) == [0, 2]
    assert send({}) == {}
    assert sent == [2, 0]
    assert [len(n.timeouts) for n in nodes] == [1, 0, 1, 0, 0]
    for tasks, timed in (({}, False), ({7: {"task": "t"}}, False), ({1: {"task": "t"}}, True)):
        pipeline.server.before_round = lambda r, send_tasks, parts, tasks=tasks: (
            send_tasks(tasks), {})[1]
        record = pipeline.plan(2, PARAMS, manager(nodes)).record
        assert ("extra_messages_s" in record) is timed, tasks


def test_round_below_min_fit_clients_keeps_the_model():
    strategy = make_driver(**{"method": "fedefc", "num-clients": 4, "fraction": 1.0,
                              "rounds": 5, "start-round": 0, "min-fit-clients": 3,
                              "prestopping": True})
    nodes = partition_nodes(4, sizes=[100] * 4)
    strategy.configure_fit(1, PARAMS, manager(nodes))
    rng = np.random.default_rng(1)
    results = [(nodes[i], FitRes(OK, ndarrays_to_parameters(w), n, m))
               for i, (w, n, m) in enumerate(good_reply(p, rng) for p in range(2))]
    params, _ = strategy.aggregate_fit(1, results, [RuntimeError("boom"), RuntimeError("x")])
    fields = strategy.fields()
    assert params is None and fields["skipped"] and fields["failures"] == 2
    assert strategy.server.prestopper.history == []  # no A(t) from a skipped round


# -- robust accuracy aggregation -----------------------------------------------------
def test_accuracy_aggregations():
    values = [0.1, 0.5, 0.6, 0.7, 1.0]
    assert aggregate_accuracy(values, "mean") == pytest.approx(0.58)
    assert aggregate_accuracy(values, "median") == pytest.approx(0.6)
    assert aggregate_accuracy(values, "trimmed-mean", 0.2) == pytest.approx(0.6)
    assert aggregate_accuracy(values, "trimmed-mean", 0.1) == pytest.approx(0.58)  # floor(0.5)=0
    assert aggregate_accuracy([], "median") is None
    liars = [1.0] + [0.6] * 9
    assert aggregate_accuracy(liars, "median") == 0.6 and aggregate_accuracy(liars) > 0.6


def test_fault_spec_parsing():
    faults = parse_faults("raise@3;acc=1.0@0-2,9@5-6")
    assert faults[0].pids == {3} and faults[0].rounds is None
    assert faults[1].pids == {0, 1, 2, 9} and faults[1].rounds == {5, 6}
    assert faults[1].applies(9, 6) and not faults[1].applies(9, 7)
    with pytest.raises(ValueError, match="KIND@PIDS"):
        parse_faults("explode@1")


# -- checkpoints ---------------------------------------------------------------------
def _ckpt(cfg, rnd=3):
    return checkpoint.Checkpoint(rnd, [np.arange(6, dtype=np.float32).reshape(2, 3)],
                                 {"prestopper": {"a_max": 0.5}}, cfg.to_flat(), elapsed_s=12.5)


def test_checkpoint_roundtrip_and_refusals(tmp_path):
    cfg = load_run_config({"rounds": 10})
    checkpoint.save(tmp_path, _ckpt(cfg))
    got = checkpoint.load(tmp_path)
    assert got.round == 3 and got.strategy == {"prestopper": {"a_max": 0.5}}
    assert got.elapsed_s == 12.5
    np.testing.assert_array_equal(got.weights[0], np.arange(6).reshape(2, 3))
    checkpoint.check_compatible(got, {**cfg.to_flat(), "rounds": 20, "out-dir": "/x"}, tmp_path,
                                [(2, 3)])
    # a deployment checkpointed before it needed an allowlist or open-deployment resumes
    old = {k: v for k, v in cfg.to_flat().items() if k != "open-deployment"}
    checkpoint.check_compatible(checkpoint.Checkpoint(3, got.weights, got.strategy, old),
                                {**cfg.to_flat(), "open-deployment": True}, tmp_path, [(2, 3)])
    with pytest.raises(checkpoint.CheckpointError, match="rho: 0.2 -> 0.4"):
        checkpoint.check_compatible(got, {**cfg.to_flat(), "rho": 0.4}, tmp_path, [(2, 3)])
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        checkpoint.check_compatible(got, cfg.to_flat(), tmp_path, [(3, 2)])
    with pytest.raises(checkpoint.CheckpointError, match="already finished"):
        checkpoint.check_compatible(got, {**cfg.to_flat(), "rounds": 3}, tmp_path, [(2, 3)])
    (tmp_path / checkpoint.FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint.pt"):
        checkpoint.load(tmp_path / "elsewhere")


def test_recorder_resume_drops_records_after_the_checkpoint(tmp_path):
    rec = RunRecorder(tmp_path, {"a": 1})
    for r in range(5):
        rec.write_round({"round": r, "test_acc": 0.1 * r})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 5, "test_ac')  # the crash cut the last line short
    again = RunRecorder(tmp_path, {"a": 1}, resume_round=3)
    assert [r["round"] for r in again.rounds] == [0, 1, 2, 3]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2, 3]


# -- bad configuration and data: clear error, non-zero exit, nothing written ----------
FUZZ = [
    ["--set", "rho=abc"], ["--set", "rho=-0.1"], ["--set", "rho=1.0"], ["--set", "zeta=2"],
    ["--set", "rho=0.3", "--set", "zeta=1.0"], ["--set", "dataset=imagenet"],
    ["--set", "num-clients=0"], ["--set", "num-clients=2.5"], ["--set", "fraction=0"],
    ["--set", "fraction=1.5"], ["--set", "rounds=0"], ["--set", "local-epochs=-1"],
    ["--set", "batch-size=0"], ["--set", "lr=0"], ["--set", "momentum=1"],
    ["--set", "alpha-dir=0"], ["--set", "p=0"], ["--set", "start-round=999"],
    ["--set", "gamma-thr=0"], ["--set", "count-rule=vote"], ["--set", "weighting=yes"],
    ["--set", "accuracy-signal=loss"], ["--set", "device=tpu"], ["--set", "seed=-1"],
    ["--set", "method=sgd"], ["--set", "model=vgg"], ["--set", "noise-groups=0.2"],
    ["--set", "noise-groups=0.2:1.0;0.1:0.1"], ["--set", "dataset=mnist"],
    ["--set", "dataset=mnist", "--set", "data-dir=relative/path"],
    ["--set", "accuracy-aggregation=mode"], ["--set", "trim-fraction=0.5"],
    ["--set", "min-fit-clients=11"], ["--set", "faults=boom@1"], ["--set", "resume-from=rel"],
    ["--set", "unknown-key=1"], ["--set", "novalue"], ["--set", "iid=maybe"],
    ["--set", "client-timeout=-1"], ["--set", "rho=0.5", "--set", "zeta=0.99"],
]


@pytest.mark.parametrize("args", FUZZ, ids=[" ".join(a[1::2]) for a in FUZZ])
def test_invalid_config_exits_nonzero_naming_the_key_and_writes_nothing(tmp_path, capsys, args):
    out = tmp_path / "out"
    assert main(["run", *args, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    key = args[-1].split("=")[0]
    assert err.startswith("fedefc: error:") and (key in err or "zeta" in err)
    assert not out.exists()


@pytest.mark.parametrize("layout", ["missing", "empty", "corrupt"])
def test_missing_or_corrupt_dataset_fails_before_round_1(tmp_path, capsys, tiny_mnist_dir, layout):
    data = tmp_path / "data"
    if layout != "missing":
        (data / "MNIST" / "raw").mkdir(parents=True)
    if layout == "corrupt":
        for f in (tiny_mnist_dir / "MNIST" / "raw").iterdir():
            (data / "MNIST" / "raw" / f.name).write_bytes(f.read_bytes()[:100])
    out = tmp_path / "out"
    assert main(["run", "--set", "dataset=mnist", "--set", f"data-dir={data}",
                 "--out-dir", str(out)]) == 2
    assert str(data) in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("where", ["under a file", "read-only file system"])
def test_unwritable_output_folder_is_refused(tmp_path, capsys, where):
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "run"
    else:
        out = tmp_path.anchor + "proc/fedefc-run"
    assert main(["run", "--out-dir", str(out)]) == 2
    assert "not writable" in capsys.readouterr().err


# -- real simulations ----------------------------------------------------------------
@pytest.mark.flower
def test_failing_and_bad_clients_do_not_stop_the_run(tmp_path, tiny_mnist_dir):
    # 150 samples per client: claiming 151 (within the training set's 600, which
    # bounded replies before sizes were declared) or another client's id is refused
    faults = ("raise@0@2-3;nan@1@2;shape@2@3;samples=0@3@4;samples=151@1@4;acc=1.5@3@2;"
              "pid=1@2@5")
    summary = run_simulation_job(small_job(tiny_mnist_dir, tmp_path / "run",
                                           faults=f'"{faults}"'))
    recs = {r["round"]: r for r in records(tmp_path / "run")}
    assert recs[1]["declared"] == {str(p): 150 for p in range(4)}
    assert recs[2]["failures"] == 1 and recs[2]["rejected"] == 2
    assert {x["reason"].split(" ")[0] for x in recs[2]["rejected_reasons"]} == {"array", "accuracy"}
    assert recs[3]["failures"] == 1 and "shape" in recs[3]["rejected_reasons"][0]["reason"]
    assert sorted(x["reason"] for x in recs[4]["rejected_reasons"]) == [
        "sample count 0 outside 1..150, the partition's declared size",
        "sample count 151 outside 1..150, the partition's declared size"]
    assert recs[5]["rejected_reasons"] == [{"node": recs[5]["rejected_reasons"][0]["node"],
                                            "partition": 2, "reason": "partition id 1 is not "
                                            "its node's registered partition 2"}]
    assert recs[5]["partition_ids"] == [0, 1, 3]  # the genuine partition 1 is kept
    assert 0 in recs[1]["partition_ids"] and 0 not in recs[2]["partition_ids"]
    assert 0 in recs[4]["partition_ids"]  # the failed client takes part again
    model = torch.load(tmp_path / "run" / "model.pt")
    assert all(torch.isfinite(v.float()).all() for v in model.values())
    assert summary["final_acc"] > 0.3
    # every partition that missed a round is named, with its node and why (issue 30)
    missed = {a["partition"]: a for a in recs[2]["missing"]}
    nodes = {r["partition"]: r["node"] for r in recs[2]["rejected_reasons"]}
    assert sorted(missed) == [0, 1, 3] and missed[1]["node"] == nodes[1]
    assert missed[0]["node"].isdigit() and missed[0]["node"] not in nodes.values()
    assert "InjectedFault: injected failure of client 0 in round 2" in missed[0]["reason"]
    assert missed[1]["reason"].startswith("reply refused: array")
    # the fault schedule above, partition by partition
    assert summary["missed_rounds"] == {"0": [2, 3], "1": [2, 4], "2": [3, 5], "3": [2, 4]}
    assert summary["status"] == "degraded"  # 2 of 6 rounds > floor(0.1 x 6) = 0


def _kill_simulation_after(sim: LocalSimulation, out, rnd: int,
                           ended: threading.Event) -> None:
    """SIGKILL the flwr-simulation process (it hosts the ServerApp) once round ``rnd``
    has been recorded (not if the run has ``ended`` first)."""
    path = out / "metrics.jsonl"
    deadline = time.monotonic() + patience(1800)
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) > rnd:
            break
        if ended.wait(0.05):
            return
    pids = subprocess.run(["pgrep", "-f", f"flwr-simulation.*127.0.0.1:{sim.port}"],
                          capture_output=True, text=True).stdout.split()
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)


@pytest.mark.flower
def test_kill_the_server_mid_run_then_resume_gives_the_uninterrupted_result(tmp_path,
                                                                              tiny_mnist_dir):
    whole = small_job(tiny_mnist_dir, tmp_path / "whole")
    run_simulation_job(whole)
    broken = small_job(tiny_mnist_dir, tmp_path / "broken")
    with LocalSimulation(tmp_path / "sim") as sim:
        ended = threading.Event()
        killer = threading.Thread(target=_kill_simulation_after,
                                  args=(sim, tmp_path / "broken", 3, ended))
        killer.start()
        try:
            _, status = sim.run(broken, 4, 1, 0.0, log_path=tmp_path / "broken.log")
        finally:
            ended.set()
            killer.join()
    assert status != "finished:completed"
    assert not (tmp_path / "broken" / "summary.json").exists()
    stopped_at = checkpoint.load(tmp_path / "broken").round
    # round 3's record is written before its checkpoint: a kill in between leaves round 2's
    assert 2 <= stopped_at < 6
    summary = run_simulation_job(resume_config(str(tmp_path / "broken"), []))
    a = torch.load(tmp_path / "whole" / "model.pt")
    b = torch.load(tmp_path / "broken" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(tmp_path / "whole"), records(tmp_path / "broken")
    keys = ("round", "test_acc", "test_loss", "A", "phase", "partition_ids", "t_e")
    assert [{k: r.get(k) for k in keys} for r in ra] == [{k: r.get(k) for k in keys} for r in rb]
    assert summary["final_acc"] == json.loads((tmp_path / "whole" / "summary.json")
                                              .read_text())["final_acc"]
    # the run does not read as one clean run: the round run again is marked, and said
    assert [r["round"] for r in rb if r.get("resumed")] == [stopped_at + 1]
    assert [e["round"] for e in summary["interruptions"]] == [stopped_at + 1]
    assert summary["interruptions"][0]["reason"].startswith(
        f"the run stopped after round {stopped_at} without a word from its ServerApp")


def _phase1_rounds(out):
    return {r["round"]: r for r in records(out) if r["round"] > 0 and r.get("A") is not None}


@pytest.mark.flower
def test_lying_clients_influence_on_a_t_is_bounded_under_median(tmp_path):
    """10% of the clients (partitions 0-1 of 20) always report accuracy 1.0.

    Until the first phase switch the global models of the honest and the lying run are
    identical (a reported accuracy does not change training), so each round's reports
    differ only at the liars. The median must then stay within the honest reports' order
    statistics y((m+1)/2 - f) .. y(m/2 + 1 + f) for f liars among m reports, while the
    mean moves by exactly sum(lie - honest) / m. How far this moves T_e is measured in
    docs/RELIABILITY.md (tests/benchmarks/bench_lying_clients.py): the prestopping rule
    compares A(t) with A_max, so even a bounded shift can move T_e by several rounds
    when round-to-round gains are smaller than the honest clients' spread.
    """
    def run(name, how, faults=""):
        cfg = resolve_run_config(None, ["rounds=12", "start-round=11", "local-epochs=1",
                                        f"accuracy-aggregation={how}", f'faults="{faults}"'],
                                 str(tmp_path / name))
        run_simulation_job(cfg)
        return _phase1_rounds(tmp_path / name)

    honest = run("honest", "median")
    lying_median = run("lying-median", "median", "acc=1.0@0-1")
    lying_mean = run("lying-mean", "mean", "acc=1.0@0-1")
    checked = 0
    for rnd, h in honest.items():
        liars = [i for i, pid in enumerate(h["partition_ids"]) if pid in (0, 1)]
        if not liars:
            continue
        y = np.sort(h["client_acc"])
        m, f = len(y), len(liars)
        low, high = y[max(0, (m + 1) // 2 - 1 - f)], y[min(m - 1, m // 2 + f)]
        assert low - 1e-12 <= lying_median[rnd]["A"] <= high + 1e-12
        shift = sum(1.0 - h["client_acc"][i] for i in liars) / m
        assert lying_mean[rnd]["A"] == pytest.approx(np.mean(h["client_acc"]) + shift)
        checked += 1
    assert checked >= 3
