"""The fresh federations before and after a change, every run paired with FedAvg, worst first.

Reads two results folders of ``configs/grids/fresh-federations.toml``: the "before"
code's runs (every row, FedAvg's and its chance row's among them) and the "after" code's
FedEFC rows, run with ``grid_in_process.py --record-only`` (the guard reads and records
every round but lets every run train all its rounds). The after runs' records hold, per
round, the guard's reading of the model the round received (``guard_acc``, ``guard_se``)
and the test accuracy of the model it made, so the model a delivery rule would deliver
is read off them exactly, as the run would have delivered it (a run the rule ends early
trains the same rounds up to then). Rules replayed:

- ``rule``: today's (``fedefc_server/guard.py: Phase2Guard``, run as the server runs
  it: the best-read model; a flat signal keeps the last);
- ``last unless told``: the last model unless the best leads it by the margin;
- ``no guard``: phase 2 to the last round (the paper's protocol).

FedAvg is read both ways for the coordinator's row: its final model, and the model its
own reading of the clean set picks by the same rule (``deliver = "best-read"``, replayed on
its ``clean_acc``). Printed as Markdown: per row and rule the mean final difference from
its paired FedAvg (points), the least, runs more than a point below, runs beyond the
chance envelope (FedAvg against its rerun with a learning rate 1e-6 larger:
``fedefc_cli/paired.py``) with what chance alone gives; then every run, worst first.

    python tests/benchmarks/fresh_report.py /abs/before /abs/after [--from 3] > table.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fedefc_cli.grid import Grid, slug
from fedefc_cli.paired import Envelope, Pair
from fedefc_server.guard import Phase2Guard, tells_apart

GRID = "fresh-federations"
FEDAVG, CHANCE = "FedAvg", "FedAvg, learning rate 1e-6 larger"
WITHOUT = "FedAvg without the coordinator's 10 clean samples per class"
COORD = "FedEFC, the coordinator's 10 clean samples per class"
ROWS = ("FedEFC, the defaults", COORD, "FedEFC, 10 verified labels per class")


def run(root: Path, row: str, column: str) -> tuple[dict, list[dict]] | None:
    """(summary, records) of a finished run, or None."""
    folder = root / GRID / slug(row) / slug(column) / "seed0"
    if not (folder / "summary.json").exists():
        return None
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return json.loads((folder / "summary.json").read_text()), records


def replay_rule(records: list[dict], cfg: dict) -> tuple[int, str]:
    """(the round whose model the rule delivers, why) on a record-only run's records."""
    t_e = next((r["t_e"] for r in reversed(records) if r.get("t_e") is not None), None)
    guard = Phase2Guard(int(cfg["start-round"]), int(cfg["gamma-thr"]))
    last = records[-1]["round"]
    for r in records[1:]:
        if r.get("guard_acc") is None:
            continue
        t = r["round"]
        verdict = guard.observe(t, r["guard_acc"], t_e is not None and t - 1 > t_e,
                                se=r["guard_se"])
        if verdict == "fired":
            return guard.best_round - 1, f"restored r{guard.best_round} at r{t}"
    final = records[-1].get("guard_output_acc", records[-1].get("guard_acc"))
    if guard.last_verdict(last, final):
        return guard.best_round - 1, f"best r{guard.best_round} at the end"
    return last, "flat: last" if guard.flat() else "last"


def replay_last_unless_told(records: list[dict]) -> int:
    """The last model, unless the best-read one leads it by the margin."""
    read = [(r["guard_acc"], r["guard_se"], r["round"]) for r in records[1:]
            if r.get("guard_acc") is not None]
    if not read:
        return records[-1]["round"]
    best = max(read, key=lambda x: (x[0], x[2]))
    final = records[-1].get("guard_output_acc", read[-1][0])
    told = tells_apart(best[0], best[1], final, read[-1][1])
    return best[2] - 1 if told else records[-1]["round"]


def fedavg_best_read(records: list[dict]) -> int:
    """FedAvg's own best-read model on its clean-set readings (``deliver = "best-read"``:
    the model after round t is the one round t + 1 receives)."""
    guard = Phase2Guard(0, 1)
    n = 100  # the coordinator's 10 per class of K = 10; 20 for K = 2 (unpaired here)
    for r in records[1:]:
        acc = r["clean_acc"]
        guard.observe(r["round"] + 1, acc, False, se=(acc * (1 - acc) / n) ** 0.5)
    last = records[-1]
    return guard.best_round - 1 if guard.last_verdict(last["round"] + 1,
                                                      last["clean_acc"]) else last["round"]


def acc(records: list[dict], after_round: int) -> float:
    return 100 * records[after_round]["test_acc"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--from", dest="first", type=int, default=0,
                    help="only the federations from this index on (the ones no rule was "
                         "chosen on)")
    args = ap.parse_args(argv)
    grid = Grid.load(GRID)
    columns = list(grid.columns)[args.first:]
    chance, table, listed = [], {}, []
    for column in columns:
        base, rerun = run(args.before, FEDAVG, column), run(args.before, CHANCE, column)
        without = run(args.before, WITHOUT, column)
        if base is None:
            continue
        b = 100 * base[0]["final_acc"]
        if rerun is not None:
            chance.append(Pair(column, 0, 100 * rerun[0]["final_acc"] - b, 0.0, 0.0))
        for row in ROWS:
            before, after = run(args.before, row, column), run(args.after, row, column)
            paired = without if row == COORD else base
            if after is None or paired is None:
                continue
            cfg = {**json.loads((args.after / GRID / slug(row) / slug(column) / "seed0" /
                                 "config.json").read_text())}
            p = 100 * paired[0]["final_acc"]
            recs = after[1]
            rule_round, why = replay_rule(recs, cfg)
            values = {"before": None if before is None else 100 * before[0]["final_acc"] - p,
                      "rule": acc(recs, rule_round) - p,
                      "last unless told": acc(recs, replay_last_unless_told(recs)) - p,
                      "no guard": acc(recs, recs[-1]["round"]) - p}
            if row == COORD:
                values["rule vs FedAvg best-read"] = acc(recs, rule_round) - acc(
                    without[1], fedavg_best_read(without[1]))
            for rule, value in values.items():
                if value is not None:
                    table.setdefault((row, rule), []).append(Pair(column, 0, value, 0.0, 0.0))
            listed.append((values["rule"], column, row, values["before"],
                           f"T_e {next((r['t_e'] for r in reversed(recs) if r.get('t_e')), None)},"
                           f" delivered after r{rule_round} ({why})"))
    envelope = Envelope(min(p.final for p in chance), 0.0, len(chance),
                        sum(chance[i].final < min(p.final for j, p in enumerate(chance) if j != i)
                            for i in range(len(chance)))) if len(chance) > 1 else None
    print(f"{len({c for _, c, *_ in listed})} federations; chance envelope (FedAvg against "
          f"its rerun, {len(chance)} runs): final "
          f"{envelope.final if envelope else float('nan'):+.1f}\n")
    print("| row | rule | runs | mean | least | > 1 point below | beyond chance | "
          "chance alone: expected, P |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (row, rule), runs in table.items():
        finals = [p.final for p in runs]
        beyond = "" if envelope is None else (
            f" {sum(p.final < envelope.final for p in runs)} | {envelope.by_chance(runs)} |")
        print(f"| {row} | {rule} | {len(runs)} | {statistics.mean(finals):+.1f} | "
              f"{min(finals):+.1f} | {sum(f < -1 for f in finals)} |{beyond}")
    print("\n| federation | row | before | after (rule) | after: the run |")
    print("| --- | --- | --- | --- | --- |")
    for value, column, row, before, what in sorted(listed):
        was = "" if before is None else f"{before:+.1f}"
        print(f"| {column} | {row} | {was} | {value:+.1f} | {what} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
