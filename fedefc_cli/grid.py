"""The experiment runner: a grid of methods x settings x seeds, each cell one Flower run.

A grid file (TOML, see ``configs/grids/``)::

    name = "mnist-lite-table1"          # results go to <results-dir>/<name>/
    title = "..."                       # the table's caption
    preset = "mnist-lite"               # configs/<preset>.toml
    seeds = [0]                         # every row x column; [] for none
    [rows]                              # table rows: label -> run-config overrides
    "FedEFC" = { method = "fedefc" }
    [columns]                           # table columns: label -> run-config overrides
    "(10, 0.5)" = { alpha-dir = 10.0, p = 0.5 }
    [[extra]]                           # optional: more cells for some rows (and columns)
    rows = ["FedEFC"]
    columns = ["(10, 0.5)"]             # optional, default every column
    seeds = [1, 2]

``baseline = "FedAvg"`` (optional) names the row every other row is compared with seed
by seed in ``paired.md`` (:mod:`.paired`); ``chance = "..."`` (optional, with a baseline)
names the row that reruns the baseline with a change no result should depend on, whose
differences bound what chance alone does to a per-seed comparison; ``pair-with = { "row"
= "its own baseline row" }`` (optional, with a baseline) pairs a row also with another
row that holds the same data, e.g. FedEFC with the coordinator's draw with FedAvg on the
samples its clients hold.

A cell's run config is pyproject defaults < grid preset < column (its own ``preset``
first, if any) < row < ``--set`` overrides, plus ``seed`` and ``out-dir``. Cells run in
order through :func:`.simulation.run_simulation_job` (real ``flwr run``);
a cell whose folder holds ``summary.json`` is finished and skipped, so an interrupted
grid resumes where it stopped. The cell that was interrupted continues from its last
checkpoint when that is exact (:func:`resumable`: the methods whose clients keep no
state across rounds, docs/RELIABILITY.md) and its checkpoint matches the cell's config;
otherwise its partial folder is removed and it reruns from round 1. A finished cell
whose stored config differs from the one the grid asks for now is an error (results are
never mixed silently).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.methods import changed_keys, load_run_config, resumes_exactly
from common.private_files import make_private_dir
from common.results import check_output_dir
from fedefc_server import checkpoint
from fedefc_server.prestopping_replay import same_run_with_gain

from .errors import LaunchError
from .run_configs import CONFIGS_DIR, parse_overrides, read_app_defaults, read_preset
from .simulation import run_simulation_job


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    row: str
    column: str
    seed: int
    config: dict[str, Any]

    @property
    def out_dir(self) -> Path:
        return Path(self.config["out-dir"])

    @property
    def done(self) -> bool:
        return (self.out_dir / "summary.json").exists()


@dataclass
class Grid:
    """A parsed grid file."""

    name: str
    title: str
    preset: str | None
    seeds: list[int]
    rows: dict[str, dict[str, Any]]
    columns: dict[str, dict[str, Any]]
    extra: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None
    baseline: str | None = None
    chance: str | None = None
    pair_with: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Grid:
        path = Path(path)
        if not path.suffix:
            path = CONFIGS_DIR / "grids" / f"{path}.toml"
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"grid file {path} not found") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"grid file {path} is not valid TOML: {err}") from None
        unknown = set(raw) - {"name", "title", "preset", "seeds", "rows", "columns", "extra",
                              "baseline", "chance", "pair-with"}
        if unknown:
            raise ConfigError(f"grid file {path}: unknown keys {sorted(unknown)}")
        for key in ("name", "rows", "columns"):
            if key not in raw:
                raise ConfigError(f"grid file {path}: missing {key!r}")
        grid = cls(name=raw["name"], title=raw.get("title", raw["name"]),
                   preset=raw.get("preset"), seeds=list(raw.get("seeds", [0])),
                   rows=dict(raw["rows"]), columns=dict(raw["columns"]),
                   extra=list(raw.get("extra", [])), path=path,
                   baseline=raw.get("baseline"), chance=raw.get("chance"),
                   pair_with=dict(raw.get("pair-with", {})))
        if grid.baseline is not None and grid.baseline not in grid.rows:
            raise ConfigError(f"grid file {path}: baseline = {grid.baseline!r} is not one of "
                              f"its rows ({', '.join(grid.rows)}); name a row or drop the key")
        if grid.chance is not None and (grid.chance not in grid.rows or grid.baseline is None
                                        or grid.chance == grid.baseline):
            raise ConfigError(f"grid file {path}: chance = {grid.chance!r} must name a row other "
                              f"than the baseline (rows: {', '.join(grid.rows)}; baseline: "
                              f"{grid.baseline!r}); name the row that reruns the baseline with a "
                              "change no result should depend on, or drop the key")
        for row, own in grid.pair_with.items():
            if grid.baseline is None or row not in grid.rows or own not in grid.rows \
                    or own == row:
                raise ConfigError(
                    f"grid file {path}: pair-with {row!r} = {own!r} must pair a row with "
                    f"another row, beside a baseline (rows: {', '.join(grid.rows)}; "
                    f"baseline: {grid.baseline!r}); name two rows, or drop the pair")
        for block in grid.extra:
            for key, known in (("rows", grid.rows), ("columns", grid.columns)):
                missing = set(block.get(key, [])) - set(known)
                if missing:
                    raise ConfigError(f"grid file {path}: [[extra]] names unknown {key} "
                                      f"{sorted(missing)}")
        return grid

    def plan(self) -> list[tuple[str, str, int]]:
        """Every cell's (row, column, seed), in run order (seed-major)."""
        plan: list[tuple[str, str, int]] = []
        for seed in self.seeds:
            plan += [(r, c, seed) for c in self.columns for r in self.rows]
        for block in self.extra:
            for seed in block["seeds"]:
                plan += [(r, c, seed) for c in block.get("columns", self.columns)
                         for r in block["rows"] if (r, c, seed) not in plan]
        return plan

    def cells(self, results_dir: Path, overrides: list[str]) -> list[Cell]:
        """Every cell with its validated run config, in run order (seed-major)."""
        base = {**read_app_defaults(), **read_preset(self.preset)}
        cli = parse_overrides(overrides)
        cells = []
        for row, col, seed in self.plan():
            column = dict(self.columns[col])
            merged = {**base, **read_preset(column.pop("preset", None)), **column,
                      **self.rows[row], **cli, "seed": seed}
            merged["out-dir"] = str(results_dir / self.name / run_path(row, col, seed))
            try:
                cfg = load_run_config(merged)
            except ConfigError as err:
                raise ConfigError(f"cell ({row}, {col}, seed {seed}): {err}") from None
            cells.append(Cell(row, col, seed, cfg.to_flat()))
        return cells


def slug(label: str) -> str:
    """A folder name for a row or column label."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-").lower() or "x"


def run_path(row: str, column: str, seed: int) -> str:
    """A cell's run folder under its grid's: ``<row>/<column>/seed<N>``."""
    return f"{slug(row)}/{slug(column)}/seed{seed}"


def check_finished(cell: Cell) -> None:
    """A finished cell must have been run with exactly this config (wherever its folder
    was then), or with a
    ``prestopping-min-gain`` whose replay on its records shows it is the same run
    (``fedefc_server/prestopping_replay.py``)."""
    stored = json.loads((cell.out_dir / "config.json").read_text())
    # a cell finished by resuming records resume-from = its own folder; a results tree
    # moved or cloned elsewhere records the folder it was run in
    diff = changed_keys(stored, cell.config, frozenset({"resume-from", "out-dir"}))
    gain = diff.get("prestopping-min-gain")
    if gain is not None and same_run_with_gain(cell.out_dir, gain[1]):
        del diff["prestopping-min-gain"]  # the wanted gain would have fired where this run did
    if diff:
        raise ConfigError(
            f"cell {cell.out_dir} was run with another config ({diff}, stored -> wanted); "
            "use another --results-dir or remove that cell"
        )


def resumable(cell: Cell) -> bool:
    """Whether the interrupted attempt in ``cell.out_dir`` can be continued exactly: the
    run resumes exactly (:func:`resumes_exactly`: its clients keep no state that a new
    Flower run starts empty; docs/RELIABILITY.md) and its checkpoint is this cell's."""
    if not resumes_exactly(load_run_config(cell.config)):
        return False
    try:
        ckpt = checkpoint.load(cell.out_dir)
        stored = json.loads((cell.out_dir / "config.json").read_text())
    except (checkpoint.CheckpointError, OSError, json.JSONDecodeError):
        return False
    ignore = frozenset({"out-dir", "resume-from"})
    return (not changed_keys(stored, cell.config, ignore)
            and not changed_keys(ckpt.config, cell.config, ignore)
            and ckpt.round < int(cell.config["rounds"]))


def run_grid(grid: Grid, results_dir: Path, overrides: list[str], max_cells: int | None = None,
             client_cpus: int = 1, client_gpus: float = 0.0, log=print,
             rows: list[str] | None = None, ray_address: str | None = None,
             seeds: list[int] | None = None) -> int:
    """Run the unfinished cells (of ``rows`` and ``seeds`` only, when given), on the Ray
    cluster at ``ray_address`` when given; return how many failed."""
    unknown = set(rows or []) - set(grid.rows)
    if unknown:
        raise ConfigError(f"grid {grid.name}: no row {sorted(unknown)}; its rows: "
                          f"{', '.join(grid.rows)}")
    cells = [c for c in grid.cells(results_dir, overrides)
             if (rows is None or c.row in rows) and (seeds is None or c.seed in seeds)]
    if seeds is not None and not cells:
        raise ConfigError(f"grid {grid.name}: no cell of seed {sorted(seeds)}"
                          + (f" in rows {rows}" if rows else "") + "; name a seed it runs")
    for cell in cells:
        if cell.done:
            check_finished(cell)
    todo = [c for c in cells if not c.done][:max_cells]
    total, done0 = len(cells), sum(c.done for c in cells)
    log(f"grid {grid.name}: {total} cells, {done0} finished, {len(todo)} to run now")
    failures, durations = 0, []
    for i, cell in enumerate(todo):
        resume = cell.out_dir.exists() and resumable(cell)
        if resume:  # interrupted: continue it
            config = {**cell.config, "resume-from": str(cell.out_dir)}
        else:
            config = cell.config
            if cell.out_dir.exists():  # an interrupted attempt that cannot continue exactly
                shutil.rmtree(cell.out_dir)
            check_output_dir(cell.out_dir)
        eta = (sum(durations) / len(durations) * (len(todo) - i)) if durations else None
        log(f"[{done0 + i + 1}/{total}] {cell.row} | {cell.column} | seed {cell.seed}"
            + (" | resumed from its checkpoint" if resume else "")
            + (f" | ETA {eta / 60:.0f} min" if eta is not None else ""))
        start = time.monotonic()
        make_private_dir(cell.out_dir)
        try:
            summary = run_simulation_job(config, client_cpus, client_gpus,
                                         log_path=cell.out_dir / "run.log",
                                         ray_address=ray_address)
            log(f"    final acc {summary.get('final_acc')}, T_e {summary.get('t_e')}, "
                f"{time.monotonic() - start:.0f} s"
                + (f" | DEGRADED: {summary['degraded']}" if summary.get("degraded") else ""))
        except (LaunchError, OSError) as err:
            failures += 1
            log(f"    FAILED: {err}")
        durations.append(time.monotonic() - start)
    return failures
