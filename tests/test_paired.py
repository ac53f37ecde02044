"""``paired.md``: every row of a grid against its baseline row, seed by seed, on
finished cells whose summaries are written by hand, read through the grid's summary
table as the report reads them (the differences are computed here from those numbers,
not by the module)."""

import json

import pytest

from common.config import ConfigError
from common.results import mean_last10_held
from fedefc_cli.grid import Grid
from fedefc_cli.paired import paired_differences, write_paired
from fedefc_cli.report import finished_runs, write_report
from fedefc_cli.run_table import collect_runs

GRID = """
name = "pairs"
title = "pairs"
baseline = "FedAvg"
seeds = [0, 1]
[rows]
"FedAvg" = { method = "fedavg" }
"FedEFC" = { method = "fedefc" }
[columns]
"IID" = { iid = true }
"non-IID" = { alpha-dir = 10.0, p = 0.5 }
"""

# (row, column, seed) -> (final_acc, mean_last10_acc) of a finished run; FedAvg's seed 1
# of the non-IID column never finished, so FedEFC's run there has nothing to pair with
FINISHED = {
    ("FedAvg", "IID", 0): (0.800, 0.790), ("FedAvg", "IID", 1): (0.750, 0.760),
    ("FedAvg", "non-IID", 0): (0.700, 0.710),
    ("FedEFC", "IID", 0): (0.830, 0.800), ("FedEFC", "IID", 1): (0.735, 0.770),
    ("FedEFC", "non-IID", 0): (0.690, 0.650), ("FedEFC", "non-IID", 1): (0.900, 0.900),
}


def write_run(cell, final, last10, best=None, machine=None):
    """A finished cell whose last round is at ``final`` and whose last 10 planned rounds
    average ``last10``: the 9 before the last at (10 last10 - final) / 9; ``machine``:
    its summary's record of the machine (none: a summary that predates it)."""
    rounds = int(cell.config["rounds"])
    before = (10 * last10 - final) / 9
    metrics = [{"round": t, "test_acc": before} for t in range(1, rounds)]
    metrics.append({"round": rounds, "test_acc": final})
    cell.out_dir.mkdir(parents=True)
    (cell.out_dir / "config.json").write_text(json.dumps(cell.config))
    (cell.out_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (cell.out_dir / "summary.json").write_text(json.dumps(
        {"final_acc": final, "mean_last10_acc": last10,
         "best_acc": final if best is None else best, "accuracy_source": "server test set",
         **({"machine": machine} if machine else {})}))


def finished_cells(tmp_path, grid_text, runs):
    """The grid ``grid_text`` and its cells, those in ``runs`` ((row, column, seed) ->
    (final, last 10)) finished, the others not."""
    path = tmp_path / "pairs.toml"
    path.write_text(grid_text)
    grid = Grid.load(path)
    cells = grid.cells(tmp_path / "results", [])
    for cell in cells:
        accs = runs.get((cell.row, cell.column, cell.seed))
        if accs is not None:
            write_run(cell, *accs)
    return grid, cells


def finished(grid, tmp_path):
    """The grid's finished runs, read from their folders as its summary table holds them."""
    return finished_runs(grid, collect_runs(tmp_path / "results" / grid.name, grid.name, grid))


def paired_text(tmp_path, grid_text, runs):
    """``paired.md`` of :func:`finished_cells`."""
    grid, _ = finished_cells(tmp_path, grid_text, runs)
    return write_paired(grid, finished(grid, tmp_path), tmp_path).read_text()


@pytest.fixture
def grid_with_runs(tmp_path):
    return (*finished_cells(tmp_path, GRID, FINISHED), tmp_path)


def test_each_run_is_paired_with_the_baselines_run_of_its_column_and_seed(grid_with_runs):
    grid, _, tmp_path = grid_with_runs
    pairs = paired_differences(grid, finished(grid, tmp_path))
    assert list(pairs) == ["FedEFC"]  # the baseline is not paired with itself
    got = [(p.column, p.seed, round(p.final, 6), round(p.last10, 6)) for p in pairs["FedEFC"]]
    assert got == [("IID", 0, 3.0, 1.0), ("IID", 1, -1.5, 1.0), ("non-IID", 0, -1.0, -6.0)]


def test_the_paired_table_counts_the_runs_more_than_a_point_below(grid_with_runs):
    grid, _, tmp_path = grid_with_runs
    text = write_paired(grid, finished(grid, tmp_path), tmp_path).read_text()
    # final: mean (3 - 1.5 - 1) / 3 = +0.17, least -1.5, one run below -1 (-1.0 is not);
    # last 10: mean (1 + 1 - 6) / 3 = -1.33, least -6.0, one run below
    assert "| FedEFC | 3 | +0.2, -1.5, 1 | -1.3, -6.0, 1 |" in text
    assert "| FedEFC | non-IID | 0: -1.0, -6.0 |" in text
    assert "1:" not in text.split("| FedEFC | non-IID |")[1]  # unpaired seed 1 left out


def test_pairs_run_on_two_machines_are_named(tmp_path):
    """A pair whose summaries record different machines is counted above the tables; a
    pair on one machine, or one whose baseline predates the record, is not."""
    path = tmp_path / "pairs.toml"
    path.write_text(GRID)
    grid = Grid.load(path)
    cells = grid.cells(tmp_path / "results", [])
    here = {"cpu": "AMD EPYC", "cpu_kernels": "AVX512", "torch": "2.14.1", "gpu": "none"}
    there = {**here, "cpu_kernels": "AVX2"}
    machines = {("FedAvg", "IID", 0): here, ("FedEFC", "IID", 0): there,
                ("FedAvg", "IID", 1): here, ("FedEFC", "IID", 1): here,
                ("FedEFC", "non-IID", 0): there}  # its baseline run records none
    for cell in cells:
        accs = FINISHED.get((cell.row, cell.column, cell.seed))
        if accs is not None:
            write_run(cell, *accs, machine=machines.get((cell.row, cell.column, cell.seed)))
    pairs = paired_differences(grid, finished(grid, tmp_path))["FedEFC"]
    assert [p.other_machine for p in pairs] == [True, False, False]
    text = write_paired(grid, finished(grid, tmp_path), tmp_path).read_text()
    assert "**Machines differ** (FedEFC: 1 of 3)" in text
    for cell in cells:  # every run on one machine: no warning
        if (cell.out_dir / "summary.json").exists():
            summary = json.loads((cell.out_dir / "summary.json").read_text())
            summary["machine"] = here
            (cell.out_dir / "summary.json").write_text(json.dumps(summary))
    assert "Machines differ" not in write_paired(grid, finished(grid, tmp_path),
                                                 tmp_path).read_text()


def test_the_mean_over_the_runs_where_the_baseline_memorized_is_reported(grid_with_runs):
    grid, cells, tmp_path = grid_with_runs
    # FedAvg's best: IID 0 at 83.5 (3.5 above its final 80.0: fell), IID 1 at 77.5 (2.5
    # above 75.0: did not), non-IID 0 at 74.0 (4.0 above 70.0: fell); FedEFC's final
    # differences there: +3.0 and -1.0, mean +1.0 over 2 runs
    bests = {("IID", 0): 0.835, ("IID", 1): 0.775, ("non-IID", 0): 0.740}
    for cell in cells:
        if cell.row == "FedAvg" and cell.done:
            summary = json.loads((cell.out_dir / "summary.json").read_text())
            summary["best_acc"] = bests[(cell.column, cell.seed)]
            (cell.out_dir / "summary.json").write_text(json.dumps(summary))
    text = write_paired(grid, finished(grid, tmp_path), tmp_path).read_text()
    assert "| FedEFC | 3 | +0.2, -1.5, 1 | -1.3, -6.0, 1 | 2, +1.0 |" in text
    assert "where FedAvg fell ≥ 3 from its best" in text


def test_the_report_writes_it_only_for_a_grid_with_a_baseline(grid_with_runs):
    grid, _, tmp_path = grid_with_runs
    records = collect_runs(tmp_path / "results" / "pairs", "pairs", grid)
    assert tmp_path / "paired.md" in write_report(grid, records, tmp_path)
    grid.baseline = None
    assert write_paired(grid, finished(grid, tmp_path), tmp_path) is None


def test_a_baseline_that_is_not_a_row_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(GRID.replace('baseline = "FedAvg"', 'baseline = "FedProx"'))
    with pytest.raises(ConfigError, match=r"baseline = 'FedProx' is not one of its rows "
                                          r"\(FedAvg, FedEFC\)"):
        Grid.load(path)


CHANCE_GRID = GRID.replace('"FedEFC" = { method = "fedefc" }',
                           '"FedEFC" = { method = "fedefc" }\n'
                           '"FedAvg again" = { method = "fedavg", lr = 0.03000003 }'
                           ).replace('baseline = "FedAvg"',
                                     'baseline = "FedAvg"\nchance = "FedAvg again"')


def test_runs_beyond_the_chance_rows_envelope_are_counted(tmp_path):
    # FedAvg again - FedAvg: IID 0 (-1.0, -0.5), IID 1 (+2.0, -0.5), non-IID 0 (-1.0, -1.0),
    # so the envelope is -1.0 on both; FedEFC's IID 1 (-1.5 final) and non-IID 0 (-6.0
    # last 10) fall below it, its IID 0 (+3.0, +1.0) does not
    again = {("FedAvg again", "IID", 0): (0.790, 0.785),
             ("FedAvg again", "IID", 1): (0.770, 0.755),
             ("FedAvg again", "non-IID", 0): (0.690, 0.700)}
    text = paired_text(tmp_path, CHANCE_GRID, {**FINISHED, **again})
    assert "over its 3 runs its least differences were -1.0 (final) and -1.0 (last 10)" in text
    assert "| FedEFC | 3 | +0.2, -1.5, 1 | -1.3, -6.0, 1 | 0 | 2 |" in text
    assert "| FedAvg again | 3 | +0.0, -1.0, 0 | -0.7, -1.0, 0 | 0 | 0 |" in text


def test_chance_alone_is_measured_on_the_chance_row_held_out(tmp_path):
    # chance - FedAvg: IID 0 (-1, 0), IID 1 (-2, +0.5), non-IID 0 (+0.5, -1), non-IID 1
    # (+1, +0.2). Held out against the other three, IID 1 (-2 < -1 final) and non-IID 0
    # (-1 < 0 last 10) fall beyond: 2 of 4, a rate of 1/2. FedEFC: IID 0 (-2.5, +1) is
    # beyond the envelope (-2, -1), its other three runs are not: 1 of 4, where chance
    # alone expects 4 x 1/2 = 2.0 and puts at least 1 with probability 1 - (1/2)^4.
    runs = {("FedAvg", "IID", 0): (0.800, 0.800), ("FedAvg", "IID", 1): (0.750, 0.750),
            ("FedAvg", "non-IID", 0): (0.700, 0.700), ("FedAvg", "non-IID", 1): (0.600, 0.600),
            ("FedAvg again", "IID", 0): (0.790, 0.800),
            ("FedAvg again", "IID", 1): (0.730, 0.755),
            ("FedAvg again", "non-IID", 0): (0.705, 0.690),
            ("FedAvg again", "non-IID", 1): (0.610, 0.602),
            ("FedEFC", "IID", 0): (0.775, 0.810), ("FedEFC", "IID", 1): (0.780, 0.780),
            ("FedEFC", "non-IID", 0): (0.700, 0.695), ("FedEFC", "non-IID", 1): (0.620, 0.610)}
    text = paired_text(tmp_path, CHANCE_GRID, runs)
    assert "over its 4 runs its least differences were -2.0 (final) and -1.0 (last 10)" in text
    assert "each of those 4 runs held out against the envelope of the others, 2 fall" in text
    assert "beyond chance in about 50 % of its runs" in text
    tail = 1 - 0.5 ** 4
    assert f"| FedEFC | 4 | +0.6, -2.5, 1 | +1.1, -0.5, 0 | 0 | 1 | 2.0, {tail:.2f} |" in text
    # the chance row against its own envelope: none strictly below it, so P(at least 0) = 1
    assert "| FedAvg again | 4 | -0.4, -2.0, 1 | -0.1, -1.0, 0 | 0 | 0 | 2.0, 1.00 |" in text


OWN_GRID = GRID.replace('"FedEFC" = { method = "fedefc" }',
                       '"FedEFC" = { method = "fedefc" }\n'
                       '"FedAvg less" = { method = "fedavg", lr = 0.02 }'
                       ).replace('baseline = "FedAvg"',
                                 'baseline = "FedAvg"\npair-with = { "FedEFC" = "FedAvg less" }')


def test_a_row_is_paired_with_its_own_baseline_too(tmp_path):
    # FedAvg less: IID 0 (0.760, 0.770), IID 1 (0.700, 0.690), non-IID 0 (0.650, 0.640);
    # FedEFC - FedAvg less: IID 0 (+7.0, +3.0), IID 1 (+3.5, +8.0), non-IID 0 (+4.0, +1.0)
    # (FedEFC's non-IID 1 has no FedAvg-less run to pair with)
    less = {("FedAvg less", "IID", 0): (0.760, 0.770), ("FedAvg less", "IID", 1): (0.700, 0.690),
            ("FedAvg less", "non-IID", 0): (0.650, 0.640)}
    text = paired_text(tmp_path, OWN_GRID, {**FINISHED, **less})
    assert "| FedEFC | 3 | +0.2, -1.5, 1 | -1.3, -6.0, 1 | 0 |" in text  # against FedAvg
    assert "| FedEFC | FedAvg less | 3 | +4.8, +3.5, 0 | +4.0, +1.0, 0 | 0 |" in text
    assert "| FedEFC − FedAvg less | IID | 0: +7.0, +3.0; 1: +3.5, +8.0 |" in text
    assert "| FedEFC − FedAvg less | non-IID | 0: +4.0, +1.0 |" in text


@pytest.mark.parametrize("pair", ['{ "FedEFC" = "FedAvg twice" }', '{ "FedEFC" = "FedEFC" }',
                                  '{ "FedProx" = "FedAvg" }'])
def test_a_pair_that_does_not_name_two_rows_is_refused(tmp_path, pair):
    path = tmp_path / "bad.toml"
    path.write_text(OWN_GRID.replace('pair-with = { "FedEFC" = "FedAvg less" }',
                                     f"pair-with = {pair}"))
    with pytest.raises(ConfigError, match=r"pair-with .* must pair a row with another row"):
        Grid.load(path)


def test_one_chance_run_gives_no_rate(tmp_path):
    # a lone chance run has no others to be held out against: the envelope stands, the
    # rate column is left out
    once = {**FINISHED, ("FedAvg again", "IID", 0): (0.790, 0.785)}
    text = paired_text(tmp_path, CHANCE_GRID, once)
    assert "over its 1 runs its least differences" in text
    assert "Chance alone" not in text and "P(at least as many)" not in text
    assert "| FedEFC | 3 | +0.2, -1.5, 1 | -1.3, -6.0, 1 | 0 | 2 |\n" in text


@pytest.mark.parametrize("edit, named", [
    (lambda g: g.replace('chance = "FedAvg again"', 'chance = "FedAvg twice"'), "FedAvg twice"),
    (lambda g: g.replace('chance = "FedAvg again"', 'chance = "FedAvg"'), "FedAvg"),
    (lambda g: g.replace('baseline = "FedAvg"\n', ''), "FedAvg again"),
])
def test_a_chance_row_that_is_not_another_row_beside_a_baseline_is_refused(tmp_path, edit,
                                                                            named):
    path = tmp_path / "bad.toml"
    path.write_text(edit(CHANCE_GRID))
    with pytest.raises(ConfigError, match=rf"chance = '{named}' must name a row other than "
                                          r"the baseline"):
        Grid.load(path)


def test_a_run_the_guard_ended_is_read_on_the_baselines_rounds(tmp_path):
    # FedAvg trains all 40 planned rounds (last 10: rounds 31-40 at 0.80); FedEFC's guard
    # ended its run at round 35 with a delivered model at 0.83, its rounds 26-34 at 0.70.
    # Over the rounds it trained last (26-35) it averages 0.713; over the planned rounds
    # 31-40, holding its delivered model in 36-40: (4 x 0.70 + 6 x 0.83) / 10 = 0.778
    path = tmp_path / "pairs.toml"
    path.write_text(GRID)
    grid = Grid.load(path)
    cells = grid.cells(tmp_path / "results", [])
    fedavg, fedefc = (next(c for c in cells if (c.row, c.column, c.seed) == (row, "IID", 0))
                      for row in ("FedAvg", "FedEFC"))
    assert int(fedavg.config["rounds"]) == 40
    write_run(fedavg, 0.80, 0.80)
    fedefc.out_dir.mkdir(parents=True)
    (fedefc.out_dir / "config.json").write_text(json.dumps(fedefc.config))
    metrics = [{"round": t, "test_acc": 0.70} for t in range(1, 35)]
    metrics.append({"round": 35, "test_acc": 0.83})
    (fedefc.out_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in metrics))
    (fedefc.out_dir / "summary.json").write_text(json.dumps(
        {"final_acc": 0.83, "mean_last10_acc": 0.713, "best_acc": 0.83,
         "accuracy_source": "server test set", "guard_ended_at": 35}))
    [pair] = paired_differences(grid, finished(grid, tmp_path))["FedEFC"]
    assert pair.final == pytest.approx(3.0)
    assert pair.last10 == pytest.approx(77.8 - 80.0)


@pytest.mark.parametrize("recorded, planned, expected", [
    # every planned round trained: the plain mean of the last 10
    ({t: t / 100 for t in range(1, 26)}, 25, sum(range(16, 26)) / 1000),
    # ended at round 22 of 25: rounds 16-22, then round 22's model for 23-25
    ({t: t / 100 for t in range(1, 23)}, 25, (sum(range(16, 23)) + 3 * 22) / 1000),
    # fewer rounds than 10 planned, ended at 5 of 8: rounds 1-5, then round 5's for 6-8
    ({t: t / 100 for t in range(1, 6)}, 8, (1 + 2 + 3 + 4 + 5 + 3 * 5) / 800),
    # a round without an evaluation is left out, not counted as the delivered model
    ({**{t: t / 100 for t in range(1, 21) if t != 18}}, 20,
     (sum(range(11, 21)) - 18) / 900),
])
def test_mean_last10_held_by_hand(recorded, planned, expected):
    rounds = [{"round": 0, "test_acc": 0.1}] + [{"round": t, "test_acc": a}
                                                  for t, a in recorded.items()]
    assert mean_last10_held(rounds, "test_acc", planned) == pytest.approx(expected)
