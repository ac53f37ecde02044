"""Data in and out of a deployment: ``fedefc deploy fetch`` copies a run's out-dir from
the SuperLink machine and summarizes it; ``fedefc deploy export`` writes every partition
of a run config as a node's private data (docs/DEPLOYMENT.md, "Node data").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common.data_files import write_npz
from common.results import atomic_write_json

from .deploy_submit import silent_nodes_hint
from .end_of_run import tell_run
from .errors import EXIT_DEGRADED, LaunchError, UsageError
from .prepare_data import write_image_folder
from .run_configs import merged_config

RESULT_FILES = ("config.json", "metrics.jsonl", "summary.json", "model.pt")


def _is_remote(source: str) -> bool:
    """``[user@]host:/path`` (scp's form), not a local path."""
    head, sep, _ = source.partition(":")
    return bool(sep) and "/" not in head and bool(head)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Copy a run's out-dir from the SuperLink machine (``[user@]host:/abs/out-dir``, by
    scp over SSH) or from a local path, then check and summarize what arrived."""
    dest = Path(args.dest).expanduser().resolve()
    if dest.exists():
        raise UsageError(f"{dest} already exists; choose a new LOCAL_DIR (nothing overwritten)")
    if _is_remote(args.source):
        if not shutil.which("scp"):
            raise UsageError("scp not found; install openssh-client, or copy the out-dir "
                             "by other means and give its local path")
        code = subprocess.call(["scp", "-r", "-p", "-q", args.source, str(dest)])
        if code != 0:
            raise LaunchError(f"scp -r {args.source} {dest} failed (exit {code}): check the "
                              "host name, your SSH access to it, and the out-dir's path there")
    else:
        source = Path(args.source).expanduser().resolve()
        if not source.is_dir():
            raise UsageError(f"{source} is not a run's out-dir (no such folder); give "
                             "HOST:/abs/out-dir for the SuperLink machine's folder")
        shutil.copytree(source, dest)
    missing = [name for name in RESULT_FILES if not (dest / name).is_file()]
    summary = {}
    if (dest / "summary.json").is_file():
        summary = json.loads((dest / "summary.json").read_text())
    print(f"fetched {args.source} -> {dest}: "
          f"{', '.join(sorted(p.name for p in dest.iterdir()))}")
    tell_run(dest)
    if summary.get("status") == "failed":
        failure = summary.get("failure", "no reason recorded")
        hint = silent_nodes_hint(failure)
        print(f"fedefc deploy: the run FAILED: {failure}" + (f"\n{hint}" if hint else ""),
              file=sys.stderr)
        return 1
    if summary.get("status") == "degraded":
        print(f"fedefc deploy: the run is DEGRADED: {summary.get('degraded')}",
              file=sys.stderr)
    if missing:
        print(f"fedefc deploy: {', '.join(missing)} missing: the run did not finish (it may "
              "still run, or have failed before writing them; see flwr log RUN_ID)",
              file=sys.stderr)
        return 1
    return EXIT_DEGRADED if summary.get("status") == "degraded" else 0


def cmd_export(args: argparse.Namespace) -> int:
    """Each partition K of the run's dataset (noisy labels included) as a node's private
    data: ``OUT/node-K/data.npz``, or with ``--images`` a folder of PNG files per class
    (``OUT/node-K/<class index>/<n>.png``) and the federation's class map
    ``OUT/classes.json``, to try ``fedefc data`` as a site with real images would
    (docs/DEPLOYMENT.md, "Node data"). With ``validation-labels = "verified"`` the
    simulation's verified share is written with its true labels and marked in a
    ``verified`` array (docs/FEDEFC.md §3.7)."""
    import torch  # lazy: torch, 1.9 s of CPU

    from common.data_plan import data_plan  # lazy: torch, 1.9 s of CPU
    from common.methods import load_run_config  # lazy: torch, 1.9 s of CPU
    from common.sample_roles import SampleRoles, verified_labels  # lazy: torch, 1.9 s of CPU
    cfg = load_run_config(merged_config(args.preset, args.overrides))
    if args.images and verified_labels(cfg):
        raise UsageError("validation-labels=\"verified\" with --images: an image folder "
                         "cannot mark verified samples; export an .npz per node (without "
                         "--images)")
    out = Path(args.out_dir).expanduser().resolve()
    folders = [out / f"node-{pid}" for pid in range(cfg.num_clients)]
    paths = folders if args.images else [folder / "data.npz" for folder in folders]
    existing = [str(p) for p in [*paths, out / "classes.json"] if p.exists()]
    if existing:
        raise UsageError(f"{', '.join(existing)} already exist; choose a new OUT_DIR "
                         "(nothing overwritten)")
    fed = data_plan(cfg)
    if args.images and (fed.data.train_x.dim() != 4 or fed.data.train_x.dtype != torch.uint8
                        or fed.data.train_x.shape[1] not in (1, 3)):
        raise UsageError(f"dataset={cfg.dataset!r} holds no 8-bit gray or RGB images "
                         f"(samples of shape {tuple(fed.data.train_x.shape[1:])}); export it "
                         "without --images (an .npz per node)")
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write to OUT_DIR {out} ({err.strerror}: {err.filename}); "
                         "choose a folder you can write to") from None
    for pid, (idx, path) in enumerate(zip(fed.client_indices, paths)):
        x, y = fed.data.train_x[torch.as_tensor(idx)].numpy(), fed.noisy_labels[idx]
        checked = SampleRoles.build(cfg, pid, len(idx), fed.data.num_classes).checked_mask()
        if checked is not None:
            y = y.copy()
            y[checked] = fed.true_labels[idx][checked]
        if args.images:
            write_image_folder(path, x, y)
        else:
            write_npz(path, x, y, checked)
        print(f"partition {pid}: {len(idx)} samples -> {path}")
    if args.images:
        atomic_write_json(out / "classes.json", {str(c): c for c in range(fed.data.num_classes)})
        print(f"class map (the same at every node) -> {out / 'classes.json'}")
    return 0
