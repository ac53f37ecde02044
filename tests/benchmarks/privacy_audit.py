"""Measure what a client sends, per method and phase, plain and under secure aggregation
(the audit tables of docs/PRIVACY.md).

Every method runs a short audited simulation (``audit = true``) on the embedded MNIST
subset with LeNet-5 (mnist-lite's model, so the bytes per reply are mnist-lite's): 20
clients, 10 per round, one local epoch. FedEFC, forward correction and confident
learning are pushed into phase 2 after round 2 (every client reports accuracy 0 there);
FedCorr runs one stage-1 iteration, FedNoRo one warm-up round. The sum-only methods run
once more with ``secure-aggregation = true``. From the clients' audit logs (what left
each client, recorded by the ClientApp's audit mod) the script groups the replies by
their shape (message, SecAgg+ stage, records with their keys and value types) and
prints, per method and phase, every shape with the rounds it occurred in, the replies
per client and round, and the payload bytes per reply.

    python tests/benchmarks/privacy_audit.py --out /abs/dir [--methods fedefc,fedavg]

The rows are also written to <out>/privacy-audit.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from fedefc_cli.run_configs import resolve_run_config
from fedefc_cli.simulation import run_simulation_job

SUM_METHODS = ("fedefc", "fedavg", "fedprox", "fedditto", "forward-correction",
               "confident-learning")
METHODS = (*SUM_METHODS, "fedcorr", "fednoro", "rofl")
PHASED = ("fedefc", "forward-correction", "confident-learning")
EXTRA = {"fedcorr": {"rounds": 5, "fedcorr-iterations": 1},
         "fednoro": {"rounds": 3, "fednoro-warmup": 1},
         "rofl": {"rounds": 3, "rofl-t-pl": 1}}


def run(out: Path, method: str, secure: bool) -> Path:
    folder = out / f"{method}{'-secure' if secure else ''}"
    if (folder / "summary.json").exists():
        return folder
    keys = {"method": f'"{method}"', "rounds": 4, "local-epochs": 1, "start-round": 1,
            "gamma-thr": 1, "audit": "true", "secure-aggregation": str(secure).lower(),
            "client-threads": 1, **EXTRA.get(method, {})}
    if method in PHASED:
        keys["faults"] = '"acc=0.0@0-19@2"'
    run_simulation_job(resolve_run_config(None, [f"{k}={v}" for k, v in keys.items()],
                                          str(folder)), log_path=out / f"{folder.name}.log")
    return folder


def round_label(record: dict) -> str:
    if "phase" in record:
        return f"phase {record['phase']}"
    if "fedcorr_stage" in record:
        return f"stage {record['fedcorr_stage']}"
    return ""


def shapes(folder: Path) -> list[dict]:
    """The distinct reply shapes of a run, with where and how often they occurred."""
    labels = {str(r["round"]): round_label(r) for r in
              (json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines())}
    groups: dict[str, dict] = {}
    for path in sorted((folder / "audit").glob("partition-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "records" not in entry:
                continue
            content = {name: (f"{rec['arrays']} arrays" if rec["kind"] == "arrays" else
                              ", ".join(f"{k}: {t}" for k, t in sorted(rec["keys"].items())))
                       for name, rec in sorted(entry["records"].items())}
            key = json.dumps([entry["type"], entry.get("stage"), content])
            group = groups.setdefault(key, {
                "message": entry["type"], "stage": entry.get("stage"), "content": content,
                "when": set(), "rounds": set(), "replies": 0, "bytes": set()})
            group["when"].add("registration" if entry["type"] == "get_properties"
                              else labels[entry["round"]])
            group["rounds"].add(entry["round"])
            group["replies"] += 1
            group["bytes"].add(entry["bytes"])
    rows = []
    for g in groups.values():
        rows.append({**g, "when": sorted(g["when"]), "rounds": sorted(g["rounds"], key=int),
                     "bytes": [min(g["bytes"]), max(g["bytes"])]})
    return sorted(rows, key=lambda r: (int(r["rounds"][0]), r["message"], r["stage"] or ""))


def spans(rounds: list[str]) -> str:
    """"rounds 1-3, 5" for rounds 1, 2, 3, 5; "round 2" for round 2."""
    nums, out = sorted(int(r) for r in rounds), []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)
    return f"round {text}" if len(nums) == 1 else f"rounds {text}"


def table(method: str, secure: bool, rows: list[dict]) -> str:
    lines = [f"#### {method}, {'secure aggregation' if secure else 'plain'}", "",
             "| when | message | stage | records: keys | bytes per reply |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        content = "<br>".join(f"`{name}`: {what}" for name, what in r["content"].items())
        lo, hi = r["bytes"]
        size = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
        labels = ", ".join(w for w in r["when"] if w)
        when = labels if r["when"] == ["registration"] else \
            f"{labels} ({spans(r['rounds'])})" if labels else spans(r["rounds"])
        lines.append(f"| {when} | {r['message']} | {r['stage'] or ''} | "
                     f"{content} | {size} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="absolute folder for the runs")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, list[dict]] = defaultdict(list)
    for method in args.methods.split(","):
        for secure in (False, True) if method in SUM_METHODS else (False,):
            rows = shapes(run(out, method, secure))
            found[f"{method}{' secure' if secure else ''}"] = rows
            print(table(method, secure, rows), "\n", flush=True)
    (out / "privacy-audit.json").write_text(json.dumps(found, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
