"""A grid's run folders outside git, and the manifest that finds them again
(docs/RESULTS.md, "Where the runs are").

Git holds, per grid folder ``results/<grid>/``, its summary table (``runs.csv``:
:mod:`.run_table`), the tables made from it, and ``manifest.json``, which names where the
run folders are and the sha256 that proves a copy of them is theirs:

- ``commit`` and ``path``: the run folders are ``path`` in that commit of this
  repository, the last that changed them (the grids whose folders git held until they
  left the tree on 2026-12-07: :func:`git_source`);
- ``archive``: they are the gzipped tar ``archive`` that the grid runner wrote beside the
  grid's folder in its results directory (default ``~/fedefc-results/<grid>.tar.gz``:
  :func:`write_archive`), to be kept wherever the team keeps data.

``sha256`` is that of the folder's files as one deterministic, uncompressed tar
(:func:`write_tar`: sorted paths, no times, owners or modes), so any copy is checked the
same way whatever brought it and whichever zlib compressed it; ``files`` and ``bytes``
count them. ``fedefc results fetch GRID`` (:func:`fetch`) brings them back byte for
byte into a new folder, ``~/fedefc-results/<grid>/`` by default, where ``fedefc grid
report`` draws the plots again.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO

from .errors import UsageError
from .run_configs import APP_DIR

MANIFEST = "manifest.json"
TREE_RESULTS = APP_DIR / "results"  # the tables git holds
RESULTS_HOME = Path.home() / "fedefc-results"  # the run folders, outside the clone
TABLE_FILES = frozenset({"runs.csv", MANIFEST, "table.md", "table.csv", "paired.md"})
LEFT_OUT = frozenset({"checkpoint.pt"})  # resume state of a run: none once it finished


class _Hashing:
    """A write-only file that hashes what passes through it to ``sink`` (if any)."""

    def __init__(self, sink: BinaryIO | None = None):
        self.sha = hashlib.sha256()
        self.sink = sink

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)


def archived_files(folder: Path) -> list[str]:
    """The files of a grid's folder that its archive holds, as sorted relative paths:
    all but the tables git keeps at its top (:data:`TABLE_FILES`) and checkpoints."""
    names = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if path.is_file() and path.name not in LEFT_OUT and \
                not (len(rel.parts) == 1 and rel.name in TABLE_FILES):
            names.append(rel.as_posix())
    return sorted(names)


def write_tar(folder: Path, names: list[str], out: BinaryIO | None = None
              ) -> tuple[str, int]:
    """The files ``names`` of ``folder`` as a tar that depends on their paths and bytes
    only (sorted, mtime 0, mode 0644, owner root), written to ``out`` if given; return
    its sha256 and the files' bytes."""
    sink = _Hashing(out)
    total = 0
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            path = folder / name
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
            total += info.size
    return sink.sha.hexdigest(), total


def folder_record(folder: Path) -> dict[str, int | str]:
    """sha256, files and bytes of every file under ``folder`` (:func:`write_tar`)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    sha, size = write_tar(folder, names)
    return {"sha256": sha, "files": len(names), "bytes": size}


def write_archive(folder: Path, archive: Path) -> dict[str, int | str]:
    """``archive``: the gzipped :func:`write_tar` of :func:`archived_files`; its record."""
    names = archived_files(folder)
    partial = archive.with_name(f".{archive.name}.partial")
    with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                   mtime=0) as gz:
        sha, size = write_tar(folder, names, gz)
    partial.replace(archive)
    return {"sha256": sha, "files": len(names), "bytes": size}


def _git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS``'s output; UsageError naming the command and git's words."""
    if shutil.which("git") is None:
        raise UsageError("git not found: install it to reach the runs git history holds")
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode:
        raise UsageError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout


def git_source(folder: Path) -> tuple[Path, str, str] | None:
    """(repository, commit, path) when git holds every run file of ``folder`` as it is
    on disk (the tables at its top aside): the last commit that changed it holds them.
    None when a run file is untracked or changed, or no repository holds the folder."""
    try:
        repo = Path(_git(folder, "rev-parse", "--show-toplevel").strip())
    except UsageError:
        return None
    path = folder.resolve().relative_to(repo.resolve()).as_posix()
    if not _git(repo, "ls-files", "--", f"{path}/*summary.json"):
        return None
    for line in _git(repo, "status", "--porcelain", "-uall", "--", path).splitlines():
        rel = Path(line[3:].strip('"'))  # a changed file: only the tables at the top may be
        if rel.parent.as_posix() != path or rel.name not in TABLE_FILES:
            return None
    return repo, _git(repo, "log", "-1", "--format=%H", "--", path).strip(), path


def _extract_git(repo: Path, commit: str, path: str, into: Path) -> None:
    """The folder ``path`` of ``commit`` into ``into``, fetching the commit first where
    this clone lacks it (a shallow or partial clone)."""
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").strip() == "true"
    if subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode:
        _git(repo, "fetch", "--no-tags", *(["--depth=1"] if shallow else []), "origin",
             commit)
    stream = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar",
                               f"{commit}:{path}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=stream.stdout, mode="r|") as tar:
            tar.extractall(into, filter="data")
        failure = None
    except tarfile.TarError as err:
        failure = str(err)
    said = stream.stderr.read().decode(errors="replace").strip()
    if stream.wait() or failure:
        raise UsageError(f"git archive {commit}:{path} failed in {repo}: {said or failure}")


def git_record(repo: Path, commit: str, path: str) -> dict[str, int | str]:
    """:func:`folder_record` of the folder ``path`` as ``commit`` holds it."""
    with tempfile.TemporaryDirectory() as tmp:
        _extract_git(repo, commit, path, Path(tmp) / "runs")
        return folder_record(Path(tmp) / "runs")


def manifests(key: str, tables: Path = TREE_RESULTS) -> list[dict]:
    """The manifests of grid ``key`` (``clean-labels/cross-silo``), or of every grid under
    a folder (``clean-labels``), in ``tables``."""
    found = [json.loads(p.read_text()) for p in sorted((tables / key).rglob(MANIFEST))]
    if not found:
        known = sorted(str(p.parent.relative_to(tables)) for p in tables.rglob(MANIFEST))
        raise UsageError(f"no grid {key!r} in {tables} (grids: {', '.join(known)}); name "
                         "one of those, or a folder above some of them")
    return found


def write_manifest(tables: Path, grid: str, runs: int, record: dict,
                   source: dict[str, str]) -> Path:
    """``tables/manifest.json``: the grid, its runs, where they are, and their record."""
    tables.mkdir(parents=True, exist_ok=True)
    path = tables / MANIFEST
    path.write_text(json.dumps({"grid": grid, "runs": runs, **source, **record},
                               indent=2) + "\n")
    return path


def fetch(entry: dict, dest: Path, archive: Path | None = None,
          repo: Path = APP_DIR) -> dict:
    """Bring the run folders a manifest ``entry`` names into ``dest`` (a new folder),
    checked against its sha256 first: nothing lands in ``dest`` unless every byte
    matches. ``archive``: where the grid's archive is, for an ``archive`` entry (default:
    beside ``dest``, under the name the manifest gives)."""
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} is not empty: fetch into a new folder (--to elsewhere), "
                         "or move that one away")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        into = Path(tmp) / "runs"
        if "commit" in entry:
            _extract_git(repo, entry["commit"], entry["path"], into)
        else:
            archive = archive or dest.parent / entry["archive"]
            if not archive.is_file():
                raise UsageError(f"grid {entry['grid']}: its archive {archive} is not there; "
                                 "give its path with --archive FILE")
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(into, filter="data")
        got = folder_record(into)
        want = {k: entry[k] for k in ("sha256", "files", "bytes")}
        if got != want:
            raise UsageError(f"grid {entry['grid']}: what was fetched ({got}) is not what the "
                             f"manifest records ({want}); nothing was written to {dest}")
        if dest.exists():
            dest.rmdir()
        shutil.move(into, dest)
    return got


def tables_dir(results_dir: Path) -> Path:
    """Where the tables of the grids run into ``results_dir`` go: the same place under
    this checkout's ``results/`` for a results directory under ``~/fedefc-results``;
    beside the runs for any other (a fetched copy inside ``results/`` included)."""
    try:
        return TREE_RESULTS / results_dir.relative_to(RESULTS_HOME)
    except ValueError:
        return results_dir


def grid_key(tables: Path) -> str:
    """A grid's name in manifests: its tables' folder under ``results/``, or the folder's
    name elsewhere."""
    try:
        return tables.relative_to(TREE_RESULTS).as_posix()
    except ValueError:
        return tables.name
