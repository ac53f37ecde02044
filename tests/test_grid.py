"""The experiment runner on a tiny grid: real runs, resume, table and plots."""

import csv
import json
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from common.config import ConfigError
from common.methods import changed_keys, default_config, load_run_config
from fedefc_cli.grid import Cell, Grid, check_finished, run_grid
from fedefc_cli.main import main
from fedefc_cli.paper_cells import load_paper_numbers, paper_key
from fedefc_cli.raw_archive import folder_record
from fedefc_cli.run_configs import CONFIGS_DIR
from fedefc_cli.run_table import read_runs
from fedefc_cli.simulation import run_simulation_job
from fedefc_server import checkpoint

GRID = """
name = "tiny"
title = "tiny grid"
seeds = [0, 1]
[rows]
"FedAvg" = {{ method = "fedavg" }}
"FedEFC" = {{ method = "fedefc", accuracy-signal = "global" }}
[columns.small]
dataset = "mnist"
data-dir = "{data}"
model = "lenet"
num-clients = 4
fraction = 1.0
rounds = 3
local-epochs = 1
batch-size = 16
start-round = 0
gamma-thr = 1
iid = true
rho = 0.2
zeta = 0.4
"""


@pytest.fixture(scope="module")
def finished_grid(tmp_path_factory, tiny_mnist_dir):
    base = tmp_path_factory.mktemp("grid")
    path = base / "tiny.toml"
    path.write_text(GRID.format(data=tiny_mnist_dir))
    logs = []
    failures = run_grid(Grid.load(path), base / "results", [], log=logs.append)
    return path, base / "results", failures, logs


@pytest.mark.flower
def test_grid_runs_every_cell(finished_grid):
    path, results, failures, logs = finished_grid
    assert failures == 0
    assert not any("resumed" in line for line in logs)  # fresh cells start at round 1
    cells = Grid.load(path).cells(results, [])
    assert len(cells) == 4 and all(c.done for c in cells)
    assert any("[4/4]" in line for line in logs)


@pytest.mark.flower
def test_rerun_skips_finished_cells_and_writes_the_report(finished_grid, capsys):
    path, results, _, _ = finished_grid
    before = {c.out_dir: (c.out_dir / "summary.json").stat().st_mtime_ns
              for c in Grid.load(path).cells(results, [])}
    assert main(["grid", "run", str(path), "--results-dir", str(results)]) == 0
    assert "0 to run now" in capsys.readouterr().out
    after = {d: (d / "summary.json").stat().st_mtime_ns for d in before}
    assert before == after
    table = (results / "tiny" / "table.md").read_text()
    assert "| FedAvg |" in table and "| FedEFC |" in table and "±" in table
    rows = list(csv.DictReader(open(results / "tiny" / "table.csv")))
    assert {r["row"] for r in rows} == {"FedAvg", "FedEFC"}
    assert all(r["n_seeds"] == "2" for r in rows)
    summaries = [json.loads((c.out_dir / "summary.json").read_text())
                 for c in Grid.load(path).cells(results, []) if c.row == "FedEFC"]
    mean = sum(100 * s["final_acc"] for s in summaries) / 2
    efc = next(r for r in rows if r["row"] == "FedEFC")
    assert float(efc["final_mean"]) == pytest.approx(mean, abs=1e-3)
    assert float(efc["best_mean"]) == pytest.approx(
        sum(100 * s["best_acc"] for s in summaries) / 2, abs=1e-3)
    assert efc["best_round"] == " ".join(str(s["best_round"]) for s in summaries)
    for name in ("acc-small.png", "fig1-small.png", "q-heatmap-small.png"):
        png = results / "tiny" / "plots" / name
        assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.flower
def test_the_tables_need_only_the_summary_table(finished_grid, tmp_path):
    """``grid report`` writes the summary table and a manifest naming the archive it wrote
    beside the runs (its contents give the sha256 the manifest records); from the summary
    table alone, with none of the run folders, it writes the same table."""
    path, results, _, _ = finished_grid
    assert main(["grid", "report", str(path), "--results-dir", str(results)]) == 0
    manifest = json.loads((results / "tiny" / "manifest.json").read_text())
    assert (manifest["grid"], manifest["runs"], manifest["archive"]) == ("tiny", 4,
                                                                         "tiny.tar.gz")
    with tarfile.open(results / "tiny.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert folder_record(tmp_path / "unpacked") == {
        k: manifest[k] for k in ("sha256", "files", "bytes")}
    runs = {r.run: r for r in read_runs(results / "tiny" / "runs.csv")}
    for cell in Grid.load(path).cells(results, []):
        summary = json.loads((cell.out_dir / "summary.json").read_text())
        run = runs[cell.out_dir.relative_to(results / "tiny").as_posix()]
        assert (run.row, run.seed, run.final_acc, run.t_e) == (
            cell.row, cell.seed, summary["final_acc"], summary.get("t_e"))
    alone = tmp_path / "alone"
    (alone / "tiny").mkdir(parents=True)
    shutil.copy(results / "tiny" / "runs.csv", alone / "tiny" / "runs.csv")
    assert main(["grid", "report", str(path), "--results-dir", str(alone)]) == 0
    assert (alone / "tiny" / "table.md").read_text() == \
        (results / "tiny" / "table.md").read_text()
    assert not (alone / "tiny" / "plots").exists()  # the plots need the runs


@pytest.mark.flower
def test_a_finished_cell_with_another_config_is_refused(finished_grid):
    path, results, _, _ = finished_grid
    with pytest.raises(ConfigError, match="another config"):
        run_grid(Grid.load(path), results, ["lr=0.05"], log=lambda *_: None)


def test_a_finished_cell_is_the_same_wherever_its_results_tree_now_lies(tmp_path):
    """A results tree cloned or moved elsewhere records the out-dir it was run in; its
    cells still count as finished, and a changed key is still refused, naming it."""
    config = load_run_config({"out-dir": "/elsewhere/results/g/fedavg/c/seed0"}).to_flat()
    cell = Cell("FedAvg", "c", 0, {**config, "out-dir": str(tmp_path / "seed0")})
    cell.out_dir.mkdir()
    (cell.out_dir / "config.json").write_text(json.dumps(config))
    check_finished(cell)
    with pytest.raises(ConfigError, match=r"'lr': \(0.03, 0.05\)"):
        check_finished(Cell("FedAvg", "c", 0, {**cell.config, "lr": 0.05}))


def test_a_grid_run_can_be_kept_to_some_rows(tmp_path, tiny_mnist_dir):
    """``fedefc grid run --row LABEL``: only that row's cells count and run; a label the
    grid lacks is refused before anything runs."""
    path = tmp_path / "tiny.toml"
    path.write_text(GRID.format(data=tiny_mnist_dir))
    logs = []
    assert run_grid(Grid.load(path), tmp_path / "results", [], max_cells=0, log=logs.append,
                    rows=["FedAvg"]) == 0
    assert logs == ["grid tiny: 2 cells, 0 finished, 0 to run now"]
    with pytest.raises(ConfigError, match=r"no row \['FedProx'\]; its rows: FedAvg, FedEFC"):
        run_grid(Grid.load(path), tmp_path / "results", [], rows=["FedProx"])
    assert not (tmp_path / "results").exists()


def test_a_grid_run_can_be_kept_to_some_seeds(tmp_path, tiny_mnist_dir):
    """``fedefc grid run --seed N``: only that seed's cells count and run; a seed no cell
    has is refused before anything runs."""
    path = tmp_path / "tiny.toml"
    path.write_text(GRID.format(data=tiny_mnist_dir))
    cells = Grid.load(path).cells(tmp_path / "results", [])
    logs = []
    assert run_grid(Grid.load(path), tmp_path / "results", [], max_cells=0, log=logs.append,
                    seeds=[cells[0].seed]) == 0
    wanted = sum(c.seed == cells[0].seed for c in cells)
    assert logs == [f"grid tiny: {wanted} cells, 0 finished, 0 to run now"]
    with pytest.raises(ConfigError, match=r"no cell of seed \[99\] in rows \['FedAvg'\]"):
        run_grid(Grid.load(path), tmp_path / "results", [], rows=["FedAvg"], seeds=[99])
    assert not (tmp_path / "results").exists()


def test_paper_numbers_match_the_papers_table():
    paper = load_paper_numbers()
    cfg = {"dataset": "mnist", "alpha-dir": 10.0, "p": 0.5, "rho": 0.2, "zeta": 0.8,
           "noise-groups": "", "iid": False}
    assert paper[paper_key({**cfg, "method": "fedefc"})] == (98.51, 0.46)
    assert paper[paper_key({**cfg, "method": "fedavg"})] == (96.31, 0.42)
    assert paper[paper_key({**cfg, "method": "fedavg", "rho": 0.0})] == (99.51, 0.02)
    assert paper_key({**cfg, "dataset": "mnist-embedded", "method": "fedefc"}) is None
    assert len(paper) == 9 * 10 + 9 * 9 + 3 * 9


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIGS_DIR / "grids").glob("*.toml")))
def test_every_shipped_grid_builds_valid_cells(name, tmp_path):
    """The paper's datasets read data-dir; the own-data grids name their files themselves."""
    overrides = [] if name in ("own-data", "fresh-federations") else ["data-dir=/data"]
    cells = Grid.load(name).cells(tmp_path, overrides)
    assert cells and len({c.out_dir for c in cells}) == len(cells)


def test_a_key_added_later_with_its_default_does_not_orphan_finished_cells():
    wanted = default_config()
    stored = {k: v for k, v in wanted.items() if k != "faults"}  # made before "faults" existed
    assert changed_keys(stored, wanted) == {}
    assert changed_keys(stored, {**wanted, "faults": "raise@1"}) == {
        "faults": ("", "raise@1")}


def test_ablations_and_variants_get_no_paper_number():
    """Only the paper's own choices map to its numbers (ablations vary
    count-rule, accuracy-signal, weighting; RoFL's detached variant is not the paper's)."""
    paper = load_paper_numbers()
    base = {"dataset": "mnist", "alpha-dir": 10.0, "p": 0.5, "rho": 0.2, "zeta": 0.8,
            "method": "fedefc", "count-rule": "cleanlab", "accuracy-signal": "global",
            "weighting": "none"}
    assert paper[paper_key(base)] == (98.51, 0.46)
    for change in ({"count-rule": "masked"}, {"count-rule": "paper"},
                   {"accuracy-signal": "local-train"}, {"weighting": "label-prior"},
                   {"prestopping": False}):
        assert paper_key({**base, **change}) is None, change
    # at p = 0.2 the paper's FedEFC is the label-prior weighted one
    low_p = {**base, "alpha-dir": 1.0, "p": 0.2}
    assert paper_key(low_p) is None
    assert paper[paper_key({**low_p, "weighting": "label-prior"})] == (96.78, 0.60)
    rofl = {**base, "method": "rofl", "rho": 0.4}
    assert paper[paper_key(rofl)] == (68.50, 0.27)
    assert paper_key({**rofl, "rofl-detach-centroid-feature": True}) is None


@pytest.mark.flower
def test_an_interrupted_cell_continues_from_its_checkpoint(finished_grid, tmp_path):
    """A cell stopped after round 2 of 3 resumes there, and ends bit-identical to the
    same cell run uninterrupted (CPU; fedavg/fedefc keep no client state)."""
    path, results, _, _ = finished_grid
    fresh = tmp_path / "results"
    cell = Grid.load(path).cells(fresh, [])[0]
    whole = Grid.load(path).cells(results, [])[0].out_dir
    # The state an interruption after round 2 leaves: a 2-round run of the same config
    # whose stored config and checkpoint say rounds = 3.
    run_simulation_job({**cell.config, "rounds": 2}, log_path=tmp_path / "part.log")
    for name in ("summary.json", "model.pt"):
        (cell.out_dir / name).unlink()
    stored = json.loads((cell.out_dir / "config.json").read_text())
    (cell.out_dir / "config.json").write_text(json.dumps({**stored, "rounds": 3}))
    ckpt = checkpoint.load(cell.out_dir)
    assert ckpt.round == 2
    checkpoint.save(cell.out_dir, checkpoint.Checkpoint(
        ckpt.round, ckpt.weights, ckpt.strategy, {**ckpt.config, "rounds": 3}, ckpt.elapsed_s))
    logs = []
    assert run_grid(Grid.load(path), fresh, [], max_cells=1, log=logs.append) == 0
    assert any("resumed from its checkpoint" in line for line in logs)
    assert f"resuming {cell.out_dir} after round 2" in (cell.out_dir / "run.log").read_text()
    # the resumed cell counts as finished with the grid's config on the next run
    logs.clear()
    assert run_grid(Grid.load(path), fresh, [], max_cells=0, log=logs.append) == 0
    assert "1 finished" in logs[0]
    a, b = torch.load(whole / "model.pt"), torch.load(cell.out_dir / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rounds = [json.loads(line)["round"] for line in
              (cell.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]
    shutil.rmtree(fresh)


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``fedefc grid list ... | head``: the closed pipe ends the command with exit 0 and
    no traceback, the rest of its output discarded (the pipe's end is simulated)."""
    script = ("import sys\n"
              "from fedefc_cli import main as cli\n"
              "def lister(args):\n"
              "    print('a line', flush=True)\n"
              "    raise BrokenPipeError(32, 'Broken pipe')\n"
              "cli.cmd_grid = lister\n"
              "code = cli.main(['grid', 'list', 'cross-silo'])\n"
              "print('discarded')\n"
              "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=CONFIGS_DIR.parent)
    assert (done.returncode, done.stdout, done.stderr) == (0, "a line\n", "")
