"""A run told in a few lines and a picture (issue 49, item 6): the human summary that
``fedefc run``, ``fedefc deploy submit`` and ``fedefc deploy fetch`` print
(fedefc_server/summary.py: run_report), the picture every run writes
(fedefc_server/curves.py), the progress line on a terminal (fedefc_cli/progress.py),
and durations in words (common/durations.py).

The picture's series are checked against a hand-written metrics.jsonl; that a real
Flower run writes it is checked on tests/test_simulation.py's shared run, and that an
in-process failed or degraded run does on tests/test_round_loop.py's.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest

from common.durations import duration_text
from common.methods import load_run_config
from common.results import RunRecorder
from fedefc_cli import deploy_submit
from fedefc_cli.flower import RunOutcome, copy_lines, to_terminal
from fedefc_cli.main import main
from fedefc_cli.progress import RoundProgress
from fedefc_server import curves
from fedefc_server.curves import FILE, series, write_curves
from fedefc_server.summary import RunFacts, build_summary, guard_verdict, run_report

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("seconds, text", [
    (299.99999873800016, "5 min 00 s"),  # issue 49: the rest of a 300 s wait
    (0.04, "0.0 s"), (2.46, "2.5 s"), (9.96, "10 s"), (47.6, "48 s"), (119.4, "119 s"),
    (125.0, "2 min 05 s"), (3599.4, "59 min 59 s"), (3661.0, "1 h 01 min"),
    (None, "no limit"), (float("inf"), "no limit")])
def test_a_duration_is_told_in_words(seconds, text):
    assert duration_text(seconds) == text


# -- the human summary ----------------------------------------------------------------------
SUMMARY = {
    "method": "fedefc", "dataset": "mnist-embedded", "seed": 3, "rounds": 40,
    "rounds_run": 24, "status": "degraded",
    "degraded": "partition 2 missed 5 of 24 rounds (rounds 3-6, 9; last: node 77: its "
                "node is no longer connected); more than max-missed-share=0.1 allows",
    "final_acc": 0.86, "best_acc": 0.8861, "best_round": 20, "mean_last10_acc": 0.86444,
    "mean_last10_rounds": 10, "accuracy_source": "server test set",
    "federated_final_acc": 0.7, "federated_best_acc": 0.75, "federated_best_round": 12,
    "federated_mean_last10_acc": 0.71, "federated_mean_last10_rounds": 10,
    "t_e": 14, "A_max": 0.80961, "phase_2_guard": "on", "guard_restored_round": 19,
    "guard_ended_at": 24, "guard_fell_back_at": None,
    "client_failures": 2, "rejected_replies": 0, "federated_failures": 0,
    "federated_rejected": 1, "missed_rounds": {"2": [3, 4, 5, 6, 9]},
    "missed_evaluations": {"2": [3, 4]}, "notes": ["a note in plain words"],
    "wall_time_s": 754.3, "machine": {"cpu": "x86"}, "out_dir": "/srv/runs/r1",
}


def test_the_summary_is_told_in_a_few_lines(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / FILE).write_bytes(PNG)
    assert run_report(json.loads((tmp_path / "summary.json").read_text()), tmp_path) == [
        "fedefc on mnist-embedded, seed 3: DEGRADED after 24 of 40 rounds in 12 min 34 s",
        f"  degraded: {SUMMARY['degraded']}",
        "  accuracy (server test set): final 0.8600 | best 0.8861 (round 20) | mean of last "
        "10 rounds 0.8644",
        "  federated accuracy (the nodes' held-out data): final 0.7000 | best 0.7500 (round "
        "12) | mean of last 10 rounds 0.7100",
        "  T_e 14 (A_max 0.8096), phase 2 from round 15; phase-2 guard: restored the model "
        "round 19 received and ended the run after round 24",
        "  sites missing: partition 2 missed 5 rounds (3-6, 9)",
        "  federated evaluations missed: partition 2 2 (3-4)",
        "  2 client failures, 1 refused federated evaluations (reasons: metrics.jsonl)",
        "  note: a note in plain words",
        f"  files: {tmp_path} (summary.json, metrics.jsonl, curves.png, ...)"]


def test_a_failed_run_says_why_and_a_plain_one_has_no_guard_or_absences():
    failed = run_report({"method": "fedavg", "dataset": "npz", "seed": 0, "rounds": 5,
                         "rounds_run": 1, "status": "failed", "wall_time_s": 3.04,
                         "failure": "round 1: no node trained", "notes": [],
                         "out_dir": "/nowhere/r"})
    assert failed == ["fedavg on npz, seed 0: FAILED with 1 of 5 rounds recorded in 3.0 s",
                      "  why: round 1: no node trained", "  files: /nowhere/r"]
    assert guard_verdict({"phase_2_guard": "on", "t_e": 7, "guard_fell_back_at": 9}) == (
        "phase-2 guard: restored its best model after round 9 and went on with "
        "cross-entropy, then kept that training to the end")
    assert guard_verdict({"phase_2_guard": "on", "t_e": 7, "guard_fell_back_at": 9,
                          "guard_restored_round": 11, "guard_ended_at": 14}) == (
        "phase-2 guard: restored its best model after round 9 and went on with "
        "cross-entropy, then restored the model round 11 received and ended the run after "
        "round 14")
    assert guard_verdict({"phase_2_guard": "on", "t_e": 7, "rounds": 20,
                          "guard_restored_round": 11, "guard_ended_at": 20}) == (
        "phase-2 guard: restored the model round 11 received at the end of the run")
    assert guard_verdict({"phase_2_guard": "on", "t_e": 7, "guard_ended_at": None}) == (
        "phase-2 guard: kept phase 2 to the end")
    assert guard_verdict({"phase_2_guard": "on", "t_e": None}) == (
        "phase-2 guard: no phase 2 to judge")
    never = run_report({"status": "completed", "t_e": None, "phase_2_guard": "off"})
    assert never[1] == ("  T_e none: the run never left phase 1 (it trained as FedAvg); "
                        "phase-2 guard off")


def test_the_few_lines_tell_the_records_figures(tmp_path):
    """From a run's records to its few lines through the recorder and build_summary that
    a run uses; every figure recomputed here from the accuracies by hand."""
    test_acc = [0.10, 0.42, 0.55, 0.61, 0.60, 0.66, 0.71, 0.69, 0.74, 0.73, 0.77, 0.75,
                0.76]  # rounds 0-12
    recorder = RunRecorder(tmp_path / "run", {"rounds": 12})
    for t, acc in enumerate(test_acc):
        recorder.write_round({"round": t, "test_acc": acc, **(
            {"partition_ids": [0, 2], "missing": [{"partition": 1, "node": "n1",
                                                    "reason": "gone"}]}
            if t in (7, 8) else {"partition_ids": [0, 1, 2]} if t else {})})
    cfg = load_run_config({"num-clients": 3, "fraction": 1.0, "rounds": 12,
                           "max-missed-share": 0.5})
    facts = RunFacts({}, {"t_e": 5, "A_max": 0.6543, "phase_2_guard": "on",
                          "guard_restored_round": None, "guard_ended_at": None,
                          "guard_fell_back_at": None}, wall_time_s=83.0)
    summary = recorder.write_summary(build_summary(cfg, recorder.rounds, facts))
    lines = run_report(summary)
    trained = test_acc[1:]
    last10 = sum(trained[-10:]) / 10  # rounds 3-12
    best = max(trained)
    assert lines[0] == (f"fedefc on {cfg.dataset}, seed {cfg.seed}: completed after 12 of 12 "
                        "rounds in 83 s")
    assert lines[1] == (f"  accuracy (server test set): final {trained[-1]:.4f} | best "
                        f"{best:.4f} (round {trained.index(best) + 1}) | mean of last 10 "
                        f"rounds {last10:.4f}")
    assert lines[2] == ("  T_e 5 (A_max 0.6543), phase 2 from round 6; phase-2 guard: kept "
                        "phase 2 to the end")
    assert lines[3] == "  sites missing: partition 1 missed 2 rounds (7-8)"
    assert lines[-1] == (f"  files: {tmp_path / 'run'} (summary.json, metrics.jsonl, "
                         "config.json, ...)")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_run"] == 12


def test_fetch_ends_with_the_few_lines_not_json(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "metrics.jsonl", "model.pt"):
        (run / name).write_text("{}")
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    assert main(["deploy", "fetch", str(run), str(tmp_path / "here")]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == run_report(SUMMARY, tmp_path / "here")
    assert "{" not in out


def test_fedefc_run_ends_with_the_few_lines_not_json(monkeypatch, capsys, tmp_path):
    """No Flower: the job is replaced by the summary it would return (a degraded one)."""
    from fedefc_cli import simulation
    told = {**SUMMARY, "out_dir": str(tmp_path / "r")}
    monkeypatch.setattr(simulation, "preflight_in_child", lambda cfg: None)
    monkeypatch.setattr(simulation, "run_simulation_job", lambda *a, **k: told)
    assert main(["run", "--out-dir", str(tmp_path / "r")]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[-len(run_report(told)):] == run_report(told)
    assert "{" not in out


@pytest.mark.parametrize("status, code", [("finished:completed", 0),
                                          ("finished:failed", 1)])
def test_submit_ends_with_the_few_lines_where_the_out_dir_is_here(monkeypatch, capsys,
                                                                  tmp_path, status, code):
    """No SuperLink: Flower's part of submit is replaced by its outcome, the out-dir
    written as the ServerApp would (on this machine, as in the one-machine quick start)."""
    out_dir = tmp_path / "r"
    out_dir.mkdir()
    told = {**SUMMARY, "degraded": None, "out_dir": str(out_dir), **(
        {"status": "completed"} if code == 0 else
        {"status": "failed", "failure": "round 25: no node trained"})}
    (out_dir / "summary.json").write_text(json.dumps(told))
    monkeypatch.setattr(deploy_submit, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(deploy_submit, "active_runs", lambda *a, **k: [])
    monkeypatch.setattr(deploy_submit, "submit_run", lambda *a, **k: RunOutcome("42", status, None))
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={out_dir}"]) == code
    out = capsys.readouterr().out
    assert "\n".join(run_report(told, out_dir)) in out
    assert "{" not in out
    (out_dir / "summary.json").unlink()  # submitted from another machine: nothing to tell
    assert main(["deploy", "submit", "fedefc", "--set", f"out-dir={out_dir}"]) == code
    assert "accuracy" not in capsys.readouterr().out


# -- the picture ----------------------------------------------------------------------------
def hand_written_records() -> list[dict]:
    """Six rounds of a FedEFC run with the guard: T_e = 2; the guard's verdicts on rounds
    4 (not better), 5 (a new best) and 6 (not better); partition 1 missed round 3."""
    recs = [{"round": 0, "test_acc": 0.10, "federated_acc": 0.12, "A_max": 0.0,
             "t_e": None, "guard_best_round": None, "guard_worse": 0, "n_clients": 0}]
    a = {1: 0.40, 2: 0.35, 3: 0.50, 4: 0.45, 5: 0.60, 6: 0.55}
    best = {1: 1, 2: 1, 3: 3, 4: 3, 5: 5, 6: 5}
    worse = {1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 1}
    for t in range(1, 7):
        recs.append({"round": t, "test_acc": 0.1 * t, "federated_acc": 0.09 * t,
                     "A": a[t], "A_max": 0.40, "t_e": 2 if t >= 2 else None,
                     "phase": 1 if t <= 2 else 2, "guard_best_round": best[t],
                     "guard_worse": worse[t],
                     "partition_ids": [0, 2] if t == 3 else [0, 1, 2],
                     **({"missing": [{"partition": 1, "node": "n1", "reason": "left"}]}
                        if t == 3 else {})})
    return recs


def test_the_pictures_series_are_the_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in hand_written_records()))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    data = series(recs)
    assert data.rounds == list(range(7))
    assert data.test_acc == [0.10, *(0.1 * t for t in range(1, 7))]
    assert data.federated_acc == [0.12, *(0.09 * t for t in range(1, 7))]
    assert data.a == {1: 0.40, 2: 0.35, 3: 0.50, 4: 0.45, 5: 0.60, 6: 0.55}
    assert data.a_max == {t: 0.40 for t in range(1, 7)}
    assert data.t_e == 2
    # round 3's received model is phase 1's (T_e + 1): its new best is not a verdict
    assert (data.guard_best, data.guard_worse) == ([5], [4, 6])
    assert data.took_part == {t: [0, 2] if t == 3 else [0, 1, 2] for t in range(1, 7)}
    assert data.missed == {t: [1] if t == 3 else [] for t in range(1, 7)}


def test_curves_png_is_a_picture_of_sane_size(tmp_path):
    summary = {"method": "fedefc", "dataset": "npz", "seed": 0, "status": "completed",
               "final_acc": 0.6, "best_acc": 0.6, "best_round": 6,
               "guard_restored_round": 5, "guard_ended_at": 6}
    path = write_curves(tmp_path, hand_written_records(), summary, 3)
    assert path == tmp_path / FILE
    assert png_size(path) == (1000, 860)
    assert 20_000 < path.stat().st_size < 400_000
    # without A(t) (FedAvg) two panels; a failed run's records as far as they got
    (tmp_path / "failed").mkdir()
    failed = write_curves(tmp_path / "failed", [{"round": 0, "test_acc": 0.1}],
                          {"status": "failed", "failure": "no node trained"}, 100)
    assert png_size(failed) == (1000, 640)


def test_write_curves_draws_the_records_series(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(curves, "draw", lambda *args: drawn.append(args))
    summary = {"status": "completed"}
    assert write_curves(tmp_path, hand_written_records(), summary, 3) == tmp_path / FILE
    [(data, told, partitions, path)] = drawn
    assert data == series(hand_written_records())
    assert (told, partitions, path) == (summary, 3, tmp_path / FILE)


def test_a_picture_that_cannot_be_drawn_never_fails_the_run(tmp_path):
    assert write_curves(tmp_path / "no such folder", hand_written_records(), {}, 3) is None


# -- the progress line ----------------------------------------------------------------------
def test_a_progress_line_follows_each_new_round_on_a_terminal_only():
    now = iter([100.0, 104.0, 112.0, 124.0])
    progress = RoundProgress(clock=lambda: next(now))
    assert progress.after("INFO : [round 0/4] initial model: test acc 0.1") is None
    assert progress.after("INFO : [round 1/4] 3 clients | test acc 0.5") == (
        "fedefc: round 1 of 4 done, 4.0 s a round, about 12 s left")
    assert progress.after("WARNING : [round 1/4] missed by partition 2") is None  # same round
    assert progress.after("INFO : some other line") is None
    assert progress.after("INFO : [round 2/4] 3 clients") == (
        "fedefc: round 2 of 4 done, 6.0 s a round, about 12 s left")
    assert progress.after("INFO : [round 4/4] 3 clients") == (
        "fedefc: round 4 of 4 done, 6.0 s a round")
    log = b"INFO : [round 0/2] x\nINFO : [round 1/2] y\nINFO : [round 2/2] z\n"
    for terminal in (True, False):
        out = io.BytesIO()
        lines = copy_lines(io.BytesIO(log), out, terminal)
        assert lines == log.decode().splitlines()  # what is parsed: the log alone
        assert (b"fedefc: round 1 of 2 done" in out.getvalue()) == terminal
        assert (b"fedefc: round 2 of 2 done" in out.getvalue()) == terminal
    assert out.getvalue() == log  # a redirected log is the log, nothing added


@pytest.mark.parametrize("tty", [True, False])
def test_the_progress_line_is_for_a_terminal_stdout_only(monkeypatch, tty):
    monkeypatch.setattr("sys.stdout", type("Out", (), {"isatty": lambda self: tty})())
    assert to_terminal(None) is tty
    assert to_terminal(io.BytesIO()) is False  # a log file given: never
