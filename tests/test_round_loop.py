"""The round loop owns the records, the checkpoints and the summary (in-process nodes, no Ray).

Four nodes train a tiny linear model: each returns the global weights plus its
partition id, with its size as sample count and a scripted accuracy. Every number the
loop writes is known in advance: the FedAvg of the replies, A(t), T_e.
"""

import json
import logging

import numpy as np
import pytest
import torch
from flwr.common import EvaluateRes, FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

from common.dp_accounting import epsilon
from common.methods import load_run_config
from common.params import get_weights
from common.results import RunRecorder
from fedefc_server import checkpoint
from fedefc_server.curves import series
from fedefc_server.failures import RunFailed
from fedefc_server.link_watch import LinkLost
from fedefc_server.resumes import resume_event
from fedefc_server.round_loop import RoundLoop
from tests.helpers import OK, FakeProxy, make_pipeline, records

SIZES = {0: 10, 1: 20, 2: 30, 3: 40}
ACCURACY = {1: 0.5, 2: 0.6, 3: 0.6, 4: 0.6}  # A(t): no gain in round 3, T_e = 3 (gamma 1)


class TrainingNode(FakeProxy):
    """Adds its partition id to every weight; reports its size and the round's accuracy."""

    def fit(self, ins, timeout, group_id):
        weights = [w + self.partition_id for w in parameters_to_ndarrays(ins.parameters)]
        metrics = {"partition-id": self.partition_id, "loss": "cross-entropy",
                   "train-loss": 0.1 * self.partition_id}
        if "phase" in ins.config and int(ins.config["phase"]) == 1:
            metrics["accuracy"] = ACCURACY[int(ins.config["round"])]
        return FitRes(OK, ndarrays_to_parameters(weights), self.num_examples, metrics)


HELD_OUT = {0: (2, 0.5), 1: (0, None), 2: (4, 1.0), 3: (6, 0.25)}  # (samples, accuracy)


class EvaluatingNode(TrainingNode):
    """Also evaluates: its held-out count (declared) and accuracy from HELD_OUT, loss
    round + id."""

    def __init__(self, cid: str, partition_id: int, num_examples: int):
        super().__init__(cid, partition_id, num_examples, HELD_OUT[partition_id][0])

    def evaluate(self, ins, timeout, group_id):
        n, acc = HELD_OUT[self.partition_id]
        metrics = {"partition-id": self.partition_id, **({"accuracy": acc} if n else {})}
        return EvaluateRes(OK, float(ins.config["round"] + self.partition_id), n, metrics)


class BrokenNode(TrainingNode):
    """A node whose data is malformed: its ClientApp fails in every round."""

    def fit(self, ins, timeout, group_id):
        raise RuntimeError(f"partition {self.partition_id}: data.npz is malformed")


class LyingNode(TrainingNode):
    """Claims a sample count no partition has (rejected) in round 2, honest otherwise."""

    def fit(self, ins, timeout, group_id):
        res = super().fit(ins, timeout, group_id)
        if int(ins.config["round"]) == 2:
            res.num_examples = 10**12
        return res


def run_loop(tmp_path, method, rounds=4, node=TrainingNode, central=True, node_class=None,
             on_manager=None, link=None, evaluated=None, resume=False, **keys):
    """The run of ``method`` over the four nodes; ``evaluated`` collects the weights the
    server evaluates; ``resume``: continue the run in ``tmp_path`` after its checkpoint,
    as the ServerApp does (server_app.build)."""
    cfg = load_run_config({"method": method,
                           "num-clients": 4, "fraction": 1.0, "rounds": rounds,
                           "start-round": 1, "gamma-thr": 1, "out-dir": str(tmp_path),
                           "twin-model": "off",  # one model: the loop, not the twin
                           **keys})
    model = torch.nn.Linear(2, 3)
    init = get_weights(model)
    evaluated = [] if evaluated is None else evaluated
    ckpt = checkpoint.load(tmp_path) if resume else None
    resumed = resume_event(tmp_path, ckpt.round) if ckpt else None

    def evaluator(weights):  # the "test accuracy" is the bias's first entry
        evaluated.append(weights)
        return 1.0, float(weights[1][0])

    pipeline = make_pipeline(cfg, max_private=10**8,
                             evaluator=evaluator if central else None)
    manager = SimpleClientManager()
    for pid in SIZES:
        manager.register((node_class or {}).get(pid, node)(f"node-{pid}", pid, SIZES[pid]))
    if on_manager is not None:
        on_manager(manager)
    if ckpt:
        pipeline.load_state(ckpt.strategy)
        pipeline.server.load_models(ckpt.models)
    loop = RoundLoop(client_manager=manager, pipeline=pipeline,
                     parameters=ndarrays_to_parameters(ckpt.weights if ckpt else init),
                     cfg=cfg, recorder=RunRecorder(tmp_path, cfg.to_flat(),
                                                   resume_round=ckpt.round if ckpt else None),
                     model=model, run_info={"train_samples": 100}, link=link,
                     first_round=ckpt.round + 1 if ckpt else 1, resumed=resumed)
    loop.set_max_workers(1)
    loop.fit(rounds, None)
    return init, evaluated


def test_fedefc_records_every_round_its_checkpoint_and_the_summary(tmp_path):
    """The paper's protocol (no phase-2 guard: phase-2 replies carry no A_k; the guard
    is tested in test_guard.py)."""
    init, evaluated = run_loop(tmp_path, "fedefc", **{"phase-2-guard": "off"})
    # each round adds the size-weighted mean partition id: (10*0+20*1+30*2+40*3)/100 = 2
    step = sum(n * p for p, n in SIZES.items()) / sum(SIZES.values())
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4]
    for rnd, r in enumerate(recs):
        np.testing.assert_allclose(evaluated[rnd][1], init[1] + rnd * step, rtol=1e-6)
        assert r["test_acc"] == pytest.approx(float(init[1][0] + rnd * step))
    assert recs[0]["phase"] == 1 and recs[0]["n_clients"] == 0 and recs[0]["t_e"] is None
    assert [r.get("A") for r in recs[1:]] == [0.5, 0.6, 0.6, None]
    assert [r["phase"] for r in recs] == [1, 1, 1, 1, 2]
    assert [r["t_e"] for r in recs] == [None, None, None, 3, 3]
    assert recs[1]["partition_ids"] == [0, 1, 2, 3] and recs[1]["num_examples"] == [10, 20, 30,
                                                                                   40]
    assert recs[4]["train_loss"] == pytest.approx(np.mean([0.0, 0.1, 0.2, 0.3]))
    ckpt = checkpoint.load(tmp_path)
    assert ckpt.round == 4 and ckpt.strategy["prestopper"]["t_e"] == 3
    np.testing.assert_allclose(ckpt.weights[1], init[1] + 4 * step, rtol=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["t_e"] == 3 and summary["A_max"] == 0.6 and summary["train_samples"] == 100
    assert summary["final_acc"] == recs[-1]["test_acc"] and summary["best_round"] == 4
    saved = torch.load(tmp_path / "model.pt")
    assert list(saved) == ["weight", "bias"]
    np.testing.assert_allclose(saved["bias"].numpy(), init[1] + 4 * step, rtol=1e-6)


def test_fedavg_records_carry_no_phase_and_no_prestopping(tmp_path):
    run_loop(tmp_path, "fedavg", rounds=2)
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert not {"phase", "A", "A_max", "t_e", "client_acc"} & set(r)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "t_e" not in summary and summary["method"] == "fedavg"


def test_federated_evaluation_is_recorded_every_round_and_summarized(tmp_path):
    """Flower's evaluate round through the loop: every node evaluates the global model of
    every round (round 0 included); the record holds the held-out-weighted averages."""
    run_loop(tmp_path, "fedavg", rounds=3, node=EvaluatingNode, central=False,
             **{"dataset": "npz", "data-path": "/d.npz", "evaluation": "federated"})
    recs = records(tmp_path)
    n = sum(count for count, _ in HELD_OUT.values())
    acc = sum(count * a for count, a in HELD_OUT.values() if count) / n
    for rnd, r in enumerate(recs):
        assert "test_acc" not in r
        assert r["federated_acc"] == pytest.approx(acc)
        loss = sum(count * (rnd + pid) for pid, (count, _) in HELD_OUT.items()) / n
        assert r["federated_loss"] == pytest.approx(loss)
        assert (r["federated_clients"], r["federated_samples"]) == (3, n)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy_source"] == "federated held-out data"
    assert summary["final_acc"] == summary["federated_final_acc"] == pytest.approx(acc)


def test_summary_counts_the_client_failures_and_rejections_of_a_completed_run(tmp_path):
    """A node whose data is malformed fails every round, yet the run completes: its
    summary and SUMMARY line must say so, not only metrics.jsonl."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("flwr").addHandler(handler)
    try:
        run_loop(tmp_path, "fedavg", rounds=3, node_class={3: BrokenNode, 1: LyingNode})
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    recs = records(tmp_path)
    assert [r["failures"] for r in recs[1:]] == [1, 1, 1]
    assert [r["rejected"] for r in recs[1:]] == [0, 1, 0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["client_failures"] == 3 and summary["rejected_replies"] == 1
    assert summary["rounds_with_failures"] == [1, 2, 3]
    assert summary["missed_rounds"] == {"1": [2], "3": [1, 2, 3]}
    assert summary["status"] == "degraded"  # floor(0.1 x 3) = 0 misses allowed
    assert summary["degraded"].startswith("partition 1 missed 1 of 3 rounds (rounds 2; last: "
                                          "node node-1: reply refused: ")
    assert "; partition 3 missed 3 of 3 rounds (rounds 1-3; last: node node-3: " \
           "RuntimeError: partition 3: data.npz is malformed)" in summary["degraded"]
    line = next(x for x in lines if x.startswith("SUMMARY"))
    assert "client failures 3, rejected replies 1 in 3 rounds" in line


def test_summary_of_a_clean_run_counts_no_failures(tmp_path):
    run_loop(tmp_path, "fedavg", rounds=2)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["client_failures"] == 0 and summary["rejected_replies"] == 0
    assert summary["rounds_with_failures"] == []
    assert summary["status"] == "completed" and summary["notes"] == []


def flower_lines():
    """Collects the messages Flower's logger emits while the context is open."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    return lines, handler


def test_a_round_in_which_no_node_trained_fails_the_run_with_its_reason(tmp_path):
    """Every node's data is malformed: round 1 trains nothing. The run must not go on
    and report the untrained model: it stops, its summary says failed and why, it
    writes no model, its last log line starts with RUN FAILED, and the error reaches
    Flower (which marks the run failed)."""
    lines, handler = flower_lines()
    logging.getLogger("flwr").addHandler(handler)
    try:
        with pytest.raises(RunFailed, match="round 1: no node trained"):
            run_loop(tmp_path, "fedavg", rounds=3, node=BrokenNode)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and not (tmp_path / "model.pt").exists()
    assert "4 sampled; 4 failed, e.g. node node-" in summary["failure"]
    assert ": RuntimeError: partition" in summary["failure"]
    assert [r["round"] for r in records(tmp_path)] == [0, 1]
    assert lines[-1] == f"RUN FAILED: {summary['failure']}"
    # a failed run is drawn as far as it got (issue 49)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert series(records(tmp_path)).took_part == {1: []}


class Link:
    """Stands in for the ServerApp's watched grid (fedefc_server/link_watch.py): what it
    says when an exchange may have lost messages with a restarted SuperLink."""

    lost = None


NO_GUARD = {"phase-2-guard": "off"}  # phase-2 replies carry no A_k here (test_guard.py)


class LinkLosingNode(TrainingNode):
    """Partition 2's exchange in round 2 meets a SuperLink restart: its call raises what
    the watched grid raises, and the link keeps why."""

    link = Link()

    def fit(self, ins, timeout, group_id):
        if int(ins.config["round"]) == 2 and self.partition_id == 2:
            self.link.lost = "the link to the SuperLink failed (ConnectError: refused)"
            raise LinkLost(self.link.lost)
        return super().fit(ins, timeout, group_id)


def test_a_round_that_may_have_lost_messages_is_not_recorded_and_the_run_stops(tmp_path):
    """Round 2's exchange with partition 2 was out when the SuperLink restarted. The
    three other replies came, but round 2 is not evaluated (issue 60's trial: the
    ServerApp evaluated the lost round for 35 s - 5.5 min before it stopped), recorded
    or checkpointed, no summary and no model are written, the last log line starts
    with RUN INTERRUPTED and names the checkpoint to resume from (round 1), and the
    error reaches Flower. Resumed, the run records the interruption in round 2's record,
    its summary and its picture."""
    lines, handler = flower_lines()
    logging.getLogger("flwr").addHandler(handler)
    LinkLosingNode.link = Link()
    evaluated: list = []
    try:
        with pytest.raises(LinkLost, match="round 2: the link to the SuperLink failed"):
            run_loop(tmp_path, "fedefc", rounds=4, node=LinkLosingNode,
                     link=LinkLosingNode.link, evaluated=evaluated, **NO_GUARD)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert len(evaluated) == 2  # rounds 0 and 1: not the round that lost its exchange
    assert [r["round"] for r in records(tmp_path)] == [0, 1]
    assert checkpoint.load(tmp_path).round == 1
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "model.pt").exists()
    assert lines[-1].startswith("RUN INTERRUPTED: round 2: the link to the SuperLink failed")
    assert "its checkpoint of round 1 is kept" in lines[-1]
    assert f"--resume {tmp_path}" in lines[-1]
    # issue 49's trial: the command as printed failed on a signed deployment without it
    assert "with the first submission's --sign-key (and --key-id)" in lines[-1]

    run_loop(tmp_path, "fedefc", rounds=4, resume=True, **NO_GUARD)
    recs = records(tmp_path)
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4]
    assert [r["round"] for r in recs if r.get("resumed")] == [2]
    assert recs[2]["resumed"]["reason"] == (
        "round 2: the link to the SuperLink failed (ConnectError: refused)")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(e["round"], e["reason"]) for e in summary["interruptions"]] == [
        (2, recs[2]["resumed"]["reason"])]
    assert series(recs).resumed == [2]
    assert not (tmp_path / "interrupted.json").exists()  # taken by the resumed run


def test_a_run_stopped_from_outside_is_recorded_as_resumed_without_a_reason_of_its_own(
        tmp_path):
    """A ServerApp killed after round 2 leaves no word; the resumed run says so in round
    3's record. A run extended after it completed was not interrupted: nothing marked."""
    run_loop(tmp_path, "fedavg", rounds=2)
    (tmp_path / "summary.json").unlink()  # as a kill before the end leaves it
    (tmp_path / "model.pt").unlink()
    run_loop(tmp_path, "fedavg", rounds=3, resume=True)
    recs = records(tmp_path)
    assert recs[3]["resumed"]["reason"] == (
        "the run stopped after round 2 without a word from its ServerApp (its process, "
        "its SuperExec or the SuperLink stopped it)")
    run_loop(tmp_path, "fedavg", rounds=4, resume=True)  # extended: completed before
    assert [r["round"] for r in records(tmp_path) if r.get("resumed")] == [3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [e["round"] for e in summary["interruptions"]] == [3]


def test_fedefc_that_never_leaves_phase_1_says_so_last(tmp_path):
    """A(t) rises every round: no T_e. The run completes, but its summary and its last
    log line say in plain words that the correction never ran."""
    lines, handler = flower_lines()
    logging.getLogger("flwr").addHandler(handler)
    try:
        run_loop(tmp_path, "fedefc", rounds=2)  # A(t) 0.5, 0.6: still rising
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["t_e"] is None
    (note,) = summary["notes"]
    assert note.startswith("fedefc never left phase 1") and "still rising" in note
    assert lines[-1] == f"NOTE: {note}"


def test_a_dp_run_reports_its_epsilon_over_every_round(tmp_path):
    """The summary carries the accountant's guarantee for the run's noise, its rounds and
    its delta (no amplification by the seeded sampling)."""
    run_loop(tmp_path, "fedavg", rounds=2, **{"dp-clip": 1.0, "dp-noise-multiplier": 1.0,
                                              "fraction": 0.5})
    dp = json.loads((tmp_path / "summary.json").read_text())["dp"]
    assert (dp["rounds"], dp["delta"], dp["noise_multiplier"]) == (2, 1e-5, 1.0)
    assert dp["epsilon"] == pytest.approx(epsilon(1.0, 2, 1e-5))
    assert dp["epsilon_secret_sampling"] < dp["epsilon"] and dp["sampling_rate"] == 0.5


# what Flower's proxy raises for a node that went away mid-message (Flower 1.42)
NODE_GONE = ("Message contains an Error (reason: Node Unavailable). It originated during "
             "client-side execution of a message.")


class LeavingNode(TrainingNode):
    """A SuperNode killed during round ``LEAVES``: that round's message fails (as
    Flower's "Node Unavailable") and the node is gone from the client manager after."""

    LEAVES = 2
    manager: SimpleClientManager | None = None

    def fit(self, ins, timeout, group_id):
        if int(ins.config["round"]) >= self.LEAVES:
            self.manager.unregister(self)
            raise ValueError(NODE_GONE)
        return super().fit(ins, timeout, group_id)


def with_leaving_node(manager):
    LeavingNode.manager = manager


def test_a_site_lost_mid_run_is_named_every_round_and_the_run_ends_degraded(tmp_path):
    """Partition 2's node dies in round 2 of 4: round 2's record and log name it, its node
    and the error; rounds 3-4 name it as no longer connected; the summary lists the three
    rounds it missed; 3 of 4 rounds is more than max-missed-share=0.1 allows, so the run
    ends degraded (the model is still written), RUN DEGRADED the last log line."""
    lines, handler = flower_lines()
    logging.getLogger("flwr").addHandler(handler)
    try:
        run_loop(tmp_path, "fedavg", rounds=4, node_class={2: LeavingNode},
                 on_manager=with_leaving_node)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    recs = records(tmp_path)
    assert [r.get("missing") for r in recs[:2]] == [None, None]
    (lost,) = recs[2]["missing"]
    assert lost == {"partition": 2, "node": "node-2", "reason": "error reply: Node Unavailable"}
    for r in recs[3:]:
        assert r["missing"] == [{"partition": 2, "node": "node-2",
                                 "reason": "its node is no longer connected"}]
        assert r["partition_ids"] == [0, 1, 3]
    for rnd in (2, 3, 4):
        line = next(x for x in lines if x.startswith(f"[round {rnd}/4] missed by"))
        assert "partition 2 (node node-2)" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["missed_rounds"] == {"2": [2, 3, 4]}
    assert summary["status"] == "degraded" and (tmp_path / "model.pt").exists()
    assert summary["degraded"].startswith("partition 2 missed 3 of 4 rounds (rounds 2-4")
    assert "max-missed-share=0.1" in summary["degraded"]
    assert lines[-1] == f"RUN DEGRADED: {summary['degraded']}"
    drawn = series(recs)  # the picture shows partition 2 missing from round 2 on
    assert drawn.missed == {1: [], 2: [2], 3: [2], 4: [2]}
    assert drawn.took_part == {1: [0, 1, 2, 3], 2: [0, 1, 3], 3: [0, 1, 3], 4: [0, 1, 3]}
    assert (tmp_path / "curves.png").exists()


class FlakyNode(TrainingNode):
    """Fails in the rounds of ``FAILS`` only."""

    FAILS: set[int] = set()

    def fit(self, ins, timeout, group_id):
        if int(ins.config["round"]) in self.FAILS:
            raise RuntimeError("transient: out of memory")
        return super().fit(ins, timeout, group_id)


@pytest.mark.parametrize("fails, share, status", [
    ({3}, 0.1, "completed"),  # 1 missed of 10: floor(0.1 x 10) = 1 allowed
    ({3, 7}, 0.1, "degraded"),  # 2 missed of 10
    ({3, 7}, 0.2, "completed"),  # the coordinator allows 2
    ({3}, 0.0, "degraded"),  # none allowed
])
def test_a_site_may_miss_as_many_rounds_as_max_missed_share_allows(tmp_path, monkeypatch,
                                                                   fails, share, status):
    monkeypatch.setattr(FlakyNode, "FAILS", fails)
    run_loop(tmp_path, "fedavg", rounds=10, node_class={1: FlakyNode},
             **{"max-missed-share": share})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["missed_rounds"] == {"1": sorted(fails)}
    assert summary["status"] == status
    assert ("degraded" in summary) == (status == "degraded")
    for r in records(tmp_path)[1:]:
        expected = [1] if r["round"] in fails else []
        assert [a["partition"] for a in r.get("missing", [])] == expected
        assert 1 in r["partition_ids"] or r["round"] in fails


class EvaluationDies(EvaluatingNode):
    """Its federated evaluation of round 3 fails (the node died during it)."""

    def evaluate(self, ins, timeout, group_id):
        if int(ins.config["round"]) == 3:
            raise ValueError(NODE_GONE)
        return super().evaluate(ins, timeout, group_id)


def test_a_failed_federated_evaluation_is_counted_and_named(tmp_path):
    """A node dies during the last federated evaluation: the final accuracy comes from
    the others, and the summary says so (it used to count 0 failures)."""
    run_loop(tmp_path, "fedavg", rounds=3, node=EvaluatingNode, central=False,
             node_class={2: EvaluationDies},
             **{"dataset": "npz", "data-path": "/d.npz", "evaluation": "federated"})
    last = records(tmp_path)[-1]
    assert last["federated_failures"] == 1 and last["federated_clients"] == 2
    (miss,) = last["federated_missing"]
    assert miss == {"partition": 2, "node": "node-2", "reason": "error reply: Node Unavailable"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["federated_failures"] == 1 and summary["missed_evaluations"] == {"2": [3]}
    assert summary["missed_rounds"] == {} and summary["status"] == "completed"
