"""Tables and figures of a grid (paper Tables 1-3 and Fig. 1).

The tables are computed from the grid's summary table, ``runs.csv`` (:mod:`.run_table`),
so that they can be written again without the run folders; the plots need the run
folders. Accuracies are the server's test-set accuracies, or, for runs without a server
test set, the federated evaluation's (the clients' held-out data); the table's caption
and the plots' axes say which (``accuracy_source`` of each run).

Written beside ``runs.csv`` (:func:`write_report`):

- ``table.md`` / ``table.csv``: final-round accuracy (%) per row and column,
  mean +- std over the finished seeds, the best two per column in bold (rows without
  noise excluded, as in the paper), and the paper's number beside ours where the
  paper has that cell (``configs/reference/paper-results.toml``: :mod:`.paper_cells`).
- ``paired.md``: with a ``baseline`` row, every other row's runs as differences from
  the baseline's run of the same column and seed (:mod:`.paired`).

Written beside the run folders (:func:`write_plots`):

- ``plots/acc-<column>.png``: accuracy vs round, one line per row (first seed).
- ``plots/fig1-<column>.png``: FedEFC's averaged client accuracy A(t) with A_max and
  T_e marked beside the accuracy (Fig. 1 left), and the clients' mean cosine
  similarity between estimated Q and their true noise matrices (Fig. 1 right).
- ``plots/q-heatmap-<column>.png``: the largest client's Q, recomputed offline from the final
  global model on that client's data, next to its true noise matrix (needs the dataset).
"""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.data_plan import data_plan
from common.datasets import DatasetError
from common.methods import load_run_config
from common.results import accuracy_key, read_records
from common.runtime import initial_model
from common.training import BatchTransform, predict_proba
from common.transition import estimate_transition

from .grid import Cell, Grid, run_path, slug
from .paired import write_paired
from .paper_cells import cell_key, load_paper_numbers
from .run_table import RunRecord

Finished = dict[tuple[str, str, int], RunRecord]  # (row, column, seed) -> its table row


def finished_runs(grid: Grid, records: list[RunRecord]) -> Finished:
    """The grid's cells that have a row in its summary table (matched by run folder), in
    the grid's run order."""
    by_run = {r.run: r for r in records}
    return {(row, col, seed): by_run[run] for row, col, seed in grid.plan()
            if (run := run_path(row, col, seed)) in by_run}


def cell_stats(runs: list[RunRecord]) -> dict[str, Any]:
    """Mean/std of final and mean-of-last-10 accuracy (%) over a row x column's finished
    seeds, the mean best accuracy, and per seed T_e and the round of the best accuracy."""
    if not runs:
        return {"n": 0}
    finals = [100 * r.final_acc for r in runs]
    return {"n": len(runs), "mean": float(np.mean(finals)), "std": float(np.std(finals)),
            "last10": float(np.mean([100 * r.last10_acc for r in runs])),
            "best": float(np.mean([100 * r.best_acc for r in runs])),
            "best_round": [r.best_round for r in runs], "t_e": [r.t_e for r in runs],
            "seeds": [r.seed for r in runs], "sources": {r.accuracy_source for r in runs}}


def _fmt(stats: dict[str, Any]) -> str:
    if not stats.get("n"):
        return "–"
    text = f"{stats['mean']:.2f}"
    return text + (f" ± {stats['std']:.2f}" if stats["n"] > 1 else "")


def table_stats(grid: Grid, finished: Finished) -> dict[tuple[str, str], dict[str, Any]]:
    """:func:`cell_stats` per row and column, with the paper's number of the cell (from
    its first finished run) and whether the row is noiseless."""
    paper = load_paper_numbers()
    table = {}
    for row in grid.rows:
        for col in grid.columns:
            runs = [r for (r_, c_, _), r in finished.items() if (r_, c_) == (row, col)]
            stats = cell_stats(runs)
            key = cell_key(runs[0].paper_cell) if runs else None
            stats["paper"] = paper.get(key) if key else None
            stats["noiseless"] = bool(runs) and runs[0].rho == 0.0
            table[(row, col)] = stats
    return table


def write_report(grid: Grid, records: list[RunRecord], out: Path) -> list[Path]:
    """Write the tables (md, csv) and, for a grid with a baseline, ``paired.md`` of the
    runs in ``records`` into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    finished = finished_runs(grid, records)
    table = table_stats(grid, finished)
    written = [out / "table.md", _write_csv(grid, table, out)]
    written[0].write_text(markdown_table(grid, table) + "\n")
    paired = write_paired(grid, finished, out)
    return written + ([paired] if paired else [])


def _best_two(grid: Grid, table, col: str) -> set[str]:
    ranked = sorted((s["mean"], r) for r in grid.rows
                    if (s := table[(r, col)]).get("n") and not s["noiseless"])
    return {r for _, r in ranked[-2:]}


def markdown_table(grid: Grid, table) -> str:
    """``table.md``'s text (without its last newline)."""
    has_paper = any(s.get("paper") for s in table.values())
    head = ["method"]
    for col in grid.columns:
        head += [f"{col} ours"] + ([f"{col} paper"] if has_paper else [])
    sources = sorted(set().union(*(s.get("sources", set()) for s in table.values())))
    what = " and ".join(sources) if sources else "server test set"
    lines = [f"### {grid.title}", "",
             f"Final-round accuracy (%) on the {what}, mean ± std over seeds; best two per "
             "column in "
             "bold (noiseless rows excluded)." + (" Paper: the published mean ± std of 3 "
                                                  "trials." if has_paper else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in grid.rows:
        cols = [row]
        for col in grid.columns:
            stats = table[(row, col)]
            text = _fmt(stats)
            if stats.get("n") and row in _best_two(grid, table, col):
                text = f"**{text}**"
            cols.append(text)
            if has_paper:
                cols.append(f"{stats['paper'][0]:.2f} ± {stats['paper'][1]:.2f}"
                            if stats.get("paper") else "–")
        lines.append("| " + " | ".join(cols) + " |")
    seeds = sorted({s for st in table.values() for s in st.get("seeds", [])})
    lines += ["", f"Seeds finished: {seeds}. T_e per cell is in table.csv."]
    return "\n".join(lines)


def _write_csv(grid: Grid, table, out: Path) -> Path:
    path = out / "table.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["row", "column", "n_seeds", "final_mean", "final_std", "last10_mean",
                         "best_mean", "best_round", "t_e", "seeds", "paper_mean", "paper_std"])
        for (row, col), s in table.items():
            paper = s.get("paper") or (None, None)
            writer.writerow([row, col, s.get("n", 0), _round(s.get("mean")),
                             _round(s.get("std")), _round(s.get("last10")),
                             _round(s.get("best")),
                             " ".join(str(t) for t in s.get("best_round", [])),
                             " ".join(str(t) for t in s.get("t_e", [])),
                             " ".join(str(x) for x in s.get("seeds", [])), *paper])
    return path


def _round(value):
    return None if value is None else round(value, 3)


def _curve(recs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(rounds, accuracy in %) of the rounds whose record has ``key``."""
    points = [(r["round"], 100 * r[key]) for r in recs if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(grid: Grid, cells: list[Cell], out: Path) -> list[Path]:
    """The plots of the finished cells (their run folders) into ``out/plots``."""
    # lazily: pyplot adds 0.3 s to every `fedefc` command; only grid reports draw
    import matplotlib  # 0.3 s with pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # 0.3 s, lazily (above)

    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    first_seed = {(c.row, c.column): c for c in reversed(cells) if c.done}
    for col in grid.columns:
        done = [first_seed[(r, col)] for r in grid.rows if (r, col) in first_seed]
        if not done:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        labels = set()
        for cell in done:
            recs = [r for r in read_records(cell.out_dir) if r["round"] > 0]
            key, label = accuracy_key(recs)
            labels.add(label)
            ax.plot(*_curve(recs, key), label=cell.row, lw=1.2)
        title = textwrap.fill(grid.title, 70)  # a grid title is longer than the plot
        ax.set(xlabel="round", ylabel=" / ".join(sorted(labels)) + " (%)",
               title=f"{title}\n{col}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        path = plots / f"acc-{slug(col)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        efc = next((c for c in done if c.config["method"] == "fedefc"), None)
        if efc is not None:
            written.append(_fig1(plt, efc, plots / f"fig1-{slug(col)}.png", col))
            heat = _q_heatmap(plt, efc, plots / f"q-heatmap-{slug(col)}.png", col)
            if heat is not None:
                written.append(heat)
    return written


def _fig1(plt, cell: Cell, path: Path, col: str) -> Path:
    recs = [r for r in read_records(cell.out_dir) if r["round"] > 0]
    summary = json.loads((cell.out_dir / "summary.json").read_text())
    t_e = summary.get("t_e")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    a = [(r["round"], 100 * r["A"]) for r in recs if r.get("A") is not None]
    left.plot(*zip(*a), "o-", ms=3, label="A(t): mean client accuracy of the global model")
    key, label = accuracy_key(recs)
    left.plot(*_curve(recs, key), label=label)
    if summary.get("A_max"):
        left.axhline(100 * summary["A_max"], ls=":", c="gray", label="A_max")
    if t_e is not None:
        left.axvline(t_e, ls="--", c="red", label=f"prestopping point T_e = {t_e}")
    left.set(xlabel="round", ylabel="accuracy (%)", title=f"FedEFC, {col}: phase 1 -> phase 2")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    q = [(r["round"], r["q_cos"]) for r in recs if r.get("q_cos") is not None]
    if q:
        right.plot(*zip(*q), "o-", ms=3)
    right.set(xlabel="round", ylabel="cosine similarity",
              title="estimated Q vs true noise matrix (mean over clients)")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _q_heatmap(plt, cell: Cell, path: Path, col: str) -> Path | None:
    """The largest client's Q from the final global model (recomputed here), beside
    its true noise matrix."""
    model_path = cell.out_dir / "model.pt"
    if not model_path.exists():
        return None
    cfg = load_run_config(cell.config)
    try:
        fed = data_plan(cfg)
    except (DatasetError, OSError):
        return None
    client = int(np.argmax([len(ix) for ix in fed.client_indices]))
    idx = fed.client_indices[client]
    model = initial_model(cfg, fed.data.task)
    model.load_state_dict(torch.load(model_path, map_location="cpu"))
    probs = predict_proba(model, fed.data.train_x[torch.as_tensor(idx)],
                          BatchTransform.of(fed.data.spec, torch.device("cpu")))
    q = estimate_transition(probs, fed.noisy_labels[idx], cfg.count_rule, cfg.weighting)
    truth = fed.client_true_transition(client)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    for ax, mat, title in ((axes[0], q, "estimated Q (final global model)"),
                           (axes[1], truth, "true noise matrix")):
        im = ax.imshow(mat, vmin=0, vmax=1, cmap="viridis")
        ax.set(xlabel="true label j", ylabel="observed label i", title=title)
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(f"FedEFC, {col}: client {client} ({len(idx)} samples)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
