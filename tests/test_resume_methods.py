"""Resume of the methods whose state lives on the server only (FedNoRo, RoFL).

FedNoRo's noisy set and RoFL's global centroids are in the strategy's checkpoint and
their clients keep nothing across rounds, so a run stopped after round 3 and resumed
to round 5 must end exactly where an uninterrupted 5-round run ends (CPU, one thread).
"""

import json

import pytest
import torch

from fedefc_cli.run_configs import resume_config
from fedefc_cli.simulation import run_simulation_job
from tests.helpers import records, small_job

EXTRA = {"fednoro": {"fednoro-warmup": 2, "fednoro-kd-begin": 2, "fednoro-kd-end": 4},
         "rofl": {"rofl-t-pl": 2, "rofl-num-gradual": 2}}


@pytest.mark.flower
@pytest.mark.parametrize("method", sorted(EXTRA))
def test_server_state_methods_resume_exactly(tmp_path, tiny_mnist_dir, method):
    extra = {"method": f'"{method}"', **EXTRA[method]}
    run_simulation_job(small_job(tiny_mnist_dir, tmp_path / "whole", rounds=5, **extra))
    run_simulation_job(small_job(tiny_mnist_dir, tmp_path / "part", rounds=3, **extra))
    summary = run_simulation_job(resume_config(str(tmp_path / "part"), ["rounds=5"]))
    a = torch.load(tmp_path / "whole" / "model.pt")
    b = torch.load(tmp_path / "part" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("round", "test_acc", "phase", "partition_ids", "t_e")
    ra, rb = records(tmp_path / "whole"), records(tmp_path / "part")
    assert [{k: r.get(k) for k in keys} for r in ra] == [{k: r.get(k) for k in keys} for r in rb]
    assert summary["final_acc"] == json.loads((tmp_path / "whole" / "summary.json")
                                              .read_text())["final_acc"]
