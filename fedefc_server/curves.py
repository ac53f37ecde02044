"""A run in a picture: ``curves.png`` beside ``summary.json`` (README, "Results folder").

Three panels over the rounds: the accuracy of the global model (the server's test set,
and the nodes' held-out data with federated evaluation); A(t) with A_max, T_e and the
phase-2 guard's verdicts (a round whose received model became its best, one that did
not beat it, the round it fell back or ended the run in, and the model it restored);
and which partitions took part in each round (trained, missed, or not sampled).

The ServerApp draws it at the end of every run, completed, degraded or failed
(:meth:`.round_loop.RoundLoop._finish`), not the ``fedefc`` command: in a deployment
the out-dir is on the SuperLink machine, which may never run the command (a run
submitted from another machine, or with ``flwr run``), and ``fedefc deploy fetch``
brings the picture with the other files. A run that failed is drawn as far as it got.
The series come from the rounds' records (``metrics.jsonl``) by :func:`series`, a
plain function; drawing never fails the run (an error is logged, and the run has no
picture). matplotlib is imported only to draw, after the last round (its figure and
Agg canvas; no pyplot, no display: importing them took 2.3 s and drawing a 40-round
run 1.7 s on the 2-core machine at load ~24): never in a round, nor at ``fedefc``'s
start.
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from common.results import atomic_write_bytes

FILE = "curves.png"


@dataclass
class Series:
    """What the picture shows, per round (``rounds``: every recorded round, 0 first)."""

    rounds: list[int] = field(default_factory=list)
    test_acc: list[float | None] = field(default_factory=list)
    federated_acc: list[float | None] = field(default_factory=list)
    a: dict[int, float] = field(default_factory=dict)  # round -> A(t), where recorded
    a_max: dict[int, float] = field(default_factory=dict)  # round -> A_max, once set
    t_e: int | None = None
    guard_best: list[int] = field(default_factory=list)  # phase-2 rounds: a new best
    guard_worse: list[int] = field(default_factory=list)  # phase-2 rounds: not better
    took_part: dict[int, list[int]] = field(default_factory=dict)  # round -> partitions
    missed: dict[int, list[int]] = field(default_factory=dict)  # round -> partitions


def series(records: list[dict[str, Any]]) -> Series:
    """The picture's series from the rounds' records. A guard verdict is read where the
    record's guard fields change in a round whose received model phase 2 trained
    (after T_e + 1): ``guard_best_round`` becomes the round (a new best), or
    ``guard_worse`` grows (not better)."""
    out = Series()
    worse_before = 0
    for rec in sorted(records, key=lambda r: r["round"]):
        t = int(rec["round"])
        out.rounds.append(t)
        out.test_acc.append(rec.get("test_acc"))
        out.federated_acc.append(rec.get("federated_acc"))
        if rec.get("A") is not None:
            out.a[t] = float(rec["A"])
        if rec.get("A_max") and t > 0:  # 0 until the rule watches (after start-round)
            out.a_max[t] = float(rec["A_max"])
        if rec.get("t_e") is not None:
            out.t_e = int(rec["t_e"])
        worse = int(rec.get("guard_worse") or 0)
        if out.t_e is not None and t > out.t_e + 1:
            if rec.get("guard_best_round") == t:
                out.guard_best.append(t)
            elif worse > worse_before:
                out.guard_worse.append(t)
        worse_before = worse
        if t > 0:
            out.took_part[t] = [int(p) for p in rec.get("partition_ids") or []]
            out.missed[t] = sorted(int(m["partition"]) for m in rec.get("missing") or [])
    return out


def _title(summary: dict[str, Any]) -> str:
    head = (f"{summary.get('method', '?')} on {summary.get('dataset', '?')}, seed "
            f"{summary.get('seed', '?')}: {summary.get('status', '?')}")
    if summary.get("status") == "failed":
        return textwrap.shorten(f"{head}: {summary.get('failure', '')}", 150)
    if summary.get("final_acc") is not None:
        head += (f", final {summary['final_acc']:.4f}, best {summary['best_acc']:.4f} "
                 f"(round {summary['best_round']})")
    return head


def draw(data: Series, summary: dict[str, Any], num_partitions: int, path: Path) -> None:
    """Write the picture of ``data`` (its title from ``summary``) to ``path``."""
    # lazy (module docstring): matplotlib's figure, canvas and ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: 2.3 s with the two below
    from matplotlib.figure import Figure  # lazy: 2.3 s with the canvas
    from matplotlib.ticker import MaxNLocator  # lazy: 2.3 s with the canvas

    has_a = bool(data.a)
    rows = 3 if has_a else 2
    fig = Figure(figsize=(10, 8.6 if has_a else 6.4), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, 1, height_ratios=[3, 2.2, 1.8] if has_a else [3, 1.8])
    acc = fig.add_subplot(grid[0])
    axes = [acc]
    for values, label, style in ((data.test_acc, "test accuracy (server test set)", "-"),
                                 (data.federated_acc, "federated accuracy (held-out data)",
                                  "--")):
        points = [(t, v) for t, v in zip(data.rounds, values) if v is not None]
        if points:
            acc.plot(*zip(*points), style, marker=".", lw=1.4, label=label)
    if summary.get("guard_restored_round"):
        acc.axvline(summary["guard_restored_round"], color="tab:green", lw=1, ls=":",
                    label=f"model restored by the guard (round "
                          f"{summary['guard_restored_round']})")
    acc.set_ylabel("accuracy")
    if has_a:
        sig = fig.add_subplot(grid[1], sharex=acc)
        axes.append(sig)
        sig.plot(list(data.a), list(data.a.values()), "-", marker=".", color="tab:purple",
                 lw=1.4, label="A(t)")
        if data.a_max:
            sig.step(list(data.a_max), list(data.a_max.values()), where="post",
                     color="tab:gray", ls="--", lw=1, label="A_max")
        for rounds, marker, colour, label in (
                (data.guard_best, "^", "tab:green", "guard: a new best"),
                (data.guard_worse, "v", "tab:red", "guard: not better")):
            points = [(t, data.a[t]) for t in rounds if t in data.a]
            if points:
                sig.scatter(*zip(*points), marker=marker, color=colour, s=40, zorder=3,
                            label=label)
        for key, text, colour in (("guard_fell_back_at", "guard fell back", "tab:orange"),
                                  ("guard_ended_at", "guard ended the run", "tab:red")):
            if summary.get(key) is not None:
                sig.axvline(summary[key], color=colour, lw=1.2, label=f"{text} "
                            f"(round {summary[key]})")
        sig.set_ylabel("A(t)")
    sites = fig.add_subplot(grid[rows - 1], sharex=acc)
    axes.append(sites)
    trained = [(t, p) for t, ps in data.took_part.items() for p in ps]
    missed = [(t, p) for t, ps in data.missed.items() for p in ps]
    size = max(4.0, 60.0 / max(num_partitions, 1) ** 0.8)
    if trained:
        sites.scatter(*zip(*trained), marker="s", s=size, color="tab:blue",
                      label="trained")
    if missed:
        sites.scatter(*zip(*missed), marker="x", s=size * 2, color="tab:red",
                      label="missed")
    sites.set_ylim(-0.7, num_partitions - 0.3)
    sites.set_ylabel("partition")
    sites.set_xlabel("round")
    if num_partitions <= 12:
        sites.set_yticks(range(num_partitions))
    for ax in axes:
        if data.t_e is not None:
            ax.axvline(data.t_e, color="black", lw=1, ls="--",
                       label=f"T_e = {data.t_e}" if ax is axes[0] else None)
            ax.axvspan(data.t_e + 0.5, max(data.rounds) + 0.5, color="tab:orange",
                       alpha=0.07, label="phase 2" if ax is axes[0] else None)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0)
    if data.rounds:
        acc.set_xlim(min(data.rounds) - 0.5, max(data.rounds) + 0.5)
    fig.suptitle(_title(summary), fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())


def write_curves(out_dir: str | Path, records: list[dict[str, Any]],
                 summary: dict[str, Any], num_partitions: int) -> Path | None:
    """``out_dir/curves.png`` from the run's records; None (the error logged) when it
    could not be drawn: a picture never fails a run."""
    path = Path(out_dir) / FILE
    try:
        draw(series(records), summary, num_partitions, path)
    except Exception as err:  # the run's results stand without their picture
        log(WARNING, "%s not drawn: %s: %s", path, type(err).__name__, err)
        return None
    return path
