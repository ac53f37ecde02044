"""A run's output folder: resolved config, per-round metrics, summary, final model.

Layout (all under an absolute ``out-dir``)::

    config.json     the resolved run config (every key, defaults filled in)
    metrics.jsonl   one JSON object per round (round 0 = the initial model)
    summary.json    final / best / mean-of-last-10 accuracy (server test set or federated
                    evaluation, ``accuracy_source``), T_e, wall time, the machine
                    (:func:`machine_record`)
    model.pt        the final global model's state dict (torch.save)

Files are written atomically (temp file + rename), so a crash never leaves a
half-written summary or model, and owner-only (0600; a folder the run creates 0700:
:mod:`common.private_files`): the model and the records are the federation's results.
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .private_files import FILE_MODE, make_private_dir, open_private

RESULT_FILES = ("metrics.jsonl", "summary.json", "model.pt")


class OutputDirError(ValueError):
    """The output folder cannot be used; the message names it and the fix."""


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return _clean(value.tolist())
    return value


def atomic_write_bytes(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename; the
    file's mode is ``mode`` (owner-only unless told)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n").encode())


def default_out_dir(method: str, dataset: str, seed: int) -> Path:
    """Where a run writes when ``out-dir`` is empty, for the ``fedefc`` command and the
    ServerApp alike: ``~/fedefc-runs/<method>-<dataset>-s<seed>-<time>`` (the ServerApp
    runs from Flower's app directory, so no relative default would mean anything)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path.home() / "fedefc-runs" / f"{method}-{dataset}-s{seed}-{stamp}"


def run_folder(out_dir: str, resume_from: str, method: str, dataset: str, seed: int) -> str:
    """The folder a run writes to: a resumed run continues in its own folder
    (``resume-from``), else ``out-dir``, else :func:`default_out_dir`."""
    return resume_from or out_dir or str(default_out_dir(method, dataset, seed))


def check_output_dir(out_dir: str | Path) -> Path:
    """Refuse a relative, unwritable or already-used folder before anything runs."""
    path = Path(out_dir)
    if not path.is_absolute():
        raise OutputDirError(f"out-dir={str(out_dir)!r} is not absolute; give an absolute path")
    used = [name for name in RESULT_FILES if (path / name).exists()]
    if used:
        raise OutputDirError(
            f"out-dir={str(path)!r} already holds results ({', '.join(used)}); "
            "choose a new folder so nothing is overwritten"
        )
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputDirError(f"out-dir={str(path)!r} is not writable: {probe} is a file")
    try:  # a real write: permissions, read-only file systems, full disks
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise OutputDirError(f"out-dir={str(path)!r} is not writable ({probe}: {err.strerror}); "
                             "choose a folder you can write to") from None
    return path


def accuracy_stats(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """final_acc, best_acc, best_round and mean_last10_acc of the rounds' ``key``
    (rounds > 0 that have it; the mean over the last 10, or over all of them when there
    are fewer: ``mean_last10_rounds`` says how many); {} when none has."""
    done = [r for r in rounds if r.get("round", 0) > 0 and r.get(key) is not None]
    if not done:
        return {}
    accs = [r[key] for r in done]
    best = int(np.argmax(accs))
    return {"final_acc": accs[-1], "best_acc": accs[best], "best_round": done[best]["round"],
            "mean_last10_acc": float(np.mean(accs[-10:])),
            "mean_last10_rounds": len(accs[-10:])}


def machine_record() -> dict[str, str]:
    """What fixes a run's floating-point arithmetic besides its config and seed, on the
    machine that writes its summary (in a simulation the clients' too; in a deployment
    the ServerApp's only): the CPU model and the vector instructions PyTorch's kernels
    chose on it, the PyTorch and NumPy builds, the GPU. Runs of
    one config on machines whose records differ sum floats in another order, part from
    round 1 and may end points apart, as far as seeds do (docs/RESULTS.md, "How far apart
    two runs of one method end"); ``fedefc grid report`` says where a pair of runs it
    compares differs here (:mod:`fedefc_cli.paired`)."""
    import torch  # lazy: the `fedefc` CLI imports this module, torch is 1.1 s of its start

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"cpu": cpu, "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "numpy": np.__version__, "gpu": gpu}


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    """A finished run's ``metrics.jsonl``, one dict per round; [] when it has none."""
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def accuracy_key(records: list[dict[str, Any]]) -> tuple[str, str]:
    """The record field a run's accuracy curve uses, and its label: the server's test
    set when the run has one, else the federated evaluation."""
    if any(r.get("test_acc") is not None for r in records):
        return "test_acc", "test accuracy"
    return "federated_acc", "federated accuracy (held-out)"


def mean_last10_held(rounds: list[dict[str, Any]], key: str, planned: int) -> float:
    """The mean accuracy over the last 10 of the ``planned`` rounds, a round the run did
    not train (the phase-2 guard ended it: docs/FEDEFC.md §3.4) counting the model it
    delivered, its last recorded round's. The window is then the same rounds as a run
    that trained them all, so two runs' last-10 means compare (docs/RESULTS.md, "How
    far apart two runs of one method end"); for a run that trained and evaluated every
    planned round it is ``mean_last10_acc``."""
    done = {r["round"]: r[key] for r in rounds if r.get("round", 0) > 0
            and r.get(key) is not None}
    if not done:
        raise ValueError(f"no round records {key!r}")
    last = max(done)
    held = [done[t] if t in done else done[last] if t > last else None
            for t in range(max(1, planned - 9), max(planned, last) + 1)][-10:]
    return float(np.mean([a for a in held if a is not None]))


class RunRecorder:
    """Writes one run's output folder."""

    def __init__(self, out_dir: str | Path, resolved_config: dict[str, Any],
                 resume_round: int | None = None):
        """A new, unused folder; or, with ``resume_round``, the folder of the run being
        resumed, whose records after that round (written before the crash) are dropped."""
        self.out_dir = Path(out_dir) if resume_round is not None else check_output_dir(out_dir)
        make_private_dir(self.out_dir)
        atomic_write_json(self.out_dir / "config.json", resolved_config)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.rounds: list[dict[str, Any]] = []
        if resume_round is not None:
            kept = [r for r in self._read_rounds() if r["round"] <= resume_round]
            atomic_write_bytes(self.metrics_path,
                               "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept).encode())
            self.rounds = kept
            for name in ("summary.json", "model.pt"):
                (self.out_dir / name).unlink(missing_ok=True)

    def _read_rounds(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        out = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by the crash
                break
        return out

    def write_round(self, record: dict[str, Any]) -> None:
        """Append one round's record (and keep it for the summary)."""
        clean = _clean(record)
        self.rounds.append(clean)
        with open_private(self.metrics_path, "a") as fh:
            fh.write(json.dumps(clean, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def write_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        """summary.json: ``extra``, then final / best / mean-of-last-10 accuracy from the
        server's test set when the rounds have it, else from the federated evaluation
        (``accuracy_source`` says which); with federated evaluation also its own
        ``federated_*`` figures (and the true-label diagnostic's final value)."""
        summary = dict(extra)
        federated = accuracy_stats(self.rounds, "federated_acc")
        primary = accuracy_stats(self.rounds, "test_acc")
        if primary:
            summary.update(primary, accuracy_source="server test set")
        elif federated:
            summary.update(federated, accuracy_source="federated held-out data")
        if federated:
            summary.update({f"federated_{k}": v for k, v in federated.items()})
            true = [r["federated_true_acc"] for r in self.rounds if r.get("round", 0) > 0
                    and r.get("federated_true_acc") is not None]
            if true:
                summary["federated_true_final_acc"] = true[-1]
        summary["out_dir"] = str(self.out_dir)
        atomic_write_json(self.out_dir / "summary.json", summary)
        return _clean(summary)

    def write_model(self, state_dict: dict[str, Any]) -> None:
        """model.pt: the final global model's state dict (``torch.load`` reads it)."""
        import torch  # lazy: torch, 1.9 s of CPU
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        atomic_write_bytes(self.out_dir / "model.pt", buf.getvalue())
