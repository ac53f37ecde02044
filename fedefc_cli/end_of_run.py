"""The end of ``fedefc deploy submit`` and ``fedefc deploy fetch``: the run told in a few
lines (:func:`fedefc_server.summary.run_report`: how it ended, its accuracies, T_e and
the phase-2 guard's verdict, the sites that missed rounds, where its files are), read
from the ``summary.json`` of its out-dir; the whole summary stays in that file
(README, "The first run"; docs/DEPLOYMENT.md, step 8)."""

from __future__ import annotations

import json
from pathlib import Path


def tell_run(out_dir: str | Path) -> None:
    """Print the run of ``out_dir`` in a few lines, where that folder and its
    ``summary.json`` are on this machine (``submit`` from another machine than the
    SuperLink's has neither: ``fetch`` brings them, and tells the run)."""
    path = Path(out_dir) / "summary.json"
    if not path.is_file():
        return
    from fedefc_server.summary import run_report  # lazy: flwr and torch, 1.9 s of CPU

    print("\n".join(run_report(json.loads(path.read_text()), Path(out_dir))), flush=True)
