"""A grid's summary table, ``runs.csv``: one row per finished run, what every table and
paired comparison of the grid is computed from (:mod:`.report`, :mod:`.paired`,
:mod:`.results_docs`), so that the run folders themselves can live outside git
(:mod:`.raw_archive`; docs/RESULTS.md, "Where the runs are").

A row is read from a run folder's ``config.json``, ``summary.json`` and ``metrics.jsonl``
(:func:`run_record`). Its columns:

- ``grid``, ``run`` (the folder under the grid's, ``<row>/<column>/seed<N>`` for a grid
  run), ``row``, ``column``, ``seed``; ``config_sha256``: the first 16 hex digits of the
  sha256 of the resolved config without the keys that name folders (:func:`config_hash`);
- ``method``, ``dataset``, ``rho``, ``paper_cell`` (the paper-table cell the run
  corresponds to: :func:`.paper_cells.paper_key`), ``rounds`` planned, ``rounds_run``;
- ``status``, ``accuracy_source``, and the accuracies as fractions, at full precision:
  ``final_acc``, ``best_acc`` and ``best_round``, ``last10_acc`` (the summary's
  ``mean_last10_acc``: the last 10 rounds the run recorded), ``last10_held_acc`` (the
  last 10 planned rounds, a run the phase-2 guard ended holding the model it delivered:
  :func:`common.results.mean_last10_held`, what ``paired.md`` compares);
- ``t_e``, the phase-2 guard's verdict ``guard_restored_round`` and ``guard_ended_at``
  (empty: it did not fire, or the run has no guard), ``delivered_after_round`` (the
  model the run delivered: the one after that round; empty where the summary predates
  the record, docs/FEDEFC.md §3.4), ``wall_time_s``, and ``machine``
  (:func:`common.results.machine_record` as ``key=value; ...``; empty where the summary
  predates it).
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from common.results import accuracy_key, mean_last10_held, read_records

from .errors import UsageError
from .grid import Grid, slug
from .paper_cells import cell_text, paper_key
from .raw_archive import git_record, git_source, grid_key, write_archive, write_manifest

RUNS_FILE = "runs.csv"
LOCATION_KEYS = frozenset({"out-dir", "resume-from"})  # where a run wrote, not what it ran


@dataclass(frozen=True)
class RunRecord:
    """One row of ``runs.csv`` (the module's docstring says what each field holds)."""

    grid: str
    run: str
    row: str
    column: str
    seed: int
    config_sha256: str
    method: str
    dataset: str
    rho: float | None
    paper_cell: str
    rounds: int | None
    rounds_run: int | None
    status: str
    accuracy_source: str
    final_acc: float
    best_acc: float
    best_round: int | None
    last10_acc: float
    last10_held_acc: float | None
    t_e: int | None
    guard_restored_round: int | None
    guard_ended_at: int | None
    delivered_after_round: int | None
    wall_time_s: float | None
    machine: str

    @property
    def key(self) -> tuple[str, str, int]:
        return self.row, self.column, self.seed


COLUMNS = [f.name for f in fields(RunRecord)]
_INTS = {"seed", "rounds", "rounds_run", "best_round", "t_e", "guard_restored_round",
         "guard_ended_at", "delivered_after_round"}
_FLOATS = {"rho", "final_acc", "best_acc", "last10_acc", "last10_held_acc", "wall_time_s"}


def config_hash(config: dict[str, Any]) -> str:
    """The first 16 hex digits of the sha256 of a resolved config's canonical JSON, the
    keys that name folders left out: two runs of one config anywhere hash alike."""
    kept = {k: v for k, v in config.items() if k not in LOCATION_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_text(machine: dict[str, str] | None) -> str:
    """A summary's ``machine`` record as one comparable line; "" for none."""
    return "; ".join(f"{k}={v}" for k, v in sorted(machine.items())) if machine else ""


def run_record(run_dir: Path, grid: str, run: str, row: str, column: str) -> RunRecord:
    """The table row of the finished run in ``run_dir``."""
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = read_records(run_dir)
    key, _ = accuracy_key(rounds)
    planned = config.get("rounds", summary.get("rounds"))
    try:
        held = mean_last10_held(rounds, key, int(planned)) if planned is not None else None
    except ValueError:  # no round recorded an accuracy
        held = None
    trained = sum(1 for r in rounds if r.get("round", 0) > 0)
    return RunRecord(
        grid=grid, run=run, row=row, column=column,
        seed=int(summary.get("seed", config.get("seed", 0))),
        config_sha256=config_hash(config), method=summary.get("method", config["method"]),
        dataset=summary.get("dataset", config.get("dataset", "")), rho=config.get("rho"),
        paper_cell=cell_text(paper_key(config)), rounds=planned,
        rounds_run=summary.get("rounds_run", trained), status=summary.get("status", ""),
        accuracy_source=summary.get("accuracy_source", "server test set"),
        final_acc=summary["final_acc"], best_acc=summary["best_acc"],
        best_round=summary.get("best_round"), last10_acc=summary["mean_last10_acc"],
        last10_held_acc=held, t_e=summary.get("t_e"),
        guard_restored_round=summary.get("guard_restored_round"),
        guard_ended_at=summary.get("guard_ended_at"),
        delivered_after_round=summary.get("delivered_after_round"),
        wall_time_s=summary.get("wall_time_s"), machine=machine_text(summary.get("machine")))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)  # repr: exact round trip


def write_runs(records: list[RunRecord], path: Path) -> Path:
    """``runs.csv``, sorted by run folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(COLUMNS)
        for record in sorted(records, key=lambda r: r.run):
            writer.writerow([_text(v) for v in asdict(record).values()])
    return path


def _value(name: str, text: str) -> Any:
    if name in _INTS:
        return int(text) if text else None
    if name in _FLOATS:
        return float(text) if text else None
    return text


def read_runs(path: Path) -> list[RunRecord]:
    """The rows of a ``runs.csv``; a file with other columns is refused by name."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames != COLUMNS:
            raise UsageError(f"{path}: columns {reader.fieldnames} are not {COLUMNS}; "
                             "rewrite it with `fedefc grid report` or `fedefc results table`")
        return [RunRecord(**{k: _value(k, v) for k, v in row.items()}) for row in reader]


def collect_runs(grid_dir: Path, name: str, labels: Grid | None = None) -> list[RunRecord]:
    """The rows of every finished run under ``grid_dir`` (a folder holding
    ``summary.json``), for the table of grid ``name``. A run folder
    ``<row>/<column>/seed<N>`` gets the labels of the grid file ``labels`` whose folder
    names those are (else the folder names)."""
    rows = {slug(r): r for r in reversed(labels.rows)} if labels else {}
    columns = {slug(c): c for c in reversed(labels.columns)} if labels else {}
    records = []
    for summary in sorted(grid_dir.rglob("summary.json")):
        run_dir = summary.parent
        parts = run_dir.relative_to(grid_dir).parts
        row, column = parts[0], "/".join(parts[1:-1] if len(parts) > 1 else ())
        if len(parts) == 3:
            row, column = rows.get(parts[0], parts[0]), columns.get(parts[1], parts[1])
        records.append(run_record(run_dir, name, "/".join(parts), row, column))
    return sorted(records, key=lambda r: r.run)


def table_runs(tables: Path) -> list[RunRecord]:
    """The rows of the summary table in ``tables``; [] where there is none."""
    path = tables / RUNS_FILE
    return read_runs(path) if path.exists() else []


def missing_runs(raw: Path, tables: Path) -> list[str]:
    """The runs of the summary table in ``tables`` whose folders ``raw`` lacks."""
    have = {p.parent.relative_to(raw).as_posix() for p in raw.rglob("summary.json")}
    return sorted({r.run for r in table_runs(tables)} - have)


def publish(raw: Path, tables: Path, grid: Grid | None) -> list[RunRecord]:
    """The summary table and manifest of the run folders in ``raw`` (a grid's folder),
    written into ``tables``: the manifest names the commit that holds them where git
    holds them all, else the archive written beside ``raw``
    (:mod:`.raw_archive`). Return the table's rows."""
    key = grid_key(tables)
    records = collect_runs(raw, key, grid)
    if not records:
        raise UsageError(f"no finished run (a folder with summary.json) under {raw}; fetch "
                         f"its runs first: fedefc results fetch {key}")
    held = git_source(raw)
    if held is not None:
        repo, commit, path = held
        record, source = git_record(repo, commit, path), {"commit": commit, "path": path}
    else:
        archive = raw.parent / f"{raw.name}.tar.gz"
        record, source = write_archive(raw, archive), {"archive": archive.name}
    write_runs(records, tables / RUNS_FILE)
    write_manifest(tables, key, len(records), record, source)
    return records
