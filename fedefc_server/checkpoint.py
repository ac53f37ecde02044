"""Per-round checkpoints of the server side, and resuming a run from one.

After every round the round loop writes ``<out-dir>/checkpoint.pt`` atomically (temp
file + rename): the round, the global model, the strategy's state (FedEFC: A_max,
patience, T_e and the accuracy history; a baseline: its own server state), the models
the method keeps besides the global one (FedEFC's phase-2 guard: its best model), the
run config and the wall time so far.
There is no server-side RNG state to keep: client sampling and every client seed are
pure functions of (seed, round). A new run with ``resume-from=<that folder>`` continues
with round+1 and appends to the same folder.

The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings,
lists and dicts only, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.methods import changed_keys
from common.results import atomic_write_bytes

FILE = "checkpoint.pt"
FORMAT = 2
# Keys that may differ between the interrupted run and its resumption: where results
# go, how long to run, how (not what) to compute, whether clients audit their replies,
# where the operator keeps the allowlist (the operator may hand a partition over, or
# resume a run started before a deployment needed an allowlist or open-deployment), and
# how many missed rounds the operator tolerates.
MAY_DIFFER = frozenset({"out-dir", "resume-from", "rounds", "device", "client-threads",
                        "step-capture", "eval-batch-size", "client-timeout", "wait-for-nodes",
                        "audit", "allowlist", "open-deployment", "max-missed-share"})


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or belongs to another run; names path and fix."""


@dataclass(frozen=True)
class Checkpoint:
    round: int
    weights: list[np.ndarray]
    strategy: dict[str, Any]
    config: dict[str, Any]
    elapsed_s: float = 0.0
    models: dict[str, list[np.ndarray]] = field(default_factory=dict)


def save(out_dir: Path, ckpt: Checkpoint) -> None:
    payload = {"format": FORMAT, "round": ckpt.round,
               "weights": [torch.from_numpy(np.ascontiguousarray(w)) for w in ckpt.weights],
               "strategy": json.dumps(ckpt.strategy), "config": json.dumps(ckpt.config),
               "elapsed_s": float(ckpt.elapsed_s),
               "models": {name: [torch.from_numpy(np.ascontiguousarray(w)) for w in arrays]
                          for name, arrays in ckpt.models.items()}}
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(Path(out_dir) / FILE, buf.getvalue())


def load(folder: str | Path) -> Checkpoint:
    path = Path(folder) / FILE
    if not path.exists():
        raise CheckpointError(f"resume-from={str(folder)!r}: no {FILE} there; point resume-from "
                              "at the out-dir of a run that completed at least one round")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT:
            raise ValueError(f"format {payload.get('format')!r}, expected {FORMAT}")
        return Checkpoint(round=int(payload["round"]),
                          weights=[t.numpy() for t in payload["weights"]],
                          strategy=json.loads(payload["strategy"]),
                          config=json.loads(payload["config"]),
                          elapsed_s=float(payload["elapsed_s"]),
                          models={name: [t.numpy() for t in arrays]  # none before the key
                                  for name, arrays in payload.get("models", {}).items()})
    except Exception as err:  # any unpickling/decoding failure means the file is unusable
        raise CheckpointError(f"{path} is corrupt or not a FedEFC checkpoint ({err}); "
                              "resume from another run or start a new one") from None


def check_compatible(ckpt: Checkpoint, config: dict[str, Any], folder: str | Path,
                     expected_shapes: list[tuple[int, ...]]) -> None:
    """Refuse a checkpoint of another config or another model."""
    diff = changed_keys(ckpt.config, config, MAY_DIFFER)
    if diff:
        keys = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(diff.items()))
        raise CheckpointError(f"resume-from={str(folder)!r} was run with another config ({keys}); "
                              "resume with the same values or start a new run")
    shapes = [tuple(w.shape) for w in ckpt.weights]
    if shapes != [tuple(s) for s in expected_shapes]:
        raise CheckpointError(f"resume-from={str(folder)!r} holds another model "
                              f"({len(shapes)} arrays, expected {len(expected_shapes)} of the "
                              f"configured model); resume with the same model")
    if ckpt.round >= int(config["rounds"]):
        raise CheckpointError(f"resume-from={str(folder)!r} already finished round {ckpt.round} "
                              f"of rounds={config['rounds']}; raise rounds to continue it")
