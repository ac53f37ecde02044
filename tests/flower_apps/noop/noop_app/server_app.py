"""The ServerApp: ``rounds`` rounds of one ``train`` message of ``floats`` float32 values
to each of ``nodes`` SuperNodes, replies ignored but counted (pyproject.toml)."""

from __future__ import annotations

import json
import os
import time
from logging import ERROR, INFO
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def _mark(context: Context, name: str) -> None:
    folder = str(context.run_config["marker-dir"])
    if folder:
        Path(folder, f"{name}-{os.getpid()}").write_text(str(context.run_id))


def _exchange(grid: Grid, nodes: list[int], kind: str, content: RecordDict) -> dict:
    start = time.monotonic()
    replies = list(grid.send_and_receive(
        [Message(content, dst_node_id=n, message_type=kind) for n in nodes]))
    errors = [r.error.reason for r in replies if r.has_error()]
    return {"kind": kind, "sent": len(nodes), "replies": len(replies), "errors": errors,
            "round_s": time.monotonic() - start}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    _mark(context, "serverapp")
    mode = str(cfg["mode"])
    if mode in ("fail", "hollow"):
        log(INFO, "round 1: 0 of 3 nodes trained")
        log(ERROR, "RUN FAILED: no node trained in round 1 (%s)", mode)
        if mode == "fail":
            raise RuntimeError("no node trained in round 1")
        return
    if mode == "hold":
        release = Path(str(cfg["marker-dir"]), "release")
        deadline = time.monotonic() + float(cfg["hold-s"])
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    while len(nodes := sorted(grid.get_node_ids())) < int(cfg["nodes"]):
        time.sleep(1.0)
    nodes = nodes[: int(cfg["nodes"])]
    out = Path(str(cfg["out-dir"])) if cfg["out-dir"] else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    records = []
    if cfg["query"]:
        records.append({"round": 0, **_exchange(grid, nodes, "query", RecordDict())})
    weights = ArrayRecord([np.zeros(int(cfg["floats"]), dtype=np.float32)])
    for rnd in range(1, int(cfg["rounds"]) + 1):
        content = RecordDict({"arrays": weights, "config": ConfigRecord({"round": rnd})})
        records.append({"round": rnd, **_exchange(grid, nodes, "train", content)})
        log(INFO, "noop round %s: %s replies to %s messages in %.1f s", rnd,
            records[-1]["replies"], records[-1]["sent"], records[-1]["round_s"])
        for reason in records[-1]["errors"]:
            log(INFO, "reply error: %s", reason)
    if out:
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "summary.json").write_text(json.dumps({"status": "completed",
                                                      "rounds": int(cfg["rounds"])}))
