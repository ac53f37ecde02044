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
  (last 10 over the planned rounds: :mod:`.paired`).

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
from .paired import paired_summary
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


def render_block(spec: str) -> str:
    """The text of the block whose opening marker says ``spec``."""
    try:
        kind, key, *options = shlex.split(spec)
        opts = dict(option.split("=", 1) for option in options)
    except ValueError:
        raise DocsError(f"block {spec!r}: write KIND GRID [key=\"value\" ...]") from None
    needs = {"table": (), "compare": ("row",), "seeds": ("column", "rows"), "paired": ()}
    if kind not in needs:
        raise DocsError(f"no kind {kind!r}; kinds: {', '.join(needs)}")
    missing = [f'{name}="..."' for name in needs[kind] if name not in opts]
    if missing:
        raise DocsError(f"a {kind} block needs {', '.join(missing)}")
    grid, finished = load(key)
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
