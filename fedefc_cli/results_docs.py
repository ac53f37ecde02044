"""The tables of docs/RESULTS.md, written from the grids' summary tables
(``results/<grid>/runs.csv``: :mod:`.run_table`) by ``fedefc results docs``, so that no
number in them is typed by hand.

A generated table sits between two markers, each a line of its own, the first of which
says what it holds::

    <!-- results table mnist-lite-table1 -->
    ...
    <!-- /results -->

``KIND GRID [key="value" ...]``, GRID a folder under ``results/`` whose last part names
its grid file (``clean-labels/cross-silo`` is ``configs/grids/cross-silo.toml`` run into
``results/clean-labels``). The kinds, accuracies in %:

- ``table``: the grid's ``table.md`` without its title (:func:`.report.markdown_table`);
- ``compare row="R" [against="A"]``: per column where R ran, A's (default the grid's
  baseline) and R's mean final / last 10 / best over the seeds both ran, R − A per seed
  (final, last 10), R's T_e and the phase-2 guard's restored round / the round it ended
  the run after per seed ("–": it did not fire), then a line of the totals over the
  pairs (mean, least, runs more than a point below); "last 10" is each run's own
  (``last10_acc``);
- ``seeds column="C" rows="R1|R2|..."``: per row, over the seeds of C it ran: mean
  final (± the sample standard deviation) / last 10 / best, and against the grid's
  baseline per seed the final and last 10 differences, T_e and the guard's rounds;
- ``paired [rows="R1|R2|..."]``: ``paired.md``'s table of every row against the baseline
  (last 10 over the planned rounds: :mod:`.paired`);
- ``grids G1|G2|... rows="R1|R2|..." [pooled="yes"] [own="yes"] [common="yes"]``: the
  ``paired`` table of the rows over several grids, a line per grid and row (the grid's
  name and its chance envelope, final / last 10, on its first line; the runs beyond
  chance and what chance alone gives in one cell); ``pooled``: a line
  per row over all the grids' runs, each run beyond its own grid's envelope, chance
  alone summed over the grids (the probability: Poisson-binomial); ``own``: after a row
  the grid pairs with another (``pair-with``), the row against that one ("against its
  pair-with row"); ``common``:
  only the columns and seeds every row ran;
- ``cells rows="R1|R2|..."``: per column and seed the baseline ran, each row's final −
  baseline.

The text between the markers is the command's to rewrite; the prose around them is not.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import numpy as np

from common.errors import ConfigError

from .grid import Grid
from .paired import (
    Pair,
    chance_cells,
    chance_envelope,
    chance_head,
    difference_summary,
    paired_differences,
    paired_summary,
    where_baseline_fell,
)
from .raw_archive import TREE_RESULTS
from .report import Finished, finished_runs, markdown_table, table_stats
from .run_configs import APP_DIR
from .run_table import RunRecord, table_runs

DOCS = [APP_DIR / "docs" / "RESULTS.md"]
BLOCK = re.compile(r"^(<!-- results ([^\n]+?) -->\n)(.*?)^(<!-- /results -->)", re.S | re.M)


class DocsError(ValueError):
    """A block of a doc cannot be written; the message names the block and the fix."""


@cache
def load(key: str) -> tuple[Grid, Finished]:
    """The grid file and the finished runs of the grid stored as ``results/<key>``."""
    records = table_runs(TREE_RESULTS / key)
    if not records:
        raise DocsError(f"no summary table results/{key}/runs.csv")
    grid = Grid.load(key.split("/")[-1])
    return grid, finished_runs(grid, records)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _diff(value: float) -> str:
    """Points with a sign and a true minus; a difference that rounds to 0 is +0.0."""
    value = round(value, 1) or 0.0
    return f"{value:+.1f}".replace("-", "−")


def _rounds(run: RunRecord) -> str:
    """The phase-2 guard's verdict of a run: restored round / ended after; "–": none."""
    if run.guard_restored_round is None:
        return "–"
    return f"{run.guard_restored_round}/{run.guard_ended_at}"


def _t_e(run: RunRecord) -> str:
    return "none" if run.t_e is None else str(run.t_e)


def _means(runs: list[RunRecord]) -> str:
    return " / ".join(_pct(np.mean([getattr(r, f) for r in runs]))
                      for f in ("final_acc", "last10_acc", "best_acc"))


def _pairs(finished: Finished, row: str, against: str, column: str
           ) -> list[tuple[RunRecord, RunRecord]]:
    """(row's run, against's run) of every seed of ``column`` both finished, by seed."""
    return sorted(((run, finished[(against, c, s)]) for (r, c, s), run in finished.items()
                   if r == row and c == column and (against, c, s) in finished),
                  key=lambda pair: pair[0].seed)


def _per_seed(pairs: list[tuple[RunRecord, RunRecord]]) -> list[tuple[float, float]]:
    """Per pair (final, last 10) differences in points."""
    return [(100 * run.final_acc - 100 * base.final_acc,
             100 * run.last10_acc - 100 * base.last10_acc) for run, base in pairs]


def compare(grid: Grid, finished: Finished, row: str, against: str | None = None) -> str:
    """The ``compare`` block (the module's docstring)."""
    against = against or grid.baseline
    lines = [f"| setting | {against} final / last 10 / best | {row} final / last 10 / best | "
             "difference final, last 10 per seed | T_e | guard: restored round, ended at |",
             "| --- | --- | --- | --- | --- | --- |"]
    diffs = []
    for column in grid.columns:
        pairs = _pairs(finished, row, against, column)
        if not pairs:
            continue
        per_seed = _per_seed(pairs)
        diffs += per_seed
        lines.append(
            f"| {column} | {_means([b for _, b in pairs])} | {_means([r for r, _ in pairs])} "
            f"| {'; '.join(f'{_diff(f)}, {_diff(t)}' for f, t in per_seed)} "
            f"| {', '.join(_t_e(r) for r, _ in pairs)} "
            f"| {', '.join(_rounds(r) for r, _ in pairs)} |")
    if not diffs:
        raise DocsError(f"grid {grid.name}: no run of {row!r} has a run of {against!r} of "
                        "its column and seed")
    final, last10 = np.array(diffs).T
    lines += ["", f"{len(diffs)} runs: {row} − {against}, final: mean {_diff(final.mean())}, "
              f"least {_diff(final.min())}, {int((final < -1).sum())} runs more than a point "
              f"below; last 10: mean {_diff(last10.mean())}, least {_diff(last10.min())}, "
              f"{int((last10 < -1).sum())} below"]
    return "\n".join(lines)


def seeds(grid: Grid, finished: Finished, column: str, rows: list[str]) -> str:
    """The ``seeds`` block (the module's docstring)."""
    base = grid.baseline
    lines = ["| | final | last 10 | best | final − " + base + ", per seed | last 10 − " + base
             + ", per seed | T_e | guard: restored round, ended at |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        runs = sorted((run for (r, c, _), run in finished.items() if (r, c) == (row, column)),
                      key=lambda run: run.seed)
        if not runs:
            raise DocsError(f"grid {grid.name}: no run of {row!r} in column {column!r}")
        means = _means(runs).split(" / ")
        if len(runs) > 1:  # the sample standard deviation over the seeds
            means[0] += f" ± {np.std([100 * r.final_acc for r in runs], ddof=1):.1f}"
        if row == base:
            lines.append(f"| {row} | {' | '.join(means)} | | | | |")
            continue
        per_seed = _per_seed(_pairs(finished, row, base, column))
        lines.append(f"| {row} | {' | '.join(means)} "
                     f"| {', '.join(_diff(f) for f, _ in per_seed)} "
                     f"| {', '.join(_diff(t) for _, t in per_seed)} "
                     f"| {', '.join(_t_e(r) for r in runs)} "
                     f"| {', '.join(_rounds(r) for r in runs)} |")
    return "\n".join(lines)


def _pairs_of(grid: Grid, finished: Finished, rows: list[str], own: bool, common: bool
              ) -> dict[str, list[Pair]]:
    """The rows' paired runs (``own``: each followed by its ``pair-with`` comparison;
    ``common``: only the cells every row ran)."""
    pairs = paired_differences(grid, finished)
    mine = {grid.pair_with[r]: r for r in rows if own and r in grid.pair_with}
    theirs = paired_differences(grid, finished, {r: a for a, r in mine.items()}) if mine else {}
    chosen: dict[str, list[Pair]] = {}
    for row in rows:
        if row not in pairs:
            raise DocsError(f"grid {grid.name}: no run of {row!r} has a run of "
                            f"{grid.baseline!r} of its column and seed")
        chosen[row] = pairs[row]
        if row in theirs:
            chosen[f"{row}, against its pair-with row"] = theirs[row]
    if common:
        cells = set.intersection(*({(p.column, p.seed) for p in runs}
                                   for runs in chosen.values()))
        chosen = {r: [p for p in runs if (p.column, p.seed) in cells]
                  for r, runs in chosen.items()}
    return chosen


def _at_least(rates: list[float], k: int) -> float:
    """The probability that at least ``k`` of independent events of ``rates`` happen."""
    dist = [1.0]
    for rate in rates:
        dist = [a * (1 - rate) + b * rate for a, b in zip(dist + [0.0], [0.0] + dist)]
    return float(sum(dist[k:]))


def grids(loaded: list[tuple[str, Grid, Finished]], rows: list[str], pooled: bool = False,
          own: bool = False, common: bool = False) -> str:
    """The ``grids`` block (the module's docstring) of ``loaded``: (name, grid, runs)."""
    base = loaded[0][1].baseline
    per_grid = []
    for key, grid, finished in loaded:
        pairs = _pairs_of(grid, finished, rows, own, common)
        per_grid.append((key, pairs, chance_envelope(grid, paired_differences(grid, finished))))
    envelopes = [env for _, _, env in per_grid if env is not None]
    extra = ""
    if envelopes:
        extra = " beyond chance" + ("; chance alone, P" if "chance alone" in
                                    chance_head(envelopes[0]) else "") + " |"
    blank = " |" if extra else ""
    head = (f" final − {base}: mean, least, > 1 below | last 10 | {base} fell ≥ 3: "
            f"runs, final |{extra}")
    lines = ["| row (runs) |" + head if pooled
             else f"| grid{' (chance envelope)' if extra else ''} | row (runs) |" + head]
    lines.append("|---" * (lines[0].count("|") - 1) + "|")
    if pooled:
        for row in per_grid[0][1]:
            runs = [p for _, pairs, _ in per_grid for p in pairs[row]]
            cells = blank
            if extra and len(envelopes) == len(per_grid):
                beyond = sum(env.beyond(pairs[row]) for _, pairs, env in per_grid)
                rates = [env.held_out_rate() for _, pairs, env in per_grid
                         for _ in pairs[row]]
                cells = f" {beyond} |"
                if None not in rates and "chance alone" in extra:
                    cells = f" {beyond}; {sum(rates):.1f}, {_at_least(rates, beyond):.2f} |"
            lines.append(f"| {row} ({len(runs)}) | {difference_summary([p.final for p in runs])} | "
                         f"{difference_summary([p.last10 for p in runs])} | "
                         f"{where_baseline_fell(runs)} |{cells}")
        return "\n".join(lines)
    for key, pairs, env in per_grid:
        label = key if env is None else f"{key} ({env.final:+.1f} / {env.last10:+.1f})"
        for row, runs in pairs.items():
            cells = (chance_cells(env, runs).replace(" | ", "; ", 1) if env is not None
                     else blank)
            lines.append(f"| {label} | {row} ({len(runs)}) | "
                         f"{difference_summary([p.final for p in runs])} | "
                         f"{difference_summary([p.last10 for p in runs])} | "
                         f"{where_baseline_fell(runs)} |{cells}")
            label = ""
    return "\n".join(lines)


def cells(grid: Grid, finished: Finished, rows: list[str]) -> str:
    """The ``cells`` block (the module's docstring)."""
    base = grid.baseline
    lines = [f"| column (seed) | {' | '.join(rows)} |", "|---" * (len(rows) + 1) + "|"]
    for column in grid.columns:
        for seed in sorted(s for (r, c, s) in finished if (r, c) == (base, column)):
            diffs = [finished.get((row, column, seed)) for row in rows]
            lines.append(f"| {column} ({seed}) | " + " | ".join(
                "" if run is None else
                _diff(100 * run.final_acc - 100 * finished[(base, column, seed)].final_acc)
                for run in diffs) + " |")
    return "\n".join(lines)


def render_block(spec: str) -> str:
    """The text of the block whose opening marker says ``spec``."""
    try:
        kind, key, *options = shlex.split(spec)
        opts = dict(option.split("=", 1) for option in options)
    except ValueError:
        raise DocsError(f"block {spec!r}: write KIND GRID [key=\"value\" ...]") from None
    needs = {"table": (), "compare": ("row",), "seeds": ("column", "rows"), "paired": (),
             "grids": ("rows",), "cells": ("rows",)}
    if kind not in needs:
        raise DocsError(f"no kind {kind!r}; kinds: {', '.join(needs)}")
    missing = [f'{name}="..."' for name in needs[kind] if name not in opts]
    if missing:
        raise DocsError(f"a {kind} block needs {', '.join(missing)}")
    if kind == "grids":
        return grids([(k, *load(k)) for k in key.split("|")], opts["rows"].split("|"),
                     **{o: opts.get(o) == "yes" for o in ("pooled", "own", "common")})
    grid, finished = load(key)
    if kind == "cells":
        return cells(grid, finished, opts["rows"].split("|"))
    if kind == "table":
        return markdown_table(grid, table_stats(grid, finished)).split("\n", 2)[2]
    if kind == "compare":
        return compare(grid, finished, opts["row"], opts.get("against"))
    if kind == "seeds":
        return seeds(grid, finished, opts["column"], opts["rows"].split("|"))
    return paired_summary(grid, finished, opts["rows"].split("|") if "rows" in opts else None)


def render_docs(doc: Path, write: bool = True) -> bool:
    """Rewrite every block of ``doc`` (when ``write``); return whether any differed."""
    text = doc.read_text()

    def fill(match: re.Match) -> str:
        try:
            body = render_block(match.group(2))
        except (KeyError, ConfigError, DocsError) as err:
            raise DocsError(f"{doc.name}, block <!-- results {match.group(2)} -->: {err}"
                            ) from None
        return f"{match.group(1)}{body}\n{match.group(4)}"

    new = BLOCK.sub(fill, text)
    if write and new != text:
        doc.write_text(new)
    return new != text
