"""The app a run ships, staged apart from the project folder (docs/BENCHMARKS.md, "A run
every node refuses").

``flwr run DIR`` builds its FAB from every file under DIR: Flower walks and resolves all
of them (``flwr/cli/utils.py: collect_files``) before its include rules keep the app's
code. Run from a checkout, that walk covers the virtual environment, ``.git`` and
``results/`` (tens of thousands of files: 3 s of an idle machine, 12 s of a busy one,
before the run exists). :func:`app_files` hands Flower's own FAB builder only the
files under the folders ``fab-include`` names (and ``pyproject.toml``, ``.gitignore``),
so the FAB is the one ``flwr run DIR`` would build; :func:`stage_app` writes it to a
folder that ``flwr run`` then packs at once.
"""

from __future__ import annotations

import io
import re
import tomllib
import zipfile
from pathlib import Path

MANIFEST = ".info/CONTENT"  # Flower's own list of the FAB's files (not code)
TOP_FILES = ("pyproject.toml", ".gitignore")
GLOB = re.compile(r"[*?\[]")


def include_roots(app_dir: Path) -> list[str] | None:
    """The top folders or files the app's ``fab-include`` patterns can match (None: a
    pattern that may match anywhere, or no ``fab-include``: the whole folder)."""
    pyproject = tomllib.loads((app_dir / "pyproject.toml").read_text())
    include = pyproject.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if not include:
        return None
    roots = [pattern.lstrip("/").split("/", 1)[0] for pattern in include]
    return None if any(not root or GLOB.search(root) for root in roots) else sorted(set(roots))


def candidate_files(app_dir: Path) -> dict[str, Path]:
    """What Flower's builder is given: every file under the include roots (symlinks
    skipped, as Flower's own walk does) and the top files; the whole folder when the
    roots are unknown."""
    from flwr.cli.utils import collect_files  # lazy: flwr's CLI, 0.8 s of CPU

    roots = include_roots(app_dir)
    if roots is None:
        return collect_files(app_dir)
    files = {name: app_dir / name for name in TOP_FILES if (app_dir / name).is_file()}
    for root in roots:
        path = app_dir / root
        if path.is_dir() and not path.is_symlink():
            files.update({f"{root}/{rel}": where
                          for rel, where in collect_files(path).items()})
        elif path.is_file() and not path.is_symlink():
            files[root] = path
    return files


def app_files(app_dir: Path) -> dict[str, bytes]:
    """The files of the FAB that ``flwr run app_dir`` would ship (Flower's manifest
    left out), built by Flower's own rules."""
    from flwr.cli.build import build_fab_from_files  # lazy: flwr's CLI, 0.8 s of CPU

    app_dir = Path(app_dir).expanduser().resolve()
    fab, _ = build_fab_from_files(candidate_files(app_dir))
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        return {n: archive.read(n) for n in archive.namelist() if n != MANIFEST}


def write_app(files: dict[str, bytes], dest: Path) -> Path:
    """Write ``files`` under ``dest`` (a new folder); returns ``dest``."""
    for name, data in files.items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


def stage_app(app_dir: Path, dest: Path) -> Path:
    """The app of ``app_dir`` staged in ``dest`` for ``flwr run dest``."""
    return write_app(app_files(app_dir), dest)
