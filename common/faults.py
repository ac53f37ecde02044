"""Fault injection for reliability tests: make chosen clients fail or lie on purpose.

The run-config key ``faults`` holds ``;``-separated entries ``KIND@PIDS`` or
``KIND@PIDS@ROUNDS``; PIDS and ROUNDS are comma lists of numbers or ranges ("0-4,7").
Empty (the default) injects nothing. Kinds:

| kind | the client ... |
| --- | --- |
| ``raise`` | raises an exception instead of replying |
| ``sleep=S`` | sleeps S seconds before training (a straggler; pair with ``client-timeout``) |
| ``exit`` | kills its own process (a crash / disconnect) |
| ``nan`` | replies with NaN in its first weight array |
| ``shape`` | replies with a wrongly shaped first array |
| ``drop-array`` | replies with one array missing |
| ``dtype`` | replies with float16 arrays |
| ``samples=N`` | reports N samples (e.g. 0, -5 or 10**12) |
| ``acc=A`` | reports accuracy A in phase 1 (1.0 or 0.0: a lying client; 1.5: out of range) |
| ``no-acc`` | omits its phase-1 accuracy |
| ``pid=P`` | reports partition id P (a string, or another client's id) |
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .messages import FitReply

KINDS = ("raise", "sleep", "exit", "nan", "shape", "drop-array", "dtype", "samples", "acc",
         "no-acc", "pid")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def _numbers(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class Fault:
    kind: str
    arg: str
    pids: frozenset[int]
    rounds: frozenset[int] | None

    def applies(self, pid: int, server_round: int) -> bool:
        return pid in self.pids and (self.rounds is None or server_round in self.rounds)


def parse_faults(text: str) -> list[Fault]:
    """Parse the ``faults`` key; ValueError names the bad entry and the format."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split("@")
        kind, _, arg = parts[0].partition("=")
        try:
            if kind not in KINDS or len(parts) not in (2, 3):
                raise ValueError
            if kind in ("sleep", "acc"):
                float(arg)
            if kind == "samples":
                int(arg)
            faults.append(Fault(kind, arg, _numbers(parts[1]),
                                _numbers(parts[2]) if len(parts) == 3 else None))
        except ValueError:
            raise ValueError(
                f"faults entry {entry!r} is not KIND@PIDS[@ROUNDS] with KIND one of "
                f"{', '.join(KINDS)} (sleep=S, samples=N, acc=A, pid=P take a value); "
                "e.g. faults=\"raise@3;acc=1.0@0-9\"") from None
    return faults


def before_training(faults: list[Fault], pid: int, server_round: int) -> None:
    """Faults that strike before the client does any work."""
    for f in faults:
        if not f.applies(pid, server_round):
            continue
        if f.kind == "raise":
            raise InjectedFault(f"injected failure of client {pid} in round {server_round}")
        if f.kind == "sleep":
            time.sleep(float(f.arg))
        if f.kind == "exit":
            os._exit(17)


def corrupt_reply(faults: list[Fault], pid: int, server_round: int, weights: list[np.ndarray],
                  num_examples: int, metrics: dict) -> tuple[list[np.ndarray], int, dict]:
    """Faults that alter what the client sends back."""
    for f in faults:
        if not f.applies(pid, server_round):
            continue
        if f.kind == "nan":
            weights = [np.full_like(weights[0], np.nan), *weights[1:]]
        elif f.kind == "shape":
            weights = [np.zeros(weights[0].size + 1, dtype=weights[0].dtype), *weights[1:]]
        elif f.kind == "drop-array":
            weights = weights[:-1]
        elif f.kind == "dtype":
            weights = [w.astype(np.float16) for w in weights]
        elif f.kind == "samples":
            num_examples = int(f.arg)
        elif f.kind == "acc" and FitReply.ACCURACY in metrics:
            metrics[FitReply.ACCURACY] = float(f.arg)
        elif f.kind == "no-acc":
            metrics.pop(FitReply.ACCURACY, None)
        elif f.kind == "pid":
            metrics[FitReply.PARTITION_ID] = (int(f.arg) if f.arg.lstrip("-").isdigit()
                                              else f.arg)
    return weights, num_examples, metrics
