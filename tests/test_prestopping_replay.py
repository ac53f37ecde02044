"""The prestopping rule replayed on a recorded run (docs/FEDEFC.md §3.3), and the grid
runner that keeps a finished cell a changed ``prestopping-min-gain`` leaves unchanged."""

import json

import pytest

from common.config import ConfigError
from common.methods import load_run_config
from fedefc_cli.grid import Cell, check_finished
from fedefc_server.prestopping import Prestopper, accuracy_standard_error
from fedefc_server.prestopping_replay import phase_1_rounds, replayed_t_e, same_run_with_gain

# A(t) that jumps, then creeps up by a tenth of a point a round (full MNIST, non-IID sites
# at (0.4, 0.8): docs/RESULTS.md), and A(t) that rises by whole points and then falls
CREEP = [0.3, 0.5, 0.6] + [0.6 + 0.001 * t for t in range(1, 12)]
CLEAR = [0.3, 0.5, 0.6, 0.65, 0.7, 0.69, 0.68, 0.67, 0.66, 0.65]


def record(folder, accs, site_samples, min_gain, t_e, start=0, gamma=3):
    """A finished run as the server writes it: resolved config, one metrics line per
    round (phase 1 up to and including T_e) and a summary."""
    folder.mkdir(parents=True)
    cfg = load_run_config({"num-clients": len(site_samples), "fraction": 1.0,
                           "start-round": start, "gamma-thr": gamma, "rounds": len(accs),
                           "prestopping-min-gain": min_gain, "out-dir": str(folder)})
    (folder / "config.json").write_text(json.dumps(cfg.to_flat()))
    lines = [{"round": 0, "test_acc": 0.1}]
    for t, a in enumerate(accs, start=1):
        phase = 1 if t_e is None or t <= t_e else 2
        lines.append({"round": t, "phase": phase, "A": a, "num_examples": list(site_samples)})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (folder / "summary.json").write_text(json.dumps({"t_e": t_e, "num_classes": 10}))
    return cfg.to_flat()


def by_hand(accs, shares, z, start=0, gamma=3):
    """The server's rule fed round by round with z standard errors of the shares."""
    stopper = Prestopper(start, gamma)
    for t, a in enumerate(accs, start=1):
        if stopper.observe(t, a, z * accuracy_standard_error(a, shares)):
            return t
    return None


LARGE, SMALL = (12000,) * 5, (800,) * 5  # shares of 4,800 and of 320 samples


@pytest.mark.parametrize("accs,sites", [(CREEP, LARGE), (CREEP, SMALL), (CLEAR, LARGE)])
def test_the_replay_is_the_servers_rule_on_the_recorded_shares(tmp_path, accs, sites):
    strict = by_hand(accs, [4800 if sites == LARGE else 320] * 5, 0.0)
    run = tmp_path / "run"
    record(run, accs, sites, 0.0, strict)
    assert [a for _, a, _ in phase_1_rounds(run)] == accs[:strict or len(accs)]
    assert all(shares == [4800 if sites == LARGE else 320] * 5
               for _, _, shares in phase_1_rounds(run))
    assert replayed_t_e(run, 0.0) == strict
    shares = [4800 if sites == LARGE else 320] * 5
    assert replayed_t_e(run, 1.0) == by_hand(accs, shares, 1.0)
    # auto asks for one standard error on the large shares and none on the small ones
    assert replayed_t_e(run, "auto") == by_hand(accs, shares, 1.0 if sites == LARGE else 0.0)


def test_a_finished_cell_stays_where_the_new_gain_fires_where_it_did(tmp_path):
    """A cell recorded with the paper's rule (gain 0) and wanted with ``auto``: kept where
    the replay fires in the recorded T_e (small shares: auto asks for no gain; large
    shares with clear rises: the same T_e), refused, naming the key, where it does not
    (large shares, A(t) creeping: the strict rule never fired, auto does)."""
    cases = {"small": (CREEP, SMALL), "clear": (CLEAR, LARGE), "creep": (CREEP, LARGE)}
    for name, (accs, sites) in cases.items():
        run = tmp_path / name
        shares = [4800 if sites == LARGE else 320] * 5
        record(run, accs, sites, 0.0, by_hand(accs, shares, 0.0))
        wanted = {**json.loads((run / "config.json").read_text()), "prestopping-min-gain": "auto"}
        cell = Cell("FedEFC", name, 0, wanted)
        if name == "creep":
            # by hand: SE = sqrt(0.6 * 0.4 * 5 / 4800) / 5 = 0.0032 from A_max = 0.6 (round
            # 3); 0.601, 0.602 and 0.603 stay below 0.6032: T_e = 6
            assert by_hand(accs, shares, 0.0) is None and replayed_t_e(run, "auto") == 6
            assert not same_run_with_gain(run, "auto")
            with pytest.raises(ConfigError, match="prestopping-min-gain.*0.0, 'auto'"):
                check_finished(cell)
        else:
            assert same_run_with_gain(run, "auto")
            check_finished(cell)
