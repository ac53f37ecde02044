"""Every row of a grid against its baseline row, seed by seed (``paired.md``).

A grid that names a ``baseline`` row (e.g. ``baseline = "FedAvg"``) gets, beside its
table of means, the difference of each run from the baseline's run of the same column
and seed, in percentage points of accuracy: the final round's (``final_acc``) and the
mean of the last 10 planned rounds', in which a run the phase-2 guard ended early holds
the model it delivered (:func:`common.results.mean_last10_held`: the same rounds for both
runs of a pair). Per row: how many paired runs, the mean difference, the least, how many
runs end more than a point below the baseline, and over the runs whose baseline ended 3
points or more below its own best (it memorized the noise) the mean final difference.
"Never worse than FedAvg" is a claim about every seed, and a mean over seeds hides the
runs that break it (docs/RESULTS.md, "Full participation with the phase-2 guard").

A row that reruns the baseline with a change no result should depend on (the grids'
"FedAvg, learning rate 1e-6 larger") is paired like any other: its differences are what
chance alone gives a per-seed comparison (docs/RESULTS.md, "How far apart two runs of one
method end"). A grid that names it (``chance = "..."``) gets one more count per row: the
runs *beyond chance*, whose final difference is below the least final difference of that
row, or whose last-10 difference is below its least last-10 difference. A run inside
that envelope is not evidence that a method is worse than the baseline; one beyond it is
evidence only where a row has more of them than chance alone gives. The least of n chance
runs is itself a draw: a run of a method no different from the baseline, exchangeable
with the chance runs, falls below the least final difference of n of them with
probability 1/(n + 1), below one of the two least with up to 2/(n + 1). So each row also
gets the count chance alone expects, measured on the chance row itself (each of its runs
held out against the envelope of the others: :meth:`Envelope.held_out_rate`), and how
likely chance alone makes at least that many (binomial; docs/RESULTS.md, "Clean labels").

Runs of one config on two machines differ by as much (another CPU's kernels sum floats in
another order): a pair whose summaries record different machines
(:func:`common.results.machine_record`) is counted and named above the tables, so that
no such difference is read as the method's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .grid import Grid
from .run_table import RunRecord

BELOW = 1.0  # points: a run this far below the baseline counts as below it
FELL = 3.0  # points: a baseline run this far below its own best at the end memorized


@dataclass(frozen=True)
class Pair:
    """One run's difference from the baseline's run of its column and seed (points)."""

    column: str
    seed: int
    final: float
    last10: float
    baseline_drop: float  # the baseline run's best accuracy less its final one
    other_machine: bool = False  # both runs record their machine, and they differ


def paired_differences(grid: Grid, finished: dict[tuple[str, str, int], RunRecord],
                       baselines: dict[str, str] | None = None) -> dict[str, list[Pair]]:
    """Per row other than the baseline (or per row of ``baselines``, against the row it
    names: the grid's ``pair-with``): its finished runs (``finished``: (row, column, seed)
    -> its row of the grid's summary table) whose baseline run (same column, same seed)
    finished too, as differences from it, in the grid's order. Accuracies in points: the
    final round's, the last 10 planned rounds' (``last10_held_acc``) and the baseline's
    best."""
    columns = list(grid.columns)
    if baselines is None:
        baselines = {row: grid.baseline for row in grid.rows if row != grid.baseline}
    pairs: dict[str, list[Pair]] = {row: [] for row in grid.rows if row in baselines}
    for (row, col, seed), run in sorted(
            finished.items(), key=lambda k: (columns.index(k[0][1]), k[0][2])):
        base = finished.get((baselines.get(row), col, seed))
        if row not in baselines or base is None:
            continue
        pairs[row].append(Pair(col, seed, 100 * run.final_acc - 100 * base.final_acc,
                               100 * run.last10_held_acc - 100 * base.last10_held_acc,
                               100 * base.best_acc - 100 * base.final_acc,
                               bool(run.machine and base.machine)
                               and run.machine != base.machine))
    return {row: runs for row, runs in pairs.items() if runs}


@dataclass(frozen=True)
class Envelope:
    """The least differences the chance row reached (points), over its paired runs, and
    how many of those runs fall beyond the envelope of the others (``held_out``)."""

    final: float
    last10: float
    runs: int
    held_out: int = 0

    def beyond(self, runs: list[Pair]) -> int:
        """How many of ``runs`` end below the envelope on the final round or the last 10."""
        return sum(p.final < self.final or p.last10 < self.last10 for p in runs)

    def held_out_rate(self) -> float | None:
        """The share of the chance row's runs beyond the envelope of its other runs: the
        rate at which a run no different from the baseline falls beyond chance; None
        with fewer than 2 runs."""
        return self.held_out / self.runs if self.runs >= 2 else None

    def by_chance(self, runs: list[Pair]) -> str:
        """What chance alone gives ``runs``: the expected count beyond the envelope, and
        the probability of at least :meth:`beyond` of them (binomial tail at
        :meth:`held_out_rate`); "" with too few chance runs to tell."""
        rate = self.held_out_rate()
        if rate is None:
            return ""
        m, k = len(runs), self.beyond(runs)
        tail = sum(math.comb(m, i) * rate ** i * (1 - rate) ** (m - i) for i in range(k, m + 1))
        return f"{m * rate:.1f}, {tail:.2f}"


def _held_out(runs: list[Pair]) -> int:
    """How many of the chance row's ``runs`` fall below the least differences of the
    others (final or last 10)."""
    return sum(runs[i].final < min(p.final for j, p in enumerate(runs) if j != i)
               or runs[i].last10 < min(p.last10 for j, p in enumerate(runs) if j != i)
               for i in range(len(runs))) if len(runs) >= 2 else 0


def chance_envelope(grid: Grid, pairs: dict[str, list[Pair]]) -> Envelope | None:
    """The chance row's envelope; None when the grid names no chance row or it has no
    paired run yet."""
    runs = pairs.get(grid.chance) if grid.chance is not None else None
    if not runs:
        return None
    return Envelope(min(p.final for p in runs), min(p.last10 for p in runs), len(runs),
                    _held_out(runs))


def chance_cells(envelope: Envelope | None, runs: list[Pair]) -> str:
    """The table's last cells: the runs beyond chance, and what chance alone gives."""
    if envelope is None:
        return ""
    cells = f" {envelope.beyond(runs)} |"
    if envelope.held_out_rate() is not None:
        cells += f" {envelope.by_chance(runs)} |"
    return cells


def difference_summary(values: list[float]) -> str:
    """A row's differences in points: their mean, the least, how many more than
    :data:`BELOW` points below."""
    below = sum(v < -BELOW for v in values)
    return f"{np.mean(values):+.1f}, {min(values):+.1f}, {below}"


def where_baseline_fell(runs: list[Pair]) -> str:
    """The runs whose baseline ended at least :data:`FELL` points below its own best (it
    memorized the noise), and their mean final difference."""
    fell = [p.final for p in runs if p.baseline_drop >= FELL]
    return f"{len(fell)}, {np.mean(fell):+.1f}" if fell else "0"


def _other_machines(pairs: dict[str, list[Pair]], base: str) -> list[str]:
    """The warning above the tables where some pairs ran on two machines; none else."""
    apart = {row: sum(p.other_machine for p in runs) for row, runs in pairs.items()}
    apart = {row: n for row, n in apart.items() if n}
    if not apart:
        return []
    named = "; ".join(f"{row}: {n} of {len(pairs[row])}" for row, n in apart.items())
    return ["", f"**Machines differ** ({named}): these runs and {base}'s of the same "
            "column and seed record different machines (`machine` in their summaries), "
            "whose arithmetic alone moves a final accuracy by points, so their differences "
            f"are not the row's alone; run {base} again on the row's machine "
            "(docs/RESULTS.md, \"How far apart two runs of one method end\")."]


def chance_head(envelope: Envelope | None) -> str:
    """The table's last column heads, where the grid names a chance row."""
    if envelope is None:
        return ""
    head = " runs beyond chance |"
    if envelope.held_out_rate() is not None:
        head += " chance alone: runs beyond, P(at least as many) |"
    return head


def _summary_table(grid: Grid, pairs: dict[str, list[Pair]], envelope: Envelope | None,
                   rows: list[str] | None = None) -> list[str]:
    """The table of every row (of ``rows``, if given) against the baseline."""
    base, extra_head = grid.baseline, chance_head(envelope)
    lines = [f"| row | runs | final − {base}: mean, least, runs > {BELOW:g} below | "
             f"last 10 − {base}: mean, least, runs > {BELOW:g} below | where {base} fell "
             f"≥ {FELL:g} from its best: runs, final − {base} mean |{extra_head}",
             "|---|---|---|---|---|" + "---|" * extra_head.count("|")]
    for row in rows or pairs:
        runs = pairs[row]
        lines.append(f"| {row} | {len(runs)} | {difference_summary([p.final for p in runs])} | "
                     f"{difference_summary([p.last10 for p in runs])} | "
                     f"{where_baseline_fell(runs)} |{chance_cells(envelope, runs)}")
    return lines


def paired_summary(grid: Grid, finished: dict[tuple[str, str, int], RunRecord],
                   rows: list[str] | None = None) -> str:
    """``paired.md``'s table of every row (of ``rows``) against the baseline."""
    pairs = paired_differences(grid, finished)
    return "\n".join(_summary_table(grid, pairs, chance_envelope(grid, pairs), rows))


def write_paired(grid: Grid, finished: dict[tuple[str, str, int], RunRecord],
                 out: Path) -> Path | None:
    """``paired.md`` of a grid with a baseline row (its finished runs: as
    :func:`paired_differences` takes them); None without one."""
    if grid.baseline is None:
        return None
    pairs = paired_differences(grid, finished)
    envelope = chance_envelope(grid, pairs)
    base = grid.baseline
    lines = [f"### {grid.title}: every row against {base}, seed by seed", "",
             f"Differences from {base}'s run of the same column and seed, in points of "
             "accuracy: the final round, and the mean of the last 10 planned rounds (a run "
             "the phase-2 guard ended early holds the model it delivered in the rounds it "
             "did not train, so both runs of a pair are read on the same rounds)."]
    lines += _other_machines(pairs, base)
    if envelope is not None:
        lines += ["", f"Chance: \"{grid.chance}\" reruns {base} with a change no result should "
                  f"depend on; over its {envelope.runs} runs its least differences were "
                  f"{envelope.final:+.1f} (final) and {envelope.last10:+.1f} (last 10). A run "
                  "below either is *beyond chance*."]
        rate = envelope.held_out_rate()
        if rate is not None:
            lines += ["", f"Chance alone: each of those {envelope.runs} runs held out against "
                      f"the envelope of the others, {envelope.held_out} fall beyond it, so a "
                      f"row no different from {base} is beyond chance in about "
                      f"{100 * rate:.0f} % of its runs. Last column: the runs chance alone "
                      "puts beyond it in a row of that many runs, and the probability that "
                      "chance alone puts at least as many as the row has there; a row is "
                      f"worse than {base} beyond chance where that probability is small."]
    extra_head = chance_head(envelope)
    lines += ["", *_summary_table(grid, pairs, envelope)]
    own = paired_differences(grid, finished, grid.pair_with) if grid.pair_with else {}
    if own:
        lines += ["", "Against their own baselines (`pair-with`: a row that holds the same "
                  "data), the same columns:", "",
                  "| row | against | runs | final: mean, least, runs > 1 below | last 10: "
                  "mean, least, runs > 1 below | where the baseline fell ≥ 3 from its best |"
                  + extra_head, "|---|---|---|---|---|---|" + "---|" * extra_head.count("|")]
        for row, runs in own.items():
            lines.append(f"| {row} | {grid.pair_with[row]} | {len(runs)} | "
                         f"{difference_summary([p.final for p in runs])} | "
                         f"{difference_summary([p.last10 for p in runs])} | "
                         f"{where_baseline_fell(runs)} |{chance_cells(envelope, runs)}")
    lines += ["", "Per column, per seed (final, last 10):", "",
              "| row | column | seed: final, last 10 |", "|---|---|---|"]
    for row, runs in [*pairs.items(), *((f"{r} − {grid.pair_with[r]}", v)
                                        for r, v in own.items())]:
        for col in grid.columns:
            mine = [p for p in runs if p.column == col]
            if mine:
                lines.append(f"| {row} | {col} | " + "; ".join(
                    f"{p.seed}: {p.final:+.1f}, {p.last10:+.1f}" for p in mine) + " |")
    path = out / "paired.md"
    path.write_text("\n".join(lines) + "\n")
    return path
