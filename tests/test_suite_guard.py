"""The ``flower`` marker is enforced: an unmarked test cannot start a Flower executable."""

import subprocess

import pytest

from fedefc_cli.flower import flower_bin


def test_an_unmarked_test_cannot_start_flower():
    for name in ("flwr", "flower-superlink"):
        with pytest.raises(RuntimeError, match="not marked @pytest.mark.flower"):
            subprocess.run([flower_bin(name), "--help"], capture_output=True)


def test_other_programs_still_start():
    assert subprocess.run(["true"]).returncode == 0
