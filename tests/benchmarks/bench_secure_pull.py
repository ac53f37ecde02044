"""Measure how far one client inside the secure update bound pulls a federation toward
a label-shifted model (docs/THREAT-MODEL.md, "Steering the secure sum"; issue 58).

Each row is a secure run of the cross-silo-mnist preset (full MNIST over 5 sites that
all train every round, LeNet) through ``fedefc run``'s path: an honest run, and runs
in which partition 0 trains with every label set to ``--label`` and sends that update
lengthened to the round's bound (``label-shift``), optionally also writing its ratio
slot to make the sum's mean ratio 1 and multiplying its update by K - 1
(``secure-ratio``); or in which it scales its update 1000-fold inside its mask in
every round (``x1000``: the culprit search names it). Printed per row: the final test
accuracy, the share of the test images the delivered model (``model.pt``) predicts as
the shifted label, and who the culprit search named when.

    python tests/benchmarks/bench_secure_pull.py --data-dir /abs/mnist-parent \\
        [--rounds 30] [--rows honest,shift,ratio] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from common.data_plan import data_plan
from common.methods import load_run_config
from common.runtime import initial_model
from common.training import BatchTransform, predict_logits
from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job

CPU = torch.device("cpu")


def predicted_share(out: Path, run_config: dict, label: int) -> float:
    """The share of the test images the run's delivered model predicts as ``label``."""
    cfg = load_run_config(run_config)
    data = data_plan(cfg).data
    model = initial_model(cfg, data.task)
    model.load_state_dict(torch.load(out / "model.pt"))
    with torch.no_grad():
        logits = predict_logits(model, data.test_x, BatchTransform.of(data.spec, CPU))
    return float((logits.argmax(1) == label).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--preset", default="cross-silo-mnist")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--label", type=int, default=3)
    ap.add_argument("--rows", default="honest,shift,ratio")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--work", default=None, help="keep the runs' folders here")
    args = ap.parse_args()
    faults = {"honest": "", "shift": f"label-shift={args.label}@0",
              "ratio": f"label-shift={args.label}@0;secure-ratio=4@0",
              "x1000": "secure-scale=1000@0"}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.work or scratch
        for name in args.rows.split(","):
            out = Path(tmp) / name
            cfg = resolve_run_config(args.preset, [
                *([f"data-dir={args.data_dir}"] if args.data_dir else []),
                f"rounds={args.rounds}",
                "secure-aggregation=true", f'faults="{faults[name]}"', *args.overrides],
                str(out))
            summary = run_simulation_job(cfg, log_path=Path(tmp) / "runs.log")
            share = predicted_share(out, cfg, args.label) if (out / "model.pt").exists() \
                else None
            recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            rows.append({"row": name, "status": summary["status"],
                         "final_acc": summary.get("final_acc"), "predicted_label": share,
                         "refused_rounds": [r["round"] for r in recs if r.get("skipped")],
                         "accuracy": [r.get("test_acc") for r in recs],
                         "update_ratio": [r.get("update_ratio") for r in recs[1:]],
                         "update_bound": recs[-1].get("update_bound"),
                         "named": [(r["round"], r["culprit_search"]["named"]) for r in recs
                                   if "named" in r.get("culprit_search", {})]})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
