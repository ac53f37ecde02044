"""The GPU benchmark runs on CPU with its tiny setting (a real `fedefc run`), and prints
what a GPU box needs to know: throughput, round times, start-up, projected full-run time
and the memory of every process of the run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import RUN_LIMIT_S, patience

BENCH = Path(__file__).parent / "benchmarks" / "bench_gpu.py"


@pytest.mark.flower
def test_bench_gpu_tiny_run_measures_a_run_with_phase_2(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=patience(RUN_LIMIT_S))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())
    assert row["t_e"] == 2 and row["phase2_round_s"] > 0  # rounds 3.. ran phase 2
    assert row["samples_per_s"] > 0 and row["projected_full_run_min"] > 0
    names = " ".join(row["peak_pss_mb"])
    assert "flower-superlink" in names and "ClientAppActor" in names
    assert row["peak_sum_mb"] >= max(row["peak_pss_mb"].values())
    assert "x today" in out.stdout and "peak sum over the run's processes" in out.stdout


def test_the_memory_sampler_names_each_process_by_what_it_became():
    """A SuperLink sampled between its fork and its exec has no name, or its parent's name
    and pages: its row must still say flower-superlink, with its own peak."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    peaks: dict[int, tuple[str, float]] = {}
    samples = [("python -m fedefc_cli", 400.0), ("", 350.0), ("python3 flower-superlink", 90.0),
               ("python3 flower-superlink", 120.0), ("python3 flower-superlink", 100.0), None]
    seen = [bench.record_sample(peaks, 7, s) for s in samples]
    assert seen == [400.0, 0.0, 90.0, 120.0, 100.0, 0.0]
    assert peaks == {7: ("python3 flower-superlink", 120.0)}
