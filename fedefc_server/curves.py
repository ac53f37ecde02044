"""A run in a picture: ``curves.png`` beside ``summary.json`` (README, "The results folder").

Three panels over the rounds: the accuracy of the global model (the server's test set,
the nodes' held-out data with federated evaluation, the coordinator's clean set where
the server reports it) and the model the run delivered, with its reading and why; A(t)
with A_max, T_e, the guard's own reading and its verdicts (a round whose received model
became its best, one that did not beat it, the round it fell back or gave its verdict
in), the panel and its lines named for what they read (training labels, a held-out
share, verified labels or the coordinator's clean set: docs/OWN-DATA.md, "Verified
labels"); and which sites took part in each round (trained, missed, or not sampled),
each row named for its site where the summary knows the name (``site_names``), else
"partition N".

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
    guard_acc: dict[int, float] = field(default_factory=dict)  # round -> the guard's reading
    clean_acc: dict[int, float] = field(default_factory=dict)  # round -> on the clean set
    t_e: int | None = None
    guard_best: list[int] = field(default_factory=list)  # phase-2 rounds: a new best
    guard_worse: list[int] = field(default_factory=list)  # phase-2 rounds: not better
    took_part: dict[int, list[int]] = field(default_factory=dict)  # round -> partitions
    missed: dict[int, list[int]] = field(default_factory=dict)  # round -> partitions
    resumed: list[int] = field(default_factory=list)  # rounds a resumed run ran again


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
        if rec.get("guard_acc") is not None:
            out.guard_acc[t] = float(rec["guard_acc"])
        if rec.get("clean_acc") is not None:
            out.clean_acc[t] = float(rec["clean_acc"])
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
        if rec.get("resumed"):
            out.resumed.append(t)
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


def a_signal(summary: dict[str, Any]) -> str:
    """What A(t) was read on, in words: the clients' training labels (the paper's
    signal), their verified labels, or their held-out share's noisy labels
    (docs/FEDEFC.md §3.1, §3.7)."""
    if summary.get("accuracy_signal") != "held-out":  # "global", "local-train"
        return "the clients' training labels"
    if summary.get("validation_labels") == "verified":
        return "the clients' verified labels"
    return "the clients' held-out share (noisy labels)"


def site_name(summary: dict[str, Any], partition: int) -> str:
    """A site's row label: its name where the summary knows it (``site_names``), with
    its partition; else "partition N"."""
    name = (summary.get("site_names") or {}).get(str(partition))
    return f"partition {partition}" if name is None else f"{name} ({partition})"


def draw(data: Series, summary: dict[str, Any], num_partitions: int, path: Path) -> None:
    """Write the picture of ``data`` (its title from ``summary``) to ``path``."""
    png = io.BytesIO()
    figure(data, summary, num_partitions).savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())


def figure(data: Series, summary: dict[str, Any], num_partitions: int):
    """The picture of ``data`` as a matplotlib Figure: one function a panel, then what
    every panel shares (T_e, phase 2, grid, legend)."""
    # lazy (module docstring): matplotlib's figure, canvas and ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: 2.3 s with the two below
    from matplotlib.figure import Figure  # lazy: 2.3 s with the canvas

    has_a = bool(data.a)
    rows = 3 if has_a else 2
    fig = Figure(figsize=(10, 8.6 if has_a else 6.4), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, 1, height_ratios=[3, 2.2, 1.8] if has_a else [3, 1.8])
    acc = fig.add_subplot(grid[0])
    accuracy_panel(acc, data, summary)
    axes = [acc]
    if has_a:
        axes.append(fig.add_subplot(grid[1], sharex=acc))
        signal_panel(axes[-1], data, summary)
    axes.append(fig.add_subplot(grid[rows - 1], sharex=acc))
    sites_panel(axes[-1], data, num_partitions, summary)
    for ax in axes:
        finish_axis(ax, data, first=ax is acc)
    if data.rounds:
        acc.set_xlim(min(data.rounds) - 0.5, max(data.rounds) + 0.5)
    fig.suptitle(_title(summary), fontsize=10)
    fig.tight_layout()
    return fig


def accuracy_panel(acc, data: Series, summary: dict[str, Any]) -> None:
    """The global model's accuracy per round (the coordinator's clean set too, where
    the server reports it: docs/FEDEFC.md §3.9), and the model the run delivered: the
    round it was made in, its reading on the guard's signal and why (§3.4)."""
    clean = [data.clean_acc.get(t) for t in data.rounds]
    for values, label, style in ((data.test_acc, "test accuracy (server test set)", "-"),
                                 (data.federated_acc, "federated accuracy (held-out data)",
                                  "--"),
                                 (clean, textwrap.fill(
                                     f"accuracy on {summary.get('clean_set')}", 44), "-.")):
        points = [(t, v) for t, v in zip(data.rounds, values) if v is not None]
        if points:
            acc.plot(*zip(*points), style, marker=".", lw=1.4, label=label)
    after = summary.get("delivered_after_round")
    if after is not None:
        reading = summary.get("delivered_reading")
        read = "" if reading is None else f", read {reading:.3f}"
        acc.axvline(after, color="tab:green", lw=1.2, ls=":",
                    label=textwrap.fill(f"delivered: the model after round {after}{read}; "
                                        f"{summary.get('delivered_why', '')}", 44))
    acc.set_ylabel("accuracy")


def signal_panel(sig, data: Series, summary: dict[str, Any]) -> None:
    """A(t) with A_max, the guard's reading (where it reads more than A(t): the twin's
    slices or the coordinator's clean set) and its verdicts; the title names what A(t)
    and the guard read."""
    sig.plot(list(data.a), list(data.a.values()), "-", marker=".", color="tab:purple",
             lw=1.4, label=textwrap.fill(f"A(t) on {a_signal(summary)}", 44))
    guard = summary.get("guard_signal")
    sig.set_title(f"A(t) on {a_signal(summary)}" + ("" if guard is None else
                                                    f"; the guard reads {guard}"),
                  fontsize=9)
    if data.a_max:
        sig.step(list(data.a_max), list(data.a_max.values()), where="post",
                 color="tab:gray", ls="--", lw=1, label="A_max")
    if data.guard_acc and data.guard_acc != data.a:
        sig.plot(list(data.guard_acc), list(data.guard_acc.values()), "-", marker=".",
                 color="tab:green", lw=1.2,
                 label=textwrap.fill(f"guard reads {summary.get('guard_signal')}", 44))
    read = data.guard_acc or data.a
    for rounds, marker, colour, label in (
            (data.guard_best, "^", "tab:green", "guard: a new best"),
            (data.guard_worse, "v", "tab:red", "guard: not better")):
        points = [(t, read[t]) for t in rounds if t in read]
        if points:
            sig.scatter(*zip(*points), marker=marker, color=colour, s=40, zorder=3,
                        label=label)
    for key, text, colour in (("guard_fell_back_at", "guard fell back", "tab:orange"),
                              ("guard_ended_at", "guard's verdict", "tab:red")):
        if summary.get(key) is not None:
            sig.axvline(summary[key], color=colour, lw=1.2, label=f"{text} "
                        f"(round {summary[key]})")
    sig.set_ylabel("A(t)")


def sites_panel(sites, data: Series, num_partitions: int, summary: dict[str, Any]) -> None:
    """Which sites trained in each round and which missed it, a row each, named by
    :func:`site_name`."""
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
    sites.set_ylabel("site")
    sites.set_xlabel("round")
    if num_partitions <= 12:
        sites.set_yticks(range(num_partitions),
                         [site_name(summary, p) for p in range(num_partitions)])


def finish_axis(ax, data: Series, first: bool) -> None:
    """T_e and the phase-2 span, a mark where the run was resumed (labelled on the first
    panel), grid, integer rounds, legend."""
    from matplotlib.ticker import MaxNLocator  # lazy: 2.3 s with the canvas

    for i, t in enumerate(data.resumed):
        ax.axvline(t - 0.5, color="tab:brown", lw=1.2, ls="-.",
                   label="resumed: the run stopped, this round ran again"
                   if first and i == 0 else None)
    if data.t_e is not None:
        ax.axvline(data.t_e, color="black", lw=1, ls="--",
                   label=f"T_e = {data.t_e}" if first else None)
        ax.axvspan(data.t_e + 0.5, max(data.rounds) + 0.5, color="tab:orange",
                   alpha=0.07, label="phase 2" if first else None)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0)


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
