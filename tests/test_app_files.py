"""The staged app (fedefc_cli/app_files.py) is the FAB Flower's own builder makes from
the whole folder, without walking what ``fab-include`` cannot match (a virtual
environment, ``.git``, results)."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fedefc_cli.app_files import MANIFEST, app_files, candidate_files, stage_app
from fedefc_cli.run_configs import APP_DIR

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "toyapp"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "toy"
{include}

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"

[tool.flwr.app.config]
lr = 0.1
"""


def flowers_files(app_dir: Path) -> dict[str, bytes]:
    """What ``flwr run app_dir`` ships: Flower's builder over the whole folder."""
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app_dir))) as fab:
        return {n: fab.read(n) for n in fab.namelist() if n != MANIFEST}


def toy_app(root: Path, include: str) -> Path:
    """An app with its code in pkg/ (a symlink out of it among the files) beside a
    virtual environment's worth of files and a README."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT.format(include=include))
    for name in ("server.py", "client.py", "sub/math.py", "notes.md"):
        (root / "pkg" / name).write_text(f"# {name}\n")
    outside = root.parent / f"{root.name}-secret.py"
    outside.write_text("TOKEN = 1\n")
    os.symlink(outside, root / "pkg" / "linked.py")
    for k in range(300):
        env = root / ".venv" / "lib" / f"mod{k}"
        env.mkdir(parents=True)
        (env / "__init__.py").write_text("x = 1\n")
    (root / "README.md").write_text("# toy\n")
    return root


@pytest.mark.parametrize("include, roots_only", [
    ('fab-include = ["pkg/**/*.py"]', True),
    ('fab-include = ["pkg/**/*.py", "pkg/notes.md"]', True),
    ('fab-include = ["**/*.py"]', False),  # may match anywhere: the whole folder
    ("", False),  # no fab-include: Flower's defaults over the whole folder
])
def test_the_staged_app_is_flowers_fab_of_the_folder(tmp_path, include, roots_only):
    app = toy_app(tmp_path / "app", include)
    files = app_files(app)
    assert files == flowers_files(app)
    assert "pkg/linked.py" not in files  # a symlink, skipped as Flower skips it
    walked = candidate_files(app)
    assert any(name.startswith(".venv/") for name in walked) is not roots_only
    staged = stage_app(app, tmp_path / "staged")
    assert flowers_files(staged) == files  # packing the staged folder ships the same


def test_the_projects_own_app_is_staged_as_flower_builds_it():
    """This checkout's app (with its .venv, .git and results/ under the folder, when
    present): the same files, bytes for bytes, as Flower's build of the folder."""
    files = app_files(APP_DIR)
    assert files == flowers_files(APP_DIR)
    assert "fedefc_client/client_app.py" in files and "pyproject.toml" in files
    assert not any(name.startswith(("tests/", "docs/", "results/")) for name in files)
