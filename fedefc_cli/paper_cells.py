"""The paper's published numbers (``configs/reference/paper-results.toml``) and which
paper-table cell a run corresponds to, for the tables beside ours (:mod:`.report`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from common.fedefc_plan import accuracy_signal_mode
from common.methods import default_config
from common.named_datasets import DATASETS

from .run_configs import CONFIGS_DIR

PAPER_FILE = CONFIGS_DIR / "reference" / "paper-results.toml"

# The paper's choices for the keys that ablations vary: a run with another value is not
# the method the paper measured, so it gets no paper number beside it.
PAPER_CHOICES = {"count-rule": "cleanlab", "accuracy-signal": "global", "prestopping": True,
                 "rofl-detach-centroid-feature": False}


def paper_weighting(family: str, p: float) -> str:
    """The paper uses the label-prior weighting on MNIST and CIFAR-10 when p = 0.2
    (docs/FEDEFC.md §4.4)."""
    return "label-prior" if family in ("mnist", "cifar10") and p == 0.2 else "none"


def paper_key(config: dict[str, Any]) -> tuple | None:
    """The paper-table cell a run corresponds to, or None (e.g. the embedded dataset, or
    an ablation that changes one of the paper's choices)."""
    named = DATASETS.get(config["dataset"])
    family = named.paper if named else None
    if family is None or config.get("noise-groups") or config.get("iid"):
        return None
    keys = {**default_config(), "accuracy-signal": "global", **config}  # "global": older runs
    resolved = {**config, "accuracy-signal": accuracy_signal_mode(
        keys["accuracy-signal"], keys["num-clients"], keys["fraction"], keys["prestopping"])}
    if any(resolved.get(k, v) != v for k, v in PAPER_CHOICES.items()):
        return None
    if config["method"] == "fedefc" and \
            config.get("weighting", "none") != paper_weighting(family, config["p"]):
        return None
    method = config["method"]
    if config["rho"] == 0.0:
        if method != "fedavg":
            return None
        return (family, config["alpha-dir"], config["p"], 0.0, 0.0, "fedavg-nonoise")
    return (family, config["alpha-dir"], config["p"], config["rho"], config["zeta"], method)


def load_paper_numbers(path: Path = PAPER_FILE) -> dict[tuple, tuple[float, float]]:
    with open(path, "rb") as fh:
        entries = tomllib.load(fh)["entry"]
    return {(e["dataset"], e["alpha-dir"], e["p"], e["rho"], e["zeta"], e["method"]):
            (e["mean"], e["std"]) for e in entries}


def cell_text(key: tuple | None) -> str:
    """A :func:`paper_key` as ``runs.csv`` stores it ("" for none)."""
    return "" if key is None else "; ".join(str(part) for part in key)


def cell_key(text: str) -> tuple | None:
    """The :func:`paper_key` back from :func:`cell_text`."""
    if not text:
        return None
    family, alpha, p, rho, zeta, method = text.split("; ")
    return family, float(alpha), float(p), float(rho), float(zeta), method
