"""A run's summary: built from its rounds' records in one place (:func:`build_summary`),
told in another (:func:`summary_lines`, :func:`tell`: the ServerApp's log), and told to a
person in a few lines at the end of ``fedefc run``, ``fedefc deploy submit`` and
``fedefc deploy fetch`` (:func:`run_report`; the whole of it stays in ``summary.json``).

The status is one of three (docs/RELIABILITY.md):

- ``failed``: the run could not produce a result (:class:`.failures.RunFailed`); no
  model is written and the last log line is ``RUN FAILED: <reason>``;
- ``degraded``: it completed, but a partition missed more training rounds than
  ``max-missed-share`` allows (:func:`.attendance.degradation`), or a secure round was
  refused and kept the global model (:func:`refused_rounds`); the model is written and
  the last log line is ``RUN DEGRADED: <reason>``;
- ``completed``.

A run stopped because a restarted SuperLink may have lost a round's messages
(:mod:`.link_watch`) has no summary yet: its last log line is ``RUN INTERRUPTED:
<reason>``, and resuming it from its checkpoint finishes it.

The summary says which nodes the run admitted and how their declared sizes were
bounded (``admission``: :func:`.declarations.admission`), and which bound one update
had (``update_bound``: :func:`common.update_bound.bound_text`). It also counts what went wrong
on the way: client failures and refused replies, failed and refused federated
evaluations, and per partition the rounds it missed (``missed_rounds``) and the
federated evaluations it missed (``missed_evaluations``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from common.config import RunConfig
from common.dp_accounting import run_guarantee
from common.durations import duration_text
from common.results import machine_record
from common.update_bound import bound_text

from .attendance import degradation, last_reasons, missed_by_partition, ranges
from .curves import FILE as CURVES
from .resumes import interruptions

FAILED_PREFIX = "RUN FAILED: "  # the last log line of a failed run
DEGRADED_PREFIX = "RUN DEGRADED: "  # the last log line of a degraded run
INTERRUPTED_PREFIX = "RUN INTERRUPTED: "  # a run stopped to be resumed (.link_watch)


@dataclass(frozen=True)
class RunFacts:
    """What the summary is built from besides the records: the run's data facts, the
    method's summary fields and notes, the wall time, and why it failed (if it did)."""

    run_info: dict[str, Any]
    method_fields: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    wall_time_s: float = 0.0
    failure: str | None = None


def count(rounds: list[dict[str, Any]], key: str) -> int:
    return sum(int(r.get(key) or 0) for r in rounds)


def refusal(record: dict[str, Any]) -> str | None:
    """Why a secure round was refused and kept the global model (its sum failed its
    checks, ``refused_sum``, or the round stopped before it, ``secure_refused``), or
    None."""
    return record.get("refused_sum") or record.get("secure_refused")


def refused_rounds(rounds: list[dict[str, Any]]) -> list[int]:
    """The training rounds that a refusal left without an update (:func:`refusal`)."""
    return [r["round"] for r in rounds if r.get("round", 0) > 0 and refusal(r)]


def refused_text(rounds: list[dict[str, Any]]) -> str | None:
    """The refused rounds in words, with the last one's reason (None: none)."""
    refused = refused_rounds(rounds)
    if not refused:
        return None
    last = next(refusal(r) for r in reversed(rounds) if r.get("round") == refused[-1])
    trained = sum(1 for r in rounds if r.get("round", 0) > 0)
    return (f"{len(refused)} of {trained} rounds refused (rounds {ranges(refused)}): each "
            f"kept the global model; last: {last}")


def build_summary(cfg: RunConfig, rounds: list[dict[str, Any]], facts: RunFacts
                  ) -> dict[str, Any]:
    """The summary's fields (the recorder adds the accuracies): status and why, the
    method's fields, the DP guarantee, and every count of what went wrong."""
    trained = [r for r in rounds if r.get("round", 0) > 0]
    missed = missed_by_partition(trained)
    degraded = None if facts.failure else "; ".join(filter(None, (
        refused_text(trained), degradation(missed, len(trained), cfg.max_missed_share,
                                           last_reasons(trained))))) or None
    status = "failed" if facts.failure else "degraded" if degraded else "completed"
    dp = run_guarantee(cfg)
    return {
        **facts.run_info, "method": cfg.method, "dataset": cfg.dataset, "seed": cfg.seed,
        "rounds": cfg.rounds, "rounds_run": len(trained), "status": status,
        **({"failure": facts.failure} if facts.failure else {}),
        **({"degraded": degraded} if degraded else {}),
        "notes": [] if facts.failure else facts.notes,
        **({"dp": dp.as_record()} if dp else {}),
        "update_bound": bound_text(cfg),
        **facts.method_fields,
        "client_failures": count(rounds, "failures"),
        "rejected_replies": count(rounds, "rejected"),
        "refused_rounds": refused_rounds(trained),
        "rounds_with_failures": [r["round"] for r in rounds
                                 if r.get("failures") or r.get("rejected")],
        "missed_rounds": missed,
        "federated_failures": count(rounds, "federated_failures"),
        "federated_rejected": count(rounds, "federated_rejected"),
        "missed_evaluations": missed_by_partition(rounds, "federated_missing"),
        "interruptions": interruptions(rounds),
        "wall_time_s": facts.wall_time_s,
        "machine": machine_record(),
    }


def _accuracy_text(summary: dict[str, Any]) -> tuple[str, str]:
    """(where the final accuracy comes from, the federated figure beside it)."""
    source = summary.get("accuracy_source", "no evaluation")
    true = summary.get("federated_true_final_acc")
    true = "" if true is None else f"; true labels {true:.4f}"
    federated = ""
    if source == "server test set" and summary.get("federated_final_acc") is not None:
        federated = f" | federated final acc {summary['federated_final_acc']:.4f}"
        federated += f" (held-out data{true})" if true else ""
    else:
        source += true
    return source, federated


def _trouble_text(summary: dict[str, Any]) -> str:
    """The SUMMARY line's counts of what went wrong."""
    text = (f"client failures {summary['client_failures']}, rejected replies "
            f"{summary['rejected_replies']}")
    if summary["rounds_with_failures"]:
        text += f" in {len(summary['rounds_with_failures'])} rounds (reasons: metrics.jsonl)"
    if summary.get("refused_rounds"):
        text += f" | refused rounds {len(summary['refused_rounds'])} (global model kept)"
    missed = summary.get("missed_rounds") or {}
    if missed:
        text += " | missed rounds: " + ", ".join(
            f"partition {pid} {len(rounds)}" for pid, rounds in missed.items())
    if summary.get("interruptions"):
        text += f" | resumed {resumed_text(summary['interruptions'])}"
    if summary.get("federated_failures") or summary.get("federated_rejected") or \
            summary.get("missed_evaluations"):
        text += (f" | federated evaluations failed {summary.get('federated_failures', 0)}, "
                 f"refused {summary.get('federated_rejected', 0)}")
        missed = summary.get("missed_evaluations") or {}
        if missed:
            text += ", missed by partitions " + ", ".join(missed)
    return text


def resumed_text(events: list[dict[str, Any]]) -> str:
    """``2 times (rounds 2, 4 run again)``: a run's resumes (:mod:`.resumes`)."""
    rounds = ", ".join(str(e["round"]) for e in events)
    return (f"{len(events)} time{'s' * (len(events) > 1)} (round{'s' * (len(events) > 1)} "
            f"{rounds} run again)")


def admission_text(admitted: dict[str, Any]) -> str:
    """Which nodes the run admitted, and up to what declared sizes
    (:func:`.declarations.admission`)."""
    who = {"allowlist": "the nodes on the allowlist",
           "simulation": "Flower's simulated nodes, node i for partition i",
           "open-deployment": "any node that connected (open-deployment, no allowlist)"}
    bound = admitted["bound"]
    if admitted["max_declared_samples"] is not None:
        bound = (f"at most {admitted['max_declared_samples']} training and "
                 f"{admitted['max_declared_held_out']} held-out samples ({bound})")
    return f"nodes admitted: {who[admitted['mode']]}; declared sizes: {bound}"


def summary_lines(summary: dict[str, Any], dp_text: str | None = None
                  ) -> list[tuple[int, str]]:
    """The log lines that tell the summary, as (level, text), in order: the DP
    guarantee, the SUMMARY line, where the results are, the notes, and for a failed or
    degraded run its reason last."""
    lines: list[tuple[int, str]] = []
    if dp_text:
        lines.append((INFO, dp_text))
    t_e = f" | T_e {summary['t_e']}" if "t_e" in summary else ""
    source, federated = _accuracy_text(summary)
    lines.append((INFO, (
        f"SUMMARY | final acc {summary.get('final_acc', float('nan')):.4f} ({source})"
        f"{federated} | best {summary.get('best_acc', float('nan')):.4f} (round "
        f"{summary.get('best_round')}) | mean of last {summary.get('mean_last10_rounds', 0)} "
        f"{summary.get('mean_last10_acc', float('nan')):.4f}{t_e} | {_trouble_text(summary)} "
        f"| wall time {summary['wall_time_s']:.1f} s")))
    lines.append((INFO, f"results: {summary['out_dir']}"))
    if "admission" in summary:
        lines.append((INFO, admission_text(summary["admission"])))
    if "update_bound" in summary:
        lines.append((INFO, f"update bound: {summary['update_bound']}"))
    lines += [(WARNING, f"NOTE: {note}") for note in summary["notes"]]
    if summary["status"] == "failed":
        lines.append((ERROR, FAILED_PREFIX + summary["failure"]))
    elif summary["status"] == "degraded":
        lines.append((ERROR, DEGRADED_PREFIX + summary["degraded"]))
    return lines


def tell(summary: dict[str, Any], cfg: RunConfig) -> None:
    """Log :func:`summary_lines`."""
    dp = run_guarantee(cfg)
    for level, text in summary_lines(summary, dp.describe() if dp else None):
        log(level, "%s", text)


def _figures(summary: dict[str, Any], prefix: str = "") -> str:
    """``final 0.8600 | best 0.8860 (round 36) | mean of last 10 rounds 0.8644``."""
    final, best = summary.get(f"{prefix}final_acc"), summary.get(f"{prefix}best_acc")
    text = f"final {final:.4f}" if final is not None else "final n/a"
    if best is not None:
        text += f" | best {best:.4f} (round {summary.get(f'{prefix}best_round')})"
    last = summary.get(f"{prefix}mean_last10_acc")
    if last is not None:
        text += (f" | mean of last {summary.get(f'{prefix}mean_last10_rounds', 10)} rounds "
                 f"{last:.4f}")
    return text


def guard_verdict(summary: dict[str, Any]) -> str:
    """What the phase-2 guard (docs/FEDEFC.md §3.4; its fallback §3.7) decided, in
    words."""
    if summary.get("phase_2_guard") != "on":
        return "phase-2 guard off"
    fell = summary.get("guard_fell_back_at")
    first = (f"restored its best model after round {fell} and went on with cross-entropy, "
             "then " if fell is not None else "")
    ended = summary.get("guard_ended_at")
    if ended is not None:
        when = ("at the end of the run" if ended == summary.get("rounds") else
                f"and ended the run after round {ended}")
        return (f"phase-2 guard: {first}restored the model round "
                f"{summary.get('guard_restored_round')} received {when}")
    if fell is not None:
        return f"phase-2 guard: {first}kept that training to the end"
    if summary.get("t_e") is None:
        return "phase-2 guard: no phase 2 to judge"
    return "phase-2 guard: kept phase 2 to the end"


def delivered_text(summary: dict[str, Any]) -> str:
    """Which model a run with a guard signal delivered, its reading and why, in one line
    ('' without one: docs/FEDEFC.md §3.4, §3.9)."""
    after = summary.get("delivered_after_round")
    if after is None:
        return ""
    reading = summary.get("delivered_reading")
    read = (f", reading {reading:.4f} on {summary.get('guard_signal')}"
            if reading is not None else "")
    return f"delivered: the model after round {after}{read}; {summary.get('delivered_why')}"


def _sites(summary: dict[str, Any]) -> list[str]:
    """The partitions that missed training rounds or federated evaluations, and the
    failures counted over the run."""
    missed = summary.get("missed_rounds") or {}
    lines = ["sites missing: " + ("; ".join(
        f"partition {pid} missed {len(r)} rounds ({ranges(r)})" for pid, r in missed.items())
        if missed else "none (every sampled partition trained in every round)")]
    evaluations = summary.get("missed_evaluations") or {}
    if evaluations:
        lines.append("federated evaluations missed: " + "; ".join(
            f"partition {pid} {len(r)} ({ranges(r)})" for pid, r in evaluations.items()))
    refused = summary.get("refused_rounds") or []
    if refused:
        lines.append(f"rounds refused: {len(refused)} ({ranges(refused)}), each kept the "
                     "global model (reasons: metrics.jsonl)")
    trouble = [f"{summary[k]} {what}" for k, what in (
        ("client_failures", "client failures"), ("rejected_replies", "rejected replies"),
        ("federated_failures", "failed federated evaluations"),
        ("federated_rejected", "refused federated evaluations")) if summary.get(k)]
    if trouble:
        lines.append(", ".join(trouble) + " (reasons: metrics.jsonl)")
    events = summary.get("interruptions") or []
    if events:
        lines.append(f"interrupted and resumed {resumed_text(events)}; last: "
                     f"{events[-1]['reason']} (every one: summary.json, interruptions)")
    return lines


def run_report(summary: dict[str, Any], folder: str | Path | None = None) -> list[str]:
    """A run told in a few lines, from its summary: how it ended, after how many rounds
    and how long; its accuracies (final, best, mean of the last 10 rounds); T_e and the
    phase-2 guard's verdict; the sites that missed rounds; the notes; and where its
    files are (``folder``, by default the summary's ``out_dir``: the files listed when it
    is on this machine)."""
    status = str(summary.get("status", "completed"))
    done, planned = summary.get("rounds_run"), summary.get("rounds")
    took = summary.get("wall_time_s")
    recorded = " recorded" if status == "failed" else ""  # its last round may have failed
    span = [f"{done} of {planned} rounds{recorded}" if done is not None else
            f"{planned} rounds"] if planned is not None else []
    span += [duration_text(took)] if took is not None else []
    head = (f"{summary.get('method', 'the run')} on {summary.get('dataset', '?')}, seed "
            f"{summary.get('seed', '?')}: "
            f"{status if status == 'completed' else status.upper()}"
            + (f" {'with' if recorded else 'after'} {' in '.join(span)}" if span else ""))
    lines = [head]
    if status == "failed":
        lines.append(f"  why: {summary.get('failure', 'no reason recorded')}")
    if status == "degraded":
        lines.append(f"  degraded: {summary.get('degraded')}")
    if summary.get("final_acc") is not None:
        lines.append(f"  accuracy ({summary.get('accuracy_source', 'no evaluation')}): "
                     f"{_figures(summary)}")
    if (summary.get("accuracy_source") == "server test set"
            and summary.get("federated_final_acc") is not None):
        lines.append(f"  federated accuracy (the nodes' held-out data): "
                     f"{_figures(summary, 'federated_')}")
    if "t_e" in summary:
        t_e = summary["t_e"]
        prestop = (f"T_e {t_e} (A_max {summary.get('A_max', float('nan')):.4f}), phase 2 "
                   f"from round {t_e + 1}" if t_e is not None else
                   "T_e none: the run never left phase 1 (it trained as FedAvg)")
        lines.append(f"  {prestop}; {guard_verdict(summary)}")
    delivered = delivered_text(summary)
    if delivered:
        lines.append(f"  {delivered}")
    if status != "failed" or summary.get("missed_rounds"):
        lines += [f"  {line}" for line in _sites(summary)]
    lines += [f"  note: {note}" for note in summary.get("notes") or []]
    where = Path(folder) if folder is not None else (
        Path(summary["out_dir"]) if summary.get("out_dir") else None)
    if where is not None:
        files = sorted(p.name for p in where.iterdir()) if where.is_dir() else []
        shown = [n for n in ("summary.json", "metrics.jsonl", CURVES, "model.pt",
                             "config.json") if n in files]
        lines.append(f"  files: {where}" + (f" ({', '.join(shown)}, ...)" if shown else ""))
    return lines
