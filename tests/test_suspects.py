"""``fedefc labels --suspects`` (fedefc_cli/suspects.py; docs/OWN-DATA.md, "Which labels to
check first"): the probability of the observed label through Q by hand, the ranking of
a hand-built site whose Q is counted by hand, and a site ranked from a saved model.pt
and its config.json against the model's own softmax computed here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.methods import load_run_config
from common.models import TaskShape
from common.runtime import initial_model
from fedefc_cli.suspects import SuspectsError, observed_probability, rank, rank_site


def test_the_probability_of_the_observed_label_goes_through_the_sites_q():
    """Q = [[0.8, 0.3], [0.2, 0.7]], p(x) = (0.9, 0.1): observed 0, (Q p)[0] = 0.8 * 0.9 +
    0.3 * 0.1 = 0.75; observed 1, (Q p)[1] = 0.2 * 0.9 + 0.7 * 0.1 = 0.25."""
    q = np.array([[0.8, 0.3], [0.2, 0.7]])
    probs = np.array([[0.9, 0.1], [0.9, 0.1]])
    np.testing.assert_allclose(observed_probability(probs, np.array([0, 1]), q), [0.75, 0.25])


def test_a_sites_suspects_come_first_with_its_q_counted_by_hand():
    """Six samples, K = 2. Labelled 0: p_0 = 0.95, 0.9, 0.1; labelled 1: p_1 = 0.9,
    0.85, 0.2. Thresholds (paper eq. (5)): 0.65 and 0.65; the counts C = [[2, 1],
    [1, 2]] (the third and the sixth cross), Q = C / column sums = [[2/3, 1/3], [1/3,
    2/3]]. (Q p)[ỹ]: 0.65, 0.6333, 0.3667, 0.6333, 0.6167, 0.4: the third first, then
    the sixth, the fifth, the second and the fourth (a tie: the lower row first), the
    first."""
    probs = np.array([[0.95, 0.05], [0.9, 0.1], [0.1, 0.9],
                      [0.1, 0.9], [0.15, 0.85], [0.8, 0.2]])
    labels = np.array([0, 0, 0, 1, 1, 1])
    ranked = rank(probs, labels)
    np.testing.assert_allclose(ranked.q, [[2 / 3, 1 / 3], [1 / 3, 2 / 3]])
    np.testing.assert_allclose(ranked.observed_p, [0.65, 0.6 + 0.1 / 3, 1.1 / 3,
                                                   0.6 + 0.1 / 3, 0.05 + 1.7 / 3, 0.4])
    assert ranked.order.tolist() == [2, 5, 4, 1, 3, 0]


@pytest.fixture
def run_folder(tmp_path):
    """A run's folder as a site receives it (model.pt and config.json: an MLP on 4
    features, K = 3, normalization given), and the site's DATA (30 samples)."""
    flat = {"dataset": "npz", "input-shape": "4", "num-classes": 3, "evaluation": "federated",
            "normalization": "1,2,3,4;2,2,2,2", "seed": 3}
    cfg = load_run_config(flat)
    model = initial_model(cfg, TaskShape((4,), 3))
    run = tmp_path / "run"
    run.mkdir()
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.json").write_text(json.dumps(cfg.to_flat()))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 4)).astype(np.float32) * 3 + 2
    y = rng.integers(0, 3, 30)
    np.savez(tmp_path / "data.npz", features=x, labels=y)
    return run, tmp_path / "data.npz", model, x, y


def test_a_site_is_ranked_by_the_runs_model_on_its_own_samples(run_folder):
    run, data, model, x, y = run_folder
    ranked = rank_site(data, run / "model.pt")
    model.eval()
    with torch.no_grad():
        normalized = (torch.from_numpy(x) - torch.tensor([1.0, 2, 3, 4])) / 2.0
        expected = torch.softmax(model(normalized), dim=1).double().numpy()
    np.testing.assert_allclose(ranked.probs, expected, rtol=1e-5, atol=1e-7)
    again = rank(expected, y)
    np.testing.assert_allclose(ranked.observed_p, again.observed_p, atol=1e-6)
    assert ranked.order[0] == int(np.argmin(again.observed_p))


def test_a_model_without_its_config_or_of_another_run_is_refused(run_folder, tmp_path):
    run, data, *_ = run_folder
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model.pt").write_bytes((run / "model.pt").read_bytes())
    with pytest.raises(SuspectsError, match="with the config.json the run wrote beside it"):
        rank_site(data, alone / "model.pt")
    other = json.loads((run / "config.json").read_text())
    other["num-classes"] = 4  # another run's config beside this model
    (run / "config.json").write_text(json.dumps(other))
    with pytest.raises(SuspectsError, match="is not the model its config.json describes"):
        rank_site(data, run / "model.pt")
    other.update({"num-classes": 3, "input-shape": "5"})
    (run / "config.json").write_text(json.dumps(other))
    with pytest.raises(SuspectsError, match="DATA must be data of the run"):
        rank_site(data, run / "model.pt")
