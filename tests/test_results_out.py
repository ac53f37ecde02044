"""Grid results out of git: the summary table (``runs.csv``) read by hand, the
deterministic archive and its sha256, ``fedefc results fetch`` from git history (a
shallow clone too) and from an archive, the runner's refusal to mix a stored table with
missing runs, and docs/RESULTS.md's tables as ``fedefc results docs`` writes them."""

import gzip
import hashlib
import json
import os
import subprocess
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from fedefc_cli.errors import UsageError
from fedefc_cli.grid import Grid
from fedefc_cli.main import main
from fedefc_cli.raw_archive import (
    MANIFEST,
    TREE_RESULTS,
    fetch,
    folder_record,
    manifests,
    write_archive,
)
from fedefc_cli.report import finished_runs
from fedefc_cli.results_docs import (
    DOCS,
    DocsError,
    _at_least,
    cells,
    compare,
    grids,
    render_docs,
    seeds,
)
from fedefc_cli.run_table import (
    RUNS_FILE,
    RunRecord,
    config_hash,
    publish,
    read_runs,
    run_record,
    write_runs,
)

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

GRID = """
name = "g"
title = "g"
baseline = "FedAvg"
seeds = [0, 1]
[rows]
"FedAvg" = { method = "fedavg" }
"FedEFC" = { method = "fedefc" }
[columns]
"IID" = { iid = true }
"""


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=GIT_ENV).stdout


def write_run(folder: Path, accs, summary=None, config=None):
    """A run folder: rounds 1.. at ``accs`` (round 0 at 0.1), its config and summary."""
    folder.mkdir(parents=True)
    config = {"method": "fedefc", "dataset": "mnist-embedded", "rounds": 5, "rho": 0.2,
              "seed": 3, "out-dir": str(folder), "lr": 0.03, **(config or {})}
    (folder / "config.json").write_text(json.dumps(config))
    rounds = [{"round": 0, "test_acc": 0.1}] + [{"round": t, "test_acc": a}
                                                  for t, a in enumerate(accs, 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (folder / "summary.json").write_text(json.dumps({
        "final_acc": accs[-1], "best_acc": max(accs), "best_round": accs.index(max(accs)) + 1,
        "mean_last10_acc": sum(accs) / len(accs), "seed": config["seed"],
        **(summary or {})}))


def test_a_run_is_read_into_its_table_row(tmp_path):
    # 5 planned rounds; the guard ended the run after round 4, holding round 4's model
    # (0.7) in round 5: last 10 planned = (0.5 + 0.6 + 0.8 + 0.7 + 0.7) / 5 = 0.66, its
    # own last rounds (0.5 + 0.6 + 0.8 + 0.7) / 4 = 0.65
    write_run(tmp_path / "run", [0.5, 0.6, 0.8, 0.7], {
        "t_e": 2, "guard_restored_round": 3, "guard_ended_at": 4, "status": "completed",
        "delivered_after_round": 2,
        "wall_time_s": 12.5, "machine": {"torch": "2", "cpu": "X"}, "method": "fedefc"})
    r = run_record(tmp_path / "run", "grid", "fedefc/iid/seed3", "FedEFC", "IID")
    assert (r.seed, r.rounds, r.rounds_run, r.final_acc, r.best_acc, r.best_round) == \
        (3, 5, 4, 0.7, 0.8, 3)
    assert r.last10_acc == pytest.approx(0.65) and r.last10_held_acc == pytest.approx(0.66)
    assert (r.t_e, r.guard_restored_round, r.guard_ended_at, r.delivered_after_round) == \
        (2, 3, 4, 2)
    assert (r.machine, r.status, r.paper_cell, r.accuracy_source) == \
        ("cpu=X; torch=2", "completed", "", "server test set")
    # the hash ignores where a run wrote, not what it ran
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert r.config_sha256 == config_hash({**config, "out-dir": "/elsewhere"})
    assert r.config_sha256 != config_hash({**config, "lr": 0.05})


def test_the_table_reads_back_exactly(tmp_path):
    write_run(tmp_path / "run", [0.1 + 0.2, 0.30000000000000004])
    record = replace(run_record(tmp_path / "run", "g", "a/b/seed3", 'row, "quoted"', "c, d"),
                     wall_time_s=None)
    path = write_runs([record], tmp_path / RUNS_FILE)
    assert read_runs(path) == [record]
    path.write_text(path.read_text().replace("config_sha256", "hash"))
    with pytest.raises(UsageError, match="columns .* are not"):
        read_runs(path)


def make_grid_folder(root: Path) -> Path:
    grid = root / "g"
    write_run(grid / "fedavg" / "iid" / "seed0", [0.5, 0.6])
    write_run(grid / "fedefc" / "iid" / "seed0", [0.5, 0.7])
    (grid / "fedefc" / "iid" / "seed0" / "checkpoint.pt").write_bytes(b"resume state")
    (grid / "plots").mkdir()
    (grid / "plots" / "acc.png").write_bytes(bytes(range(256)))
    (grid / "table.md").write_text("a table git keeps\n")
    return grid


def test_the_archive_depends_on_the_files_alone(tmp_path):
    grid = make_grid_folder(tmp_path)
    first = write_archive(grid, tmp_path / "one.tar.gz")
    for path in grid.rglob("*"):  # other times and modes: the same archive, byte for byte
        if path.is_file():
            os.utime(path, (1, 1))
            path.chmod(0o600)
    assert write_archive(grid, tmp_path / "two.tar.gz") == first
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "two.tar.gz").read_bytes()
    with tarfile.open(tmp_path / "one.tar.gz") as tar:
        names = sorted(tar.getnames())
        tar.extractall(tmp_path / "out", filter="data")
    # the tables git keeps and the checkpoints are not in it; the rest is
    assert "table.md" not in names and not any(n.endswith("checkpoint.pt") for n in names)
    assert "plots/acc.png" in names and len(names) == first["files"] == 7
    assert folder_record(tmp_path / "out") == first
    # the sha256 is the uncompressed tar's, whatever compressed it
    with gzip.open(tmp_path / "one.tar.gz") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == first["sha256"]


def repo_with_runs(tmp_path):
    """A repository whose first commit holds results/g with two runs; (repo, grid folder)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    grid = make_grid_folder(repo / "results")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "runs")
    return repo, grid


def committed_repo(tmp_path):
    """A repository whose results/g holds two runs (commit 1), then only their tables
    (commit 2, the run folders removed); return it and the tables' folder."""
    repo, grid = repo_with_runs(tmp_path)
    g = tmp_path / "g.toml"
    g.write_text(GRID)
    records = publish(grid, grid, Grid.load(g))
    assert len(records) == 2
    entry = json.loads((grid / MANIFEST).read_text())
    assert entry["commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert entry["path"] == "results/g" and entry["runs"] == 2
    git(repo, "rm", "-rq", "results/g/fedavg", "results/g/fedefc", "results/g/plots")
    git(repo, "add", "results/g")
    git(repo, "commit", "-qm", "tables only")
    return repo, grid, entry


def test_a_grid_comes_back_from_git_history_byte_for_byte(tmp_path):
    repo, _, entry = committed_repo(tmp_path)
    got = fetch(entry, tmp_path / "fetched" / "g", repo=repo)
    assert got == {k: entry[k] for k in ("sha256", "files", "bytes")}
    fetched = tmp_path / "fetched" / "g"
    shown = git(repo, "show", f"{entry['commit']}:results/g/fedefc/iid/seed0/metrics.jsonl")
    assert (fetched / "fedefc/iid/seed0/metrics.jsonl").read_text() == shown
    assert (fetched / "table.md").exists()  # the folder as the commit holds it
    with pytest.raises(UsageError, match="is not empty"):
        fetch(entry, fetched, repo=repo)


def test_a_copy_that_is_not_the_manifests_is_refused_and_nothing_lands(tmp_path):
    repo, _, entry = committed_repo(tmp_path)
    wrong = {**entry, "sha256": "0" * 64}
    with pytest.raises(UsageError, match="is not what the manifest records"):
        fetch(wrong, tmp_path / "fetched" / "g", repo=repo)
    assert not (tmp_path / "fetched" / "g").exists()
    assert list((tmp_path / "fetched").iterdir()) == []  # no partial copy left behind


def test_runs_changed_since_their_commit_are_archived_instead(tmp_path):
    """Git's commit holds what was committed: a run changed on disk since (or one never
    committed) makes the manifest name an archive of the folder as it is."""
    repo, grid = repo_with_runs(tmp_path)
    (grid / "fedavg/iid/seed0/metrics.jsonl").write_text("{\"round\": 1, \"test_acc\": 0.9}\n")
    publish(grid, grid, None)
    entry = json.loads((grid / MANIFEST).read_text())
    assert entry["archive"] == "g.tar.gz" and "commit" not in entry
    assert fetch(entry, tmp_path / "back" / "g", archive=repo / "results" / "g.tar.gz")[
        "sha256"] == entry["sha256"]
    assert (tmp_path / "back/g/fedavg/iid/seed0/metrics.jsonl").read_text().startswith(
        '{"round": 1, "test_acc": 0.9}')


def test_a_commit_no_remote_holds_is_refused_by_name(tmp_path):
    repo, _, entry = committed_repo(tmp_path)
    with pytest.raises(UsageError, match="git fetch .* failed"):
        fetch({**entry, "commit": "0" * 40}, tmp_path / "fetched" / "g", repo=repo)
    assert list((tmp_path / "fetched").iterdir()) == []


def test_a_shallow_clone_fetches_the_commit_first(tmp_path):
    repo, _, entry = committed_repo(tmp_path)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)],
                   check=True, env=GIT_ENV)
    assert subprocess.run(["git", "-C", str(clone), "cat-file", "-e", entry["commit"]],
                          capture_output=True).returncode != 0
    assert fetch(entry, tmp_path / "fetched" / "g", repo=clone)["sha256"] == entry["sha256"]


def test_a_grid_comes_back_from_its_archive(tmp_path):
    grid = make_grid_folder(tmp_path / "runs")
    g = tmp_path / "g.toml"
    g.write_text(GRID)
    publish(grid, tmp_path / "tables" / "g", Grid.load(g))  # not in git: an archive
    [entry] = manifests("g", tmp_path / "tables")
    assert entry["archive"] == "g.tar.gz" and "commit" not in entry
    got = fetch(entry, tmp_path / "back" / "g", archive=tmp_path / "runs" / "g.tar.gz")
    assert got["sha256"] == entry["sha256"]
    assert (tmp_path / "back/g/plots/acc.png").read_bytes() == bytes(range(256))
    with pytest.raises(UsageError, match="is not there; give its path with --archive"):
        fetch(entry, tmp_path / "elsewhere" / "g")


def test_a_run_is_refused_where_the_table_holds_runs_this_folder_lacks(tmp_path, capsys):
    """A grid whose summary table lists runs the results folder does not hold would run
    them again and overwrite the table: refused, naming the fetch command."""
    path = tmp_path / "g.toml"
    path.write_text(GRID.replace('"IID" = { iid = true }',
                                 '"IID" = { iid = true, dataset = "mnist-embedded" }'))
    write_run(tmp_path / "elsewhere", [0.5, 0.6])
    record = run_record(tmp_path / "elsewhere", "g", "fedavg/iid/seed0", "FedAvg", "IID")
    write_runs([record], tmp_path / "results" / "g" / RUNS_FILE)
    code = main(["grid", "run", str(path), "--results-dir", str(tmp_path / "results"),
                 "--max-cells", "0"])
    assert code == 2
    assert "fetch them first (fedefc results fetch g" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "results" / "g").iterdir()) == [RUNS_FILE]


def record(row, seed, final, last10, best=None, t_e=None, guard=(None, None)):
    return RunRecord("g", f"{row.lower()}/iid/seed{seed}", row, "IID", seed, "", "", "",
                     0.2, "", 25, 25, "completed", "server test set", final,
                     final if best is None else best, 1, last10, last10, t_e, *guard, None, 1.0,
                     "")


def hand_grid(tmp_path, *records):
    """The grid GRID and its finished runs ``records`` (:func:`record`)."""
    path = tmp_path / "g.toml"
    path.write_text(GRID)
    grid = Grid.load(path)
    return grid, finished_runs(grid, list(records))


def test_the_docs_blocks_by_hand(tmp_path):
    grid, runs = hand_grid(
        tmp_path, record("FedAvg", 0, 0.80, 0.79, best=0.84), record("FedAvg", 1, 0.70, 0.71),
        record("FedEFC", 1, 0.735, 0.72, t_e=12, guard=(15, 18)),
        record("FedEFC", 0, 0.83, 0.80, t_e=10))
    text = compare(grid, runs, "FedEFC")
    # means over seeds 0-1: FedAvg (80 + 70) / 2 = 75.0, (79 + 71) / 2 = 75.0, best (84 +
    # 70) / 2 = 77.0; FedEFC 78.25 -> 78.2 (78.25 is stored below it), 76.0, 78.25;
    # per seed, seed 0 first: +3.0, +1.0; +3.5, +1.0
    assert ("| IID | 75.0 / 75.0 / 77.0 | 78.2 / 76.0 / 78.2 | +3.0, +1.0; +3.5, +1.0 | "
            "10, 12 | –, 15/18 |") in text
    assert text.endswith("2 runs: FedEFC − FedAvg, final: mean +3.2, least +3.0, 0 runs "
                         "more than a point below; last 10: mean +1.0, least +1.0, 0 below")
    table = seeds(grid, runs, "IID", ["FedAvg", "FedEFC"])
    # sample sd of two values: their distance / sqrt(2): 10 / 1.414 = 7.1, 9.5 / 1.414 = 6.7
    assert "| FedAvg | 75.0 ± 7.1 | 75.0 | 77.0 | | | | |" in table
    assert ("| FedEFC | 78.2 ± 6.7 | 76.0 | 78.2 | +3.0, +3.5 | +1.0, +1.0 | 10, 12 | "
            "–, 15/18 |") in table


def test_the_grids_and_cells_blocks_by_hand(tmp_path):
    grid, runs = hand_grid(
        tmp_path, record("FedAvg", 0, 0.80, 0.79, best=0.84), record("FedAvg", 1, 0.70, 0.71),
        record("FedEFC", 0, 0.83, 0.80), record("FedEFC", 1, 0.68, 0.72))
    # per seed: final +3.0, -2.0 (mean +0.5, one run > 1 below); last 10 +1.0, +1.0;
    # FedAvg's seed 0 ended 4 below its best (memorized): 1 run, +3.0
    table = grids([("a", grid, runs), ("b", grid, runs)], ["FedEFC"])
    assert "| a | FedEFC (2) | +0.5, -2.0, 1 | +1.0, +1.0, 0 | 1, +3.0 |" in table
    assert "| b | FedEFC (2) | +0.5, -2.0, 1 | +1.0, +1.0, 0 | 1, +3.0 |" in table
    pooled = grids([("a", grid, runs), ("b", grid, runs)], ["FedEFC"], pooled=True)
    assert pooled.endswith("| FedEFC (4) | +0.5, -2.0, 2 | +1.0, +1.0, 0 | 2, +3.0 |")
    assert cells(grid, runs, ["FedEFC"]).endswith("| IID (0) | +3.0 |\n| IID (1) | −2.0 |")
    # two runs beyond chance at 1/2 each: at least one 3/4, both 1/4
    assert _at_least([0.5, 0.5], 1) == pytest.approx(0.75)
    assert _at_least([0.5, 0.5], 2) == pytest.approx(0.25)


@pytest.mark.parametrize("spec, error", [
    ("nosuch cross-silo", r"no kind 'nosuch'; kinds: table, compare, seeds, paired, grids, cells"),
    ("compare cross-silo", r'a compare block needs row="..."'),
    ("table no-such-grid", r"no summary table results/no-such-grid/runs.csv"),
    ('compare cross-silo row="FedProx"', r"no run of 'FedProx' has a run of 'FedAvg'"),
])
def test_a_block_that_cannot_be_written_says_why(tmp_path, spec, error):
    doc = tmp_path / "doc.md"
    doc.write_text(f"prose\n<!-- results {spec} -->\nold\n<!-- /results -->\nmore prose\n")
    with pytest.raises(DocsError, match=error):
        render_docs(doc)
    assert "old" in doc.read_text()  # nothing written


def test_results_md_tables_are_what_the_summary_tables_give():
    """Every generated block of docs/RESULTS.md is what ``fedefc results docs`` writes
    from the committed summary tables (run it after a grid changes)."""
    assert all(not render_docs(doc, write=False) for doc in DOCS)


def test_every_manifest_names_a_commit_that_holds_its_runs(tmp_path):
    """Where this clone has the history, each grid's commit holds its folder with the
    files the manifest counts; the smallest grid is fetched and checked byte for byte."""
    entries = [json.loads(p.read_text()) for p in TREE_RESULTS.rglob(MANIFEST)]
    held = [e for e in entries if "commit" in e]
    assert len(held) >= 20
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", held[0]["commit"]],
                      capture_output=True).returncode:
        pytest.skip("this clone lacks the commits the manifests name (a shallow clone)")
    for entry in held:
        files = git(ROOT, "ls-tree", "-r", "--name-only", entry["commit"], entry["path"] + "/")
        assert len(files.splitlines()) == entry["files"], entry["grid"]
    smallest = min(held, key=lambda e: e["bytes"])
    got = fetch(smallest, tmp_path / smallest["grid"], repo=ROOT)
    assert got["sha256"] == smallest["sha256"]
    runs = {r.run for r in read_runs(TREE_RESULTS / smallest["grid"] / RUNS_FILE)}
    assert runs == {p.parent.relative_to(tmp_path / smallest["grid"]).as_posix()
                    for p in (tmp_path / smallest["grid"]).rglob("summary.json")}
