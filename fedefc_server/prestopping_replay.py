"""The prestopping rule replayed on a recorded run: the T_e another
``prestopping-min-gain`` would have given (docs/FEDEFC.md §3.3).

Phase 1 of a run does not depend on the minimum gain except through the round the rule
fires in, and a run is a pure function of its config and seed; so a recorded run whose
T_e a setting leaves unchanged is exactly the run that setting makes. The grid runner
uses this to keep the cells a changed setting does not change (``fedefc_cli/grid.py:
check_finished``); ``tests/benchmarks/study_prestopping_gain.py`` to study settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.sample_roles import validation_count

from .prestopping import Prestopper, accuracy_standard_error, min_gain_z


def phase_1_rounds(run: Path) -> list[tuple[int, float, list[int]]]:
    """(round, A(t), the replying clients' validation-share sizes) of each recorded
    phase-1 round of the run in folder ``run`` (T_e included), the sizes from the
    replies' sample counts as the server takes them
    (``PrestoppingServer.min_gain``)."""
    cfg = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    fraction = cfg.get("validation-fraction", 0.4)
    cap = cfg.get("validation-max-per-class", 0) * summary.get("num_classes", 10)
    rounds = []
    for line in (run / "metrics.jsonl").read_text().splitlines()[1:]:
        rec = json.loads(line)
        if rec.get("A") is None or rec.get("phase") != 1:
            continue
        shares = [validation_count(fraction, cap, m) for m in rec["num_examples"] if m > 1]
        rounds.append((rec["round"], rec["A"], shares))
    return rounds


def replayed_t_e(run: Path, setting: float | str) -> int | None:
    """The T_e the server's rule (:class:`Prestopper`) gives on the recorded phase-1
    A(t) of ``run`` with ``prestopping-min-gain = setting``."""
    cfg = json.loads((run / "config.json").read_text())
    stopper = Prestopper(cfg["start-round"], cfg["gamma-thr"],
                         enabled=cfg.get("prestopping", True))
    for t, a_t, shares in phase_1_rounds(run):
        gain = min_gain_z(setting, shares) * accuracy_standard_error(a_t, shares)
        if stopper.observe(t, a_t, gain):
            break
    return stopper.t_e


def same_run_with_gain(run: Path, setting: float | str) -> bool:
    """Whether ``prestopping-min-gain = setting`` would have made exactly the recorded
    run: the rule replayed with it fires in the recorded T_e (or never, as recorded)."""
    summary = json.loads((run / "summary.json").read_text())
    return replayed_t_e(run, setting) == summary.get("t_e")
