"""Benchmark: the authors' FedEFC code on a paper preset, timed as bench_gpu.py times ours.

The authors' public code (github.com/bgbhbf/FedEFC; one process, the sampled clients of
a round trained one after another) is never part of this project: give the folder of a
checkout (``--authors``). It runs unmodified; this script only supplies what it needs to
run offline:

- the data: synthetic images of the preset's shape and the full training-set size
  (bench_gpu.py's ``write_synthetic``, torchvision's layout) in the folders the code
  reads (``./mnist``, ``./cifar10``, ``./cifar100`` of its working directory). Its
  ``download=True`` finds MNIST's files and stops there; torchvision's CIFAR loaders
  also compare the files' MD5 sums with the official ones, which synthetic files fail,
  so that check is answered yes in the code's process;
- ``torch.utils.tensorboard``: the code logs through it and the ``tensorboard`` package
  is not installed here or on the device image; a stand-in that drops the scalars.

It runs the preset's own settings (100 clients, 10 per round, E, batch, lr, momentum,
(alpha-dir, p) = (10, 0.5), (rho, zeta) = (0.2, 0.8)) for ``--rounds`` rounds of FedEFC
on ``--device`` and prints what bench_gpu.py prints for our runs: samples/s of local
training (10 clients x training-set / 100 x E per round), seconds per round (the code's
own "Round execution time"), start-up (wall time outside the rounds), the projected full
run (start-up + the preset's rounds at the steady round time), the peak memory of the
process (PSS) and, on CUDA, torch's peak allocation. Results: docs/BENCHMARKS.md, "GPU".

    python tests/benchmarks/bench_authors.py --authors /abs/FedEFC [--preset mnist]
        [--rounds 5] [--device cuda] [--out /abs/dir] [--tiny]

``--tiny`` is the CPU rehearsal: 7,000 training images (70 per client), E = 1, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import runpy
import statistics
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu import SHAPES, run_and_sample, write_synthetic  # noqa: E402

from fedefc_cli.run_configs import read_preset  # noqa: E402

ROUND_S = re.compile(r"Round execution time: ([0-9.]+) seconds")
CUDA_PEAK = "bench-authors cuda peak MB:"


def authors_args(preset: dict, dataset: str, rounds: int, device: str) -> list[str]:
    """The authors' command line for ``preset`` (util/options.py of their code)."""
    return ["--dataset", dataset, "--method", "FedEFC", "--rounds", str(rounds),
            "--num_users", str(preset["num-clients"]), "--frac", str(preset["fraction"]),
            "--local_ep", str(preset["local-epochs"]), "--local_bs", str(preset["batch-size"]),
            "--lr", str(preset["lr"]), "--momentum", str(preset["momentum"]),
            "--alpha_dirichlet", str(preset["alpha-dir"]),
            "--non_iid_prob_class", str(preset["p"]), "--noise_amount", str(preset["rho"]),
            "--sparsity", str(preset["zeta"]), "--gamma_thr", str(preset["gamma-thr"]),
            "--start_monitor", str(preset["start-round"]),
            "--gpu", "0" if device == "cuda" else "-1"]


def write_meta(root: Path, dataset: str) -> None:
    """The class-name file torchvision's CIFAR loaders read (bench_gpu.py's data, made
    for our loader, has none)."""
    k = SHAPES[dataset][3]
    names = [f"class{i}" for i in range(k)]
    if dataset == "cifar10":
        (root / "cifar-10-batches-py" / "batches.meta").write_bytes(
            pickle.dumps({"label_names": names}))
    elif dataset == "cifar100":
        (root / "cifar-100-python" / "meta").write_bytes(
            pickle.dumps({"fine_label_names": names}))


def inner(authors: Path, argv: list[str]) -> None:
    """In the code's own process (working directory: the data's folder): the two
    offline stand-ins, then its ``main.py`` as ``__main__``."""
    import atexit

    import torch
    from torchvision.datasets import cifar

    board = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:  # the code's scalar log, dropped
        def __init__(self, *args, **kwargs):
            pass

        def add_scalar(self, *args, **kwargs):
            pass

    board.SummaryWriter = SummaryWriter
    sys.modules["torch.utils.tensorboard"] = board
    cifar.check_integrity = lambda *args, **kwargs: True  # synthetic files: not the MD5s
    if torch.cuda.is_available():
        atexit.register(lambda: print(CUDA_PEAK, torch.cuda.max_memory_allocated() / 2**20,
                                      flush=True))
    sys.path.insert(0, str(authors))
    sys.argv = [str(authors / "main.py"), *argv]
    runpy.run_path(str(authors / "main.py"), run_name="__main__")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--authors", type=Path, required=True, help="a checkout of bgbhbf/FedEFC")
    ap.add_argument("--preset", default="mnist", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, help="folder for results.json and the code's log")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU rehearsal: 7,000 images, E = 1, 2 rounds")
    ap.add_argument("--inner", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    authors = args.authors.resolve()
    if args.inner is not None:
        inner(authors, args.inner)
        return
    if not (authors / "main.py").is_file():
        raise SystemExit(f"--authors {authors}: no main.py there; give a checkout of "
                         "github.com/bgbhbf/FedEFC")
    preset = read_preset(args.preset)
    if args.tiny:
        preset = {**preset, "local-epochs": 1}
    rounds = 2 if args.tiny else args.rounds
    n_train = 7000 if args.tiny else SHAPES[args.preset][4]
    with tempfile.TemporaryDirectory(prefix="bench-authors-") as tmp:
        work = Path(tmp)
        write_synthetic(work / args.preset, args.preset, n_train, max(n_train // 6, 100))
        write_meta(work / args.preset, args.preset)
        (work / "record" / "txtsave").mkdir(parents=True)
        out = args.out or work
        out.mkdir(parents=True, exist_ok=True)
        log = out / f"authors-{args.preset}.log"
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--authors", str(authors),
               "--inner", *authors_args(preset, args.preset, rounds, args.device)]
        measured = _in(work, cmd, log)
        text = log.read_text(errors="replace")
    round_s = [float(s) for s in ROUND_S.findall(text)]
    if len(round_s) != rounds:
        raise SystemExit(f"expected {rounds} rounds in {log}, found {len(round_s)}")
    steady = statistics.median(round_s[1:] or round_s)
    c, h, w, k, _ = SHAPES[args.preset]
    per_round = round(preset["fraction"] * preset["num-clients"]) * n_train // \
        preset["num-clients"] * preset["local-epochs"]
    cuda_peak = [float(line.split(":")[1]) for line in text.splitlines()
                 if line.startswith(CUDA_PEAK)]
    row = {"preset": args.preset, "device": args.device, "rounds": rounds,
           "round_s": round_s, "steady_round_s": steady,
           "samples_per_s": per_round / steady,
           "startup_s": measured.wall_s - sum(round_s), "wall_s": measured.wall_s,
           "projected_full_run_min": (measured.wall_s - sum(round_s)
                                      + preset["rounds"] * steady) / 60,
           "peak_pss_mb": max((mb for _, mb in measured.peak_pss.values()), default=0.0),
           "cuda_peak_mb": cuda_peak[0] if cuda_peak else None}
    if args.out:
        (args.out / "results.json").write_text(json.dumps(row, indent=1))
    print(f"authors' code, {args.preset} ({n_train} training images, {c}x{h}x{w}, K={k}), "
          f"{rounds} rounds of FedEFC on {args.device}")
    print(f"samples/s {row['samples_per_s']:.0f}; s/round {steady:.2f} (each: "
          f"{[round(s, 2) for s in round_s]}); start-up {row['startup_s']:.1f} s; projected "
          f"full run ({preset['rounds']} rounds) {row['projected_full_run_min']:.1f} min; "
          f"peak PSS {row['peak_pss_mb']:.0f} MB; CUDA peak {row['cuda_peak_mb']} MB")
    print(json.dumps(row))


def _in(work: Path, cmd: list[str], log: Path):
    """``run_and_sample`` with the code's working directory set to ``work``."""
    import os
    here = Path.cwd()
    os.chdir(work)
    try:
        return run_and_sample(cmd, log)
    finally:
        os.chdir(here)


if __name__ == "__main__":
    main()
