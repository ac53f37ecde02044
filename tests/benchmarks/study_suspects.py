"""Which labels to check first: ``fedefc labels --suspects`` against a random draw, the
numbers of docs/OWN-DATA.md, "Which labels to check first".

Three sites of 500 images each, 30 % of the 1,500 labels flipped to another class drawn
at random (seeded): scikit-learn's digits (8x8, K = 10; the other 297 the coordinator's
clean test set) or the embedded MNIST subset (28x28, K = 10; 1,000 of the others the
test set). One FedEFC run over them (``fedefc run``: the sites as
the run's three clients, every client every round, the defaults otherwise). Then each
site ranks its own samples from the run's ``model.pt`` with the code of ``fedefc labels
--suspects`` (``fedefc_cli/suspects.py``), and this script counts the flipped labels among
its first 100 suspects, and among its first F (F: the site's flipped labels, so that a
perfect ranking finds them all), against a random 100 (30 % on average); beside them
two other rankings of the same predictions: by Bayes' probability that the label is
wrong, 1 - Q[ỹ, ỹ] p[ỹ] / (Q p)[ỹ] (highest first), and by the model's own p[ỹ], without
Q (lowest first)::

    python tests/benchmarks/study_suspects.py --out /tmp/fedefc-suspects \
        [--dataset digits|mnist-embedded] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SITES, PER_SITE, FLIPPED, FIRST, TEST = 3, 500, 0.3, 100, 1000


def images_of(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, H, W) and labels of ``dataset``."""
    if dataset == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        return np.round(digits.images * 255 / 16).astype(np.uint8), digits.target
    sys.path.insert(0, str(REPO))
    from common.named_datasets import load_embedded_mnist

    x, y, xt, yt = load_embedded_mnist()
    return np.concatenate([x, xt])[:, 0], np.concatenate([y, yt])


def write_pool(out: Path, dataset: str, seed: int) -> np.ndarray:
    """pool.npz (1,500 images, 30 % of their labels flipped to another class: the run's
    data) and test.npz (at most 1,000 others, true labels); returns the pool's true
    labels."""
    all_images, all_labels = images_of(dataset)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(all_labels))
    n = SITES * PER_SITE
    images, truth = all_images[order][:n + TEST], all_labels[order][:n + TEST]
    observed = truth[:n].copy()
    rows = rng.choice(n, int(FLIPPED * n), replace=False)
    observed[rows] = (truth[rows] + rng.integers(1, 10, len(rows))) % 10  # another class
    np.savez(out / "pool.npz", images=images[:n], labels=observed)
    np.savez(out / "test.npz", images=images[n:], labels=truth[n:])
    return truth[:n]


def run(out: Path, seed: int) -> Path:
    """The FedEFC run over the pool: three clients of 500 (IID), every one every round."""
    run_dir = out / "run"
    if not (run_dir / "model.pt").exists():
        env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
        subprocess.run([sys.executable, "-m", "fedefc_cli", "run", "--set", "dataset=npz",
                        "--set", f"data-path={out / 'pool.npz'}", "--set",
                        f"test-path={out / 'test.npz'}", "--set", f"num-clients={SITES}",
                        "--set", "fraction=1.0", "--set", "iid=true", "--set", "rho=0",
                        "--set", f"seed={seed}", "--set", f"out-dir={run_dir}"],
                       cwd=REPO, env=env, check=True)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dataset", choices=("digits", "mnist-embedded"), default="digits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    truth = write_pool(args.out, args.dataset, args.seed)
    run_dir = run(args.out, args.seed)
    sys.path.insert(0, str(REPO))
    from common.data_plan import data_plan
    from common.methods import load_run_config
    from fedefc_cli.suspects import rank_site

    cfg = load_run_config(json.loads((run_dir / "config.json").read_text()))
    with np.load(args.out / "pool.npz") as pool:
        images, observed = pool["images"], pool["labels"]
    rng = np.random.default_rng(args.seed)
    rows = []
    for k, idx in enumerate(data_plan(cfg).client_indices):  # client k is site k
        idx = np.asarray(idx)
        site = args.out / f"site-{k}.npz"
        np.savez(site, images=images[idx], labels=observed[idx])
        wrong = observed[idx] != truth[idx]
        ranked = rank_site(site, run_dir / "model.pt")
        by_p = np.argsort(ranked.probs[np.arange(len(idx)), observed[idx]], kind="stable")
        labels_ = observed[idx]
        sure = ranked.q[labels_, labels_] * ranked.probs[np.arange(len(idx)), labels_]
        by_posterior = np.argsort(sure / ranked.observed_p, kind="stable")
        f = int(wrong.sum())
        rows.append({
            "site": k, "samples": len(idx), "flipped": f,
            **{f"{name}_{first}": float(wrong[order[:first]].mean())
               for name, order in (("suspects", ranked.order), ("posterior", by_posterior),
                                   ("p_observed", by_p))
               for first in (FIRST, f)},
            "random": float(np.mean([wrong[rng.choice(len(idx), FIRST, replace=False)].mean()
                                     for _ in range(1000)]))})
    print(json.dumps(rows, indent=1))
    print(f"summary.json: {json.loads((run_dir / 'summary.json').read_text())}")


if __name__ == "__main__":
    main()
