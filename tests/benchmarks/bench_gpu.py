"""Benchmark: the paper's presets through the real Flower simulation (`fedefc run`), timed
per setting, with the memory of every process of the run.

For each preset (mnist: 9-conv CNN; cifar10: ResNet-18; cifar100: ResNet-34) and each
setting (GPUs per simulated client = how many clients share a GPU; precision fp32 or
bf16), one `fedefc run` of a few rounds on synthetic data of the dataset's shape:
10 clients holding 10 % of the training set's size between them, all sampled every round
(the work of one round of the paper's 100 clients at 10 %), learning rate 1e-7 so that
A(t) ties at round 2 and rounds 3.. run phase 2 (T_e = 2) -- for models without batch
norm: its running statistics move whatever the learning rate, and on an H100 ResNet-18's
A(t) rose in every round (docs/BENCHMARKS.md, "GPU"), so phase 2 may not be reached
(its column then reads 0). It prints,
per setting: samples/s of local training, seconds per round (phase 1 and phase 2),
start-up (wall time outside the rounds), the projected wall time of the preset's full
run (start-up + its rounds at this run's steady round time), the peak memory (PSS) of
every process of the run and their peak sum; and each setting's ratio against today's
default (0.25 GPU per client on CUDA, 0 on CPU; fp32), measured in the same invocation.

    python tests/benchmarks/bench_gpu.py                       # GPU sweep, all presets
    python tests/benchmarks/bench_gpu.py --tiny                # CPU smoke test (seconds)
    python tests/benchmarks/bench_gpu.py --presets mnist --gpus 1,0.5,0.25 --rounds 5
    python tests/benchmarks/bench_gpu.py --presets mnist --set step-capture=cuda-graph
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedefc_cli.run_configs import read_preset

SHAPES = {"mnist": (1, 28, 28, 10, 60_000), "cifar10": (3, 32, 32, 10, 50_000),
          "cifar100": (3, 32, 32, 100, 50_000)}  # C, H, W, K, training-set size
CLIENTS = 10


def write_synthetic(root: Path, dataset: str, n_train: int, n_test: int) -> Path:
    """Random uint8 images and balanced labels in torchvision's layout of ``dataset``."""
    c, h, w, k, _ = SHAPES[dataset]
    rng = np.random.default_rng(0)
    x = {s: rng.integers(0, 256, (n, c, h, w), dtype=np.uint8)
         for s, n in (("train", n_train), ("test", n_test))}
    y = {s: np.arange(len(x[s])) % k for s in x}
    if dataset == "mnist":
        raw = root / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for split, prefix in (("train", "train"), ("test", "t10k")):
            imgs, labels = x[split][:, 0], y[split].astype(np.uint8)
            (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
                struct.pack(">4I", 2051, *imgs.shape) + imgs.tobytes())
            (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
                struct.pack(">2I", 2049, len(labels)) + labels.tobytes())
        return root
    folder, key, files = ({"cifar10": ("cifar-10-batches-py", "labels",
                                       {"train": [f"data_batch_{i}" for i in range(1, 6)],
                                        "test": ["test_batch"]}),
                           "cifar100": ("cifar-100-python", "fine_labels",
                                        {"train": ["train"], "test": ["test"]})}[dataset])
    (root / folder).mkdir(parents=True, exist_ok=True)
    for split, names in files.items():
        for part, idx in zip(names, np.array_split(np.arange(len(x[split])), len(names))):
            with open(root / folder / part, "wb") as fh:
                pickle.dump({"data": x[split][idx].reshape(len(idx), -1),
                             key: y[split][idx].tolist()}, fh)
    return root


def tree(pid: int) -> list[int]:
    """``pid`` and its living descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def pss_mb(pid: int) -> tuple[str, float] | None:
    """(process name, proportional set size in MB) of a living process."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    pss = next((int(line.split()[1]) for line in rollup.splitlines()
                if line.startswith("Pss:")), 0) / 1024
    words = [w.decode(errors="replace") for w in cmd if w]
    name = " ".join(Path(w).name if i < 2 else w for i, w in enumerate(words[:3]))
    return name[:60], pss


def record_sample(peaks: dict[int, tuple[str, float]], pid: int,
                  sample: tuple[str, float] | None) -> float:
    """Keep in ``peaks`` each process's last name and its peak PSS under that name; return
    the sample's PSS (0 for none). A sample without a name (a process between fork and
    exec, or exiting) is skipped, and a new name (an exec, a Ray worker renaming itself)
    starts a new peak: a child sampled before its exec still shares its parent's pages."""
    if not sample or not sample[0]:
        return 0.0
    name, pss = sample
    before, peak = peaks.get(pid, ("", 0.0))
    peaks[pid] = (name, max(pss, peak) if name == before else pss)
    return pss


@dataclass
class Measured:
    wall_s: float = 0.0
    peak_pss: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> name, MB
    peak_sum: float = 0.0


def run_and_sample(cmd: list[str], log: Path) -> Measured:
    """Run ``cmd``, sampling the PSS of its process tree twice a second."""
    m = Measured()
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            total = 0.0
            for pid in tree(proc.pid):
                total += record_sample(m.peak_pss, pid, pss_mb(pid))
            m.peak_sum = max(m.peak_sum, total)
            time.sleep(0.5)
    m.wall_s = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); {log} ends:\n{tail}")
    return m


def one_setting(preset: str, data: Path, out: Path, rounds: int, gpus: float, precision: str,
                extra: list[str]) -> dict:
    sets = {"data-dir": f'"{data}"', "num-clients": CLIENTS, "fraction": 1.0,
            "rounds": rounds, "start-round": 0, "gamma-thr": 1, "lr": 1e-7,
            "precision": f'"{precision}"', "accuracy-signal": '"global"'}
    cmd = [sys.executable, "-m", "fedefc_cli", "run", preset, "--out-dir", str(out),
           "--client-gpus", str(gpus), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
           *[a for e in extra for a in ("--set", e)]]
    m = run_and_sample(cmd, out.parent / f"{out.name}.log")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    config = json.loads((out / "config.json").read_text())
    epochs = config["local-epochs"]
    steady = [r for r in recs if r["round"] >= 2]
    step = statistics.median(r["round_s"] for r in steady)
    samples = statistics.median(sum(r["num_examples"]) * epochs for r in steady)
    by_phase = {p: statistics.median([r["round_s"] for r in steady if r["phase"] == p] or [0])
                for p in (1, 2)}
    startup = m.wall_s - sum(r["round_s"] for r in recs)
    full_rounds = read_preset(preset)["rounds"]
    return {"preset": preset, "gpus_per_client": gpus, "precision": precision,
            "samples_per_s": samples / step, "round_s": step, "phase1_round_s": by_phase[1],
            "phase2_round_s": by_phase[2], "startup_s": startup,
            "projected_full_run_min": (startup + full_rounds * step) / 60,
            "full_rounds": full_rounds, "t_e": recs[-1]["t_e"],
            "peak_pss_mb": {f"{name} [{pid}]": mb for pid, (name, mb) in m.peak_pss.items()},
            "peak_sum_mb": m.peak_sum, "wall_s": m.wall_s}


def report(rows: list[dict], default_gpus: float) -> None:
    for preset in dict.fromkeys(r["preset"] for r in rows):
        own = [r for r in rows if r["preset"] == preset]
        base = next((r for r in own if r["gpus_per_client"] == default_gpus
                     and r["precision"] == "fp32"), own[0])
        print(f"\n== {preset} ({base['full_rounds']} rounds in full); today's default: "
              f"{default_gpus} GPU/client, fp32")
        print(f"{'GPU/client':>10} {'prec':>5} {'samples/s':>10} {'s/round':>8} "
              f"{'ph1 s':>6} {'ph2 s':>6} {'start s':>8} {'full run':>9} {'x today':>8} "
              f"{'mem sum':>8}")
        for r in own:
            print(f"{r['gpus_per_client']:>10} {r['precision']:>5} {r['samples_per_s']:>10.0f} "
                  f"{r['round_s']:>8.2f} {r['phase1_round_s']:>6.2f} {r['phase2_round_s']:>6.2f} "
                  f"{r['startup_s']:>8.1f} {r['projected_full_run_min']:>7.1f} m "
                  f"{base['projected_full_run_min'] / r['projected_full_run_min']:>7.2f}x "
                  f"{r['peak_sum_mb']:>6.0f} MB")
        worst = max(own, key=lambda r: r["peak_sum_mb"])
        print(f"peak memory per process ({worst['gpus_per_client']} GPU/client, "
              f"{worst['precision']}):")
        for name, mb in sorted(worst["peak_pss_mb"].items(), key=lambda kv: -kv[1]):
            if mb >= 5:
                print(f"  {mb:7.0f} MB  {name}")
        print(f"  {worst['peak_sum_mb']:7.0f} MB  peak sum over the run's processes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mnist,cifar10,cifar100")
    ap.add_argument("--gpus", default=None,
                    help="GPUs per client to try (default 1,0.5,0.25,0.125 on CUDA, 0 on CPU)")
    ap.add_argument("--precisions", default=None, help="default fp32,bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--settings", default=None,
                    help="GPU/client:precision pairs instead of the --gpus x --precisions grid, "
                         "e.g. 0.25:fp32,0.125:bf16 (today's default is always run first)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per timed run (>= 4)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: mnist with LeNet on 200 synthetic images, 4 rounds")
    ap.add_argument("--out", default=None, help="keep runs and results.json here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help='a run-config override for every setting, e.g. step-capture="cuda-graph"')
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    default_gpus = 0.25 if cuda else 0.0
    if args.settings:
        pairs = [(float(g), p) for g, p in (s.split(":") for s in args.settings.split(","))]
        settings = list(dict.fromkeys([(default_gpus, "fp32"), *pairs]))
    else:
        gpus = [float(g) for g in (args.gpus or ("1,0.5,0.25,0.125" if cuda else "0")).split(",")]
        precisions = (args.precisions or ("fp32,bf16" if cuda else "fp32")).split(",")
        settings = [(g, p) for g in gpus for p in precisions]
    presets = ["mnist"] if args.tiny else args.presets.split(",")
    extra = (["model=lenet", "device=cpu"] if args.tiny else []) + args.set
    print(json.dumps({"torch": torch.__version__, "cuda": cuda,
                      "gpu": torch.cuda.get_device_name(0) if cuda else None}), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        root = Path(args.out or tmp)
        rows, failed = [], False
        for preset in presets:
            n_train = 200 if args.tiny else SHAPES[preset][4] // 10
            data = write_synthetic(root / f"data-{preset}", preset, n_train, n_train // 5)
            for g, precision in settings:
                out = root / f"{preset}-gpu{g}-{precision}"
                try:
                    rows.append(one_setting(preset, data, out, 4 if args.tiny else args.rounds,
                                            g, precision, extra))
                except RuntimeError as err:  # one failed setting must not cost the others
                    print(f"FAILED {preset} {g} GPU/client {precision}: {err}", flush=True)
                    failed = True
                    continue
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "peak_pss_mb"}),
                      flush=True)
                (root / "results.json").write_text(json.dumps(rows, indent=2))
        report(rows, default_gpus)
    if failed:
        raise SystemExit("some settings failed (see FAILED above)")


if __name__ == "__main__":
    main()
