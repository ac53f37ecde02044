"""The fresh federations before and after a change, every run paired with FedAvg, worst first.

Reads two results folders of ``configs/grids/fresh-federations.toml`` (the "before" code's
runs and the "after" code's; a row the after folder lacks, FedAvg's among them, is read
from the before folder: its code did not change) and prints, as Markdown:

- per FedEFC row, before and after: the runs paired, the mean final difference from its
  paired FedAvg (points), the least, how many end more than a point below, how many
  beyond the chance envelope (the grid's chance row: ``fedefc_cli/paired.py``), and the
  probability of at least that many by chance alone;
- every run of every FedEFC row, the worst (after) first: its final difference before
  and after, T_e, the delivered model and why.

The coordinator's row is paired with FedAvg on the same samples (the grid's
``pair-with``) and, after, also with FedAvg delivering by the same signal
(``deliver = "best-read"``).

    python tests/benchmarks/fresh_report.py /abs/before /abs/after > table.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from fedefc_cli.grid import Grid
from fedefc_cli.paired import Pair, chance_envelope, paired_differences

GRID = "fresh-federations"
BASE = "FedAvg"
COORD = "FedEFC, the coordinator's 10 clean samples per class"
WITHOUT = "FedAvg without the coordinator's 10 clean samples per class"
BEST_READ = f"{WITHOUT}, best read"


def merged(grid: Grid, before: Path, after: Path, into: Path) -> Path:
    """A results folder holding the after folder's runs and, for the rows it lacks, the
    before folder's (linked)."""
    root = into / grid.name
    root.mkdir(parents=True)
    for source in (after, before):
        for row in (source / grid.name).iterdir():
            if not (root / row.name).exists():
                (root / row.name).symlink_to(row.resolve())
    return into


def pairs_of(grid: Grid, results: Path) -> dict[str, list[Pair]]:
    """Every row against FedAvg, the coordinator's also against FedAvg on its samples
    (plain, and best read)."""
    cells = grid.cells(results, [])
    out = paired_differences(grid, cells)
    out.update({f"{COORD} vs {other}": runs for other in (WITHOUT, BEST_READ)
                for runs in paired_differences(grid, cells, {COORD: other}).values()})
    return out


def summary_line(label: str, runs: list[Pair], envelope) -> str:
    finals = [p.final for p in runs]
    below = sum(f < -1.0 for f in finals)
    chance = "" if envelope is None else (
        f" {envelope.beyond(runs)} | {envelope.by_chance(runs)} |")
    return (f"| {label} | {len(runs)} | {sum(finals) / len(finals):+.1f} | "
            f"{min(finals):+.1f} | {below} |{chance}")


def delivered(results: Path, grid: Grid, row: str, column: str) -> str:
    """T_e and the delivered model of one run, in a few words."""
    cell = next(c for c in grid.cells(results, []) if c.row == row and c.column == column)
    s = json.loads((cell.out_dir / "summary.json").read_text())
    after = s.get("delivered_after_round")
    what = (f"round {after}'s" if after is not None else
            f"restored r{s['guard_restored_round']}" if s.get("guard_restored_round")
            else "last")
    return f"T_e {s.get('t_e')}, {what}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    grid = Grid.load(GRID)
    with tempfile.TemporaryDirectory() as tmp:
        after_dir = merged(grid, args.before, args.after, Path(tmp))
        before, after = pairs_of(grid, args.before), pairs_of(grid, after_dir)
        env_before = chance_envelope(grid, before)
        env_after = chance_envelope(grid, after)
        rows = [r for r in after if r.startswith("FedEFC")]
        print("| row | runs | mean | least | > 1 point below | beyond chance | "
              "chance alone: expected, P |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in rows:
            for when, pairs, env in (("before", before, env_before),
                                     ("after", after, env_after)):
                if pairs.get(row):
                    print(summary_line(f"{row} ({when})", pairs[row], env))
        if env_after is not None:
            print(f"\nThe chance envelope (FedAvg against itself, learning rate 1e-6 "
                  f"larger, {env_after.runs} runs): final {env_after.final:+.1f}, last 10 "
                  f"{env_after.last10:+.1f}.\n")
        print("| run | row | before | after | after: T_e, delivered |")
        print("| --- | --- | --- | --- | --- |")
        listed = []
        for row in rows:
            was = {(p.column, p.seed): p.final for p in before.get(row, [])}
            for p in after[row]:
                listed.append((p.final, p.column, row, was.get((p.column, p.seed))))
        for final, column, row, was in sorted(listed):
            source = row.split(" vs ")[0]
            print(f"| {column} | {row} | "
                  f"{'' if was is None else f'{was:+.1f}'} | {final:+.1f} | "
                  f"{delivered(after_dir, grid, source, column)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
