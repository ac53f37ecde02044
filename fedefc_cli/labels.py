"""``fedefc labels``: a site's data steward checks labels in the browser (docs/OWN-DATA.md,
"Checking labels in the browser").

    fedefc labels DATA.npz [--per-class 10] [--seed 0] [--port 8765]
    fedefc labels DATA.npz --suspects RUN/model.pt [--top 100]

- Samples (:func:`draw`): ``--per-class`` N of each observed class (all of a class with
  fewer), among the samples DATA does not yet mark ``verified``, drawn without
  replacement by a generator seeded by ``--seed``, and shown in a seeded order that
  mixes the classes. Or, with ``--suspects MODEL``, the ``--top`` N samples whose label
  is most likely wrong under the run's delivered model (:mod:`.suspects`), among those
  neither verified nor reviewed, most suspect first: a check to fix labels, whose
  answers mark ``reviewed``, never ``verified`` (a ranked sample is no random one, and
  the guard's reading of the verified samples must stay unbiased).
- The page (``labels_page.html``: inline style and script, no other file, nothing from
  outside the machine) is served on 127.0.0.1 only, under a random token that the
  command prints, so that another user of the machine cannot read it: per sample the
  image (or the feature row), its file (DATA's ``sources``, which ``fedefc data``
  writes), the observed label, and the steward's answer, "correct", the right class, or
  "skip" (unsure). Class names come from ``--class-map``, else DATA's ``class_names``,
  else the ``classes.json`` beside DATA; a map that contradicts DATA's own names is
  refused. The classes are listed in the numbers' order where every name is a number,
  and the number keys are what the screen shows (:func:`class_keys`). A correction to a
  class other than the observed one, or undoing one, is confirmed on the page first.
- Every change reaches every open tab at once (a long poll, ``api/changes``); an answer
  given for a sample whose answer another tab changed meanwhile is refused (409), and the
  tab then shows the other's answer; a tab learns that another wrote the file.
- Progress (:class:`Progress`): every answer is saved at once in an owner-only file next
  to DATA (``DATA.labels-progress.json``), so a closed tab or a stopped command loses
  nothing: the same command continues where it stopped, at the same address (the token,
  and the port where ``--port 0`` gave any, are kept in the file); an address of
  another check is answered with what happened (:data:`STALE`). The file holds DATA's
  SHA-256; a DATA that changed meanwhile is refused. It is deleted once DATA is
  written; a new check then says how many samples DATA marks verified already.
- Finish (:func:`write_checked`): a copy of DATA first (``NAME.before-labels-TIME.npz``,
  owner-only, checked against the hash), then DATA rewritten atomically (a temporary
  file renamed over it), owner-only unless ``--readable-by-others``: every array as it
  was, ``verified`` True for the samples answered "correct" or with a class (besides
  those it marked before), and the corrected labels. Skipped and unanswered samples stay
  unverified. With ``validation-labels = "verified"`` a node holding DATA then keeps the
  checked samples as its validation share (docs/FEDEFC.md §3.7).

Bad input raises :class:`LabelsError` (exit 2) naming the value and the fix, before the
page is served; DATA is never written before its backup is complete.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import hmac
import io
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import zipfile
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import numpy as np
from PIL import Image  # Pillow comes with torchvision

from common.data_files import DatasetError, Samples, read_samples
from common.private_files import FILE_MODE
from common.results import atomic_write_bytes, atomic_write_json
from common.seeds import derive_seed

from .errors import UsageError
from .prepare_data import number_value, read_class_map
from .suspects import rank_site

HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_PER_CLASS = 10
DEFAULT_TOP = 100
MARKS = {"random": "verified", "suspects": "reviewed"}  # what a check's answers mark
PROGRESS_SUFFIX = ".labels-progress.json"
PROGRESS_FORMAT = 1
PAGE = Path(__file__).with_name("labels_page.html")
VERDICTS = ("correct", "corrected", "skipped")
MAX_BODY = 64 * 1024  # an answer is a few dozen bytes
POLL_SECONDS = 25  # a tab's long poll is answered at a change, or after this unchanged
# after the write, the command serves on until every tab that polled in the last
# SEEN_SECONDS was told, at most LINGER_SECONDS (a tab whose page is slow to poll again)
SEEN_SECONDS, LINGER_SECONDS = 60, 10
TAB = re.compile(r"[A-Za-z0-9]{1,40}")
# what an address of no check served now is answered with (a wrong token, or a check that
# is over): what may have happened, and nothing of the data
STALE = ("This address is not the check that fedefc labels serves now. A check keeps its "
         "address when the command is started again; a new check gets a new one: after "
         "the check before was written into the file (its progress file is then deleted), "
         "or after its progress file was deleted to start over. Open the address the "
         "command printed in its terminal.")


class LabelsError(UsageError):
    """DATA, its class map, its progress file or a flag of ``fedefc labels`` is unusable;
    the message names it and the fix."""


# -- the site's data ---------------------------------------------------------------------
@dataclass(frozen=True)
class SiteData:
    """DATA as read by the run's own reader, its class names, its SHA-256, and each row's
    file where DATA names them (``sources``)."""

    path: Path
    samples: Samples
    classes: list[str]
    sha256: str
    sources: list[str] | None = None
    reviewed: np.ndarray | None = None

    def marked(self, mark: str) -> np.ndarray:
        """DATA's ``verified`` or ``reviewed`` mask (all False where it has none)."""
        found = self.samples.verified if mark == "verified" else self.reviewed
        return np.zeros(len(self.samples.y), dtype=bool) if found is None else found

    @property
    def kind(self) -> str:
        return "images" if self.samples.x.ndim == 4 else "features"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def class_names(labels: np.ndarray, mapping: dict[str, int] | None, num_classes: int,
                where: str) -> list[str]:
    """The name of every class index: the class map's names, else the indices 0..K-1
    with K the larger of ``num_classes`` and the largest label + 1."""
    top = int(labels.max())
    if mapping is None:
        return [str(i) for i in range(max(num_classes, top + 1))]
    if num_classes and num_classes != len(mapping):
        raise LabelsError(f"--num-classes={num_classes} but the class map {where} names "
                          f"{len(mapping)} classes; leave --num-classes out with a class map")
    if top >= len(mapping):
        raise LabelsError(f"DATA holds label {top}, but the class map {where} names "
                          f"{len(mapping)} classes (0..{len(mapping) - 1}); give the class "
                          "map DATA was prepared with (--class-map FILE)")
    return [name for name, _ in sorted(mapping.items(), key=lambda kv: kv[1])]


def text_array(data: Path, key: str, n: int | None) -> list[str] | None:
    """DATA's optional array ``key`` of text (``n`` entries when given), as written by
    ``fedefc data``; None where DATA has none."""
    try:
        with np.load(data, allow_pickle=False) as npz:
            if key not in npz.files:
                return None
            values = npz[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        values = err
    if not isinstance(values, np.ndarray) or values.dtype.kind != "U" or values.ndim != 1 \
            or (n is not None and len(values) != n):
        found = (f"shape {values.shape}, dtype {values.dtype}" if isinstance(values, np.ndarray)
                 else f"unreadable: {values}")
        raise LabelsError(f"DATA={str(data)!r}: its array {key!r} is not a list of "
                          f"{n if n is not None else 'the'} names ({found}); write it as "
                          f"numpy.array([...], dtype=str), or leave it out")
    return values.tolist()


def mask_array(data: Path, key: str, n: int) -> np.ndarray | None:
    """DATA's optional boolean array ``key`` of ``n`` entries; None where it has none."""
    with np.load(data, allow_pickle=False) as npz:
        mask = npz[key] if key in npz.files else None
    if mask is not None and (mask.dtype != bool or mask.shape != (n,)):
        raise LabelsError(f"DATA={str(data)!r}: its array {key!r} has shape {mask.shape} and "
                          f"dtype {mask.dtype}; it must be a boolean array of {n} entries, "
                          "True where the label was reviewed (or leave it out)")
    return mask


def load_site(data: Path, class_map: Path | None = None, num_classes: int = 0) -> SiteData:
    """DATA read and checked as a node reads it (``common/data_files.py``), with its class
    names: from ``class_map``, else DATA's own ``class_names``, else ``classes.json``
    beside DATA when there is one; a map that names the classes otherwise than DATA does
    is refused."""
    where = f"DATA={str(data)!r}"
    if not data.exists():
        raise LabelsError(f"{where} does not exist; give the node's .npz: the data.npz that "
                          "fedefc data wrote, or an .npz of images or features and labels "
                          "(docs/OWN-DATA.md, \"Formats\")")
    if data.is_dir():
        raise LabelsError(f"{where} is a folder: a folder of images cannot mark checked "
                          "samples; turn it into an .npz first (fedefc data SOURCE OUT "
                          "--size N) and check OUT/data.npz")
    try:
        samples = read_samples(str(data), where)
    except DatasetError as err:
        raise LabelsError(str(err)) from None
    own = text_array(data, "class_names", None)
    map_path = class_map or data.with_name("classes.json")
    mapping = read_class_map(map_path) if class_map or map_path.is_file() else None
    if own is not None and mapping is not None and \
            [n for n, _ in sorted(mapping.items(), key=lambda kv: kv[1])] != own:
        raise LabelsError(f"the class map {str(map_path)!r} names the classes "
                          f"{', '.join(sorted(mapping, key=mapping.get))}, but DATA's own "
                          f"class_names are {', '.join(own)}: its labels were made with "
                          "those; leave --class-map out (or move the wrong classes.json away)")
    if own is not None:
        mapping = {name: i for i, name in enumerate(own)}
        map_path = data
    names = class_names(samples.y, mapping, num_classes, repr(str(map_path)))
    return SiteData(data, samples, names, file_sha256(data),
                    text_array(data, "sources", len(samples.y)),
                    mask_array(data, "reviewed", len(samples.y)))


def screen_order(classes: list[str]) -> list[int]:
    """The class indices in the order the page lists them: by the numbers the names say
    where every name is a number (digits or words: "one" before "two"), else by index."""
    values = [number_value(name) for name in classes]
    if None in values or len(set(values)) < len(values):
        return list(range(len(classes)))
    return sorted(range(len(classes)), key=values.__getitem__)


def class_keys(classes: list[str]) -> list[str | None]:
    """Each class index's number key on the page: the number its name says where every
    name is a different number from 0 to 9 ("one" is 1); else, with at most 10 classes,
    its position in :func:`screen_order` (0 for the first shown); else none."""
    values = [number_value(name) for name in classes]
    if None not in values and len(set(values)) == len(values) and max(values) <= 9:
        return [str(v) for v in values]
    keys: list[str | None] = [None] * len(classes)
    if len(classes) <= 10:
        for position, k in enumerate(screen_order(classes)):
            keys[k] = str(position)
    return keys


def draw(labels: np.ndarray, verified: np.ndarray | None, per_class: int,
         seed: int) -> np.ndarray:
    """The rows to check, in the order shown: ``per_class`` rows of each observed class
    (all of a class with fewer) among the rows not yet ``verified``, drawn without
    replacement; then the drawn rows in a random order. One generator, seeded by
    ``seed``, draws the classes in increasing order, then the order."""
    rng = np.random.default_rng(derive_seed(seed, "labels"))
    free = np.ones(len(labels), dtype=bool) if verified is None else ~verified
    picked = [rng.permutation(np.flatnonzero((labels == c) & free))[:per_class]
              for c in np.unique(labels)]
    rows = np.concatenate(picked)
    return rows[rng.permutation(len(rows))]


# -- progress ------------------------------------------------------------------------------
def progress_path(data: Path) -> Path:
    return data.with_name(data.name + PROGRESS_SUFFIX)


@dataclass
class Progress:
    """A check in progress, as saved next to DATA after every answer.

    ``rows``: the rows of DATA shown, in order; ``answers``: row -> {"verdict":
    "correct" | "corrected" | "skipped", "label": the checked class (None when
    skipped)}; ``written_sha256``: the hash of the rewritten DATA, set just before it
    replaces DATA (a command stopped between the two finds its check done); ``token``
    and ``port``: the page's address, the same when the command is started again;
    ``ranking``: "random" (:func:`draw`) or "suspects" (``model``: the MODEL ranked by,
    ``observed_p``: each row's (Q p(x))[ỹ], :mod:`.suspects`)."""

    data: str
    sha256: str
    per_class: int
    seed: int
    rows: list[int]
    answers: dict[int, dict] = field(default_factory=dict)
    written_sha256: str = ""
    format: int = PROGRESS_FORMAT
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    port: int = 0
    ranking: str = "random"
    model: str = ""
    observed_p: list[float] = field(default_factory=list)

    @property
    def mark(self) -> str:
        return MARKS[self.ranking]

    def save(self, path: Path) -> None:
        atomic_write_json(path, {**asdict(self),
                                 "answers": {str(r): a for r, a in self.answers.items()}})

    @classmethod
    def read(cls, path: Path) -> Progress:
        fix = (f"delete {str(path)!r} to start the check over (its answers are lost), or put "
               "back the file fedefc labels wrote")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format") != PROGRESS_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, not {PROGRESS_FORMAT}")
            if raw.get("ranking", "random") not in MARKS:
                raise ValueError(f"ranking {raw.get('ranking')!r}")
            answers = {int(r): a for r, a in raw.pop("answers").items()}
            progress = cls(**raw, answers=answers)
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError,
                AttributeError) as err:
            raise LabelsError(f"the progress file {str(path)!r} cannot be read ({err}); "
                              f"{fix}") from None
        if any(a.get("verdict") not in VERDICTS for a in progress.answers.values()) or \
                not set(progress.answers) <= set(progress.rows):
            raise LabelsError(f"the progress file {str(path)!r} holds answers it cannot "
                              f"hold; {fix}")
        return progress

    def counts(self) -> dict[str, int]:
        """How many rows were answered each way, and how many are left."""
        found = {v: 0 for v in VERDICTS}
        for answer in self.answers.values():
            found[answer["verdict"]] += 1
        return {**found, "checked": found["correct"] + found["corrected"],
                "answered": len(self.answers), "left": len(self.rows) - len(self.answers),
                "drawn": len(self.rows)}


def open_progress(site: SiteData, per_class: int | None, seed: int | None,
                  suspects: Path | None = None, top: int | None = None
                  ) -> tuple[Progress, str]:
    """(the check of ``site``, what it is: "continued", "new", or "written": new, the one
    saved before having been written into DATA). The saved progress when there is one for
    this DATA, else a new check: a random draw, or with ``suspects`` (a run's model.pt)
    the ``top`` most suspect samples; nothing is written (:func:`keep` saves it)."""
    if suspects is None and top is not None:
        raise LabelsError(f"--top={top} counts the suspects: give --suspects MODEL with it, or "
                          "leave it out (a random draw takes --per-class)")
    if suspects is not None and (per_class is not None or seed is not None):
        raise LabelsError("--suspects ranks the samples and draws none: leave --per-class and "
                          "--seed out (how many suspects: --top)")
    path = progress_path(site.path)
    kind = "new"
    if path.exists():
        saved = Progress.read(path)
        if saved.written_sha256 and saved.written_sha256 == site.sha256:
            kind = "written"  # its check was written; the command stopped before deleting it
        elif saved.sha256 != site.sha256:
            raise LabelsError(
                f"DATA={str(site.path)!r} changed since the check saved in {str(path)!r} "
                f"began ({len(saved.answers)} answers); put the data it was started on back "
                f"to continue, or delete {str(path)!r} to start over on the new data")
        else:
            check_flags(saved, path, per_class, seed, suspects, top)
            return saved, "continued"
    if suspects is not None:
        return suspects_check(site, suspects, DEFAULT_TOP if top is None else top), kind
    per_class = DEFAULT_PER_CLASS if per_class is None else per_class
    seed = 0 if seed is None else seed
    rows = draw(site.samples.y, site.samples.verified, per_class, seed)
    if not len(rows):
        raise LabelsError(f"DATA={str(site.path)!r} marks every sample verified already: "
                          "there is nothing left to check")
    return Progress(str(site.path), site.sha256, per_class, seed, [int(r) for r in rows]), kind


def check_flags(saved: Progress, path: Path, per_class: int | None, seed: int | None,
                suspects: Path | None, top: int | None) -> None:
    """Refuse flags that ask for another check than the one saved in ``path``."""
    kind = {"random": "a random draw", "suspects": "a check of the suspects"}[saved.ranking]
    asked = "suspects" if suspects is not None or top is not None else \
        "random" if per_class is not None or seed is not None else saved.ranking
    if asked != saved.ranking:
        flags = "--suspects and --top" if asked == "suspects" else "--per-class and --seed"
        raise LabelsError(f"the check saved in {str(path)!r} is {kind}: finish it first (or "
                          f"delete {str(path)!r} to start over), then start the other; leave "
                          f"{flags} out to continue it")
    for flag, given, kept in (("--per-class", per_class, saved.per_class),
                              ("--seed", seed, saved.seed),
                              ("--top", top, len(saved.rows)),
                              ("--suspects", suspects and str(suspects), saved.model)):
        if given is not None and given != kept:
            raise LabelsError(
                f"{flag}={given}, but the check saved in {str(path)!r} was started "
                f"with {flag} {kept}; leave {flag} out (or give {kept}) to continue "
                f"it, or delete {str(path)!r} to start over")


def suspects_check(site: SiteData, model: Path, top: int) -> Progress:
    """A new check of the ``top`` samples most likely mislabelled under ``model``, among
    those DATA marks neither verified nor reviewed, most suspect first."""
    ranked = rank_site(site.path, model)
    free = ~site.marked("verified") & ~site.marked("reviewed")
    rows = [int(r) for r in ranked.order if free[r]][:top]
    if not rows:
        raise LabelsError(f"DATA={str(site.path)!r} marks every sample verified or reviewed "
                          "already: there is no suspect left to check")
    return Progress(str(site.path), site.sha256, 0, 0, rows, ranking="suspects",
                    model=str(model),
                    observed_p=[round(float(ranked.observed_p[r]), 4) for r in rows])


def keep(site: SiteData, progress: Progress) -> None:
    """Save ``progress`` at once, before the page is served, so that a folder where
    nothing can be written is found now, not at the first answer."""
    path = progress_path(site.path)
    try:
        progress.save(path)
    except OSError as err:
        raise LabelsError(f"the progress file {str(path)!r} cannot be written ({err}); "
                          "run fedefc labels as a user who may write in DATA's folder") from None


# -- finishing -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """What :func:`write_checked` wrote: DATA's path and mode, its backup, the counts of
    the answers, the corrections (row, observed, checked), and which mask the answers set
    ("verified" or "reviewed") with its totals before and after."""

    data: Path
    mode: int
    backup: Path
    counts: dict[str, int]
    corrected: list[tuple[int, int, int]]
    mark: str
    marked_before: int
    marked_after: int
    size: int


def backup_path(data: Path, stamp: str) -> Path:
    """``NAME.before-labels-STAMP.npz`` beside DATA; ``-2``, ``-3`` ... when taken (by a
    file, or by a link, even one that points nowhere)."""
    for n in range(1, 1000):
        candidate = data.with_name(f"{data.stem}.before-labels-{stamp}"
                                   f"{'' if n == 1 else f'-{n}'}{data.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise LabelsError(f"999 backups of DATA={str(data)!r} exist for {stamp}; move them away")


def copy_private(src: Path, dst: Path) -> None:
    """``src`` copied to ``dst`` (owner-only), via a temporary file that this call
    creates under a random name (``O_CREAT | O_EXCL``, which follows no link): a file or
    a link planted beside DATA is never written through."""
    fd, name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fout, open(src, "rb") as fin:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checked_arrays(data: Path, progress: Progress) -> tuple[dict[str, np.ndarray], bool]:
    """Every array of DATA, ``labels`` with the corrections in place and the check's
    mask (``verified``, or ``reviewed`` for the suspects) True where it was or where
    the answer checked the label; and whether DATA's arrays were compressed
    (``numpy.savez_compressed``)."""
    with zipfile.ZipFile(data) as zf:
        compressed = any(i.compress_type != zipfile.ZIP_STORED for i in zf.infolist())
    with np.load(data, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    labels = arrays["labels"]
    checked = {r: a["label"] for r, a in progress.answers.items() if a["verdict"] != "skipped"}
    rows = np.fromiter(checked, dtype=np.int64, count=len(checked))
    values = np.fromiter(checked.values(), dtype=np.int64, count=len(checked))
    new = labels.copy()
    new[rows] = values
    if not np.array_equal(new[rows], values):  # the stored dtype cannot hold a class
        new = labels.astype(np.int64)
        new[rows] = values
    marked = np.zeros(len(labels), dtype=bool)
    if progress.mark in arrays:
        marked |= arrays[progress.mark]
    marked[rows] = True
    return {**arrays, "labels": new, progress.mark: marked}, compressed


def write_checked(site: SiteData, progress: Progress, shared: bool = False,
                  stamp: str | None = None) -> Written:
    """Back DATA up, then write the checked answers into it (module docstring). Refused,
    with nothing written, when no label was checked or DATA changed since it was read."""
    counts = progress.counts()
    if not counts["checked"]:
        raise LabelsError(f"no label is checked yet ({counts['skipped']} skipped, "
                          f"{counts['left']} not answered): answer at least one sample "
                          "\"correct\" or with its right class before finishing")
    data = site.path
    if file_sha256(data) != site.sha256:
        raise LabelsError(f"DATA={str(data)!r} changed while the page was open; nothing was "
                          "written. The answers are saved: run fedefc labels again on the "
                          "data they were given for")
    stamp = stamp or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    backup = backup_path(data, stamp)
    copy_private(data, backup)
    if file_sha256(backup) != site.sha256:
        backup.unlink()
        raise LabelsError(f"the backup {str(backup)!r} does not read back as DATA; nothing "
                          "was written: check the disk, then run fedefc labels again")
    arrays, compressed = checked_arrays(data, progress)
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    progress.written_sha256 = hashlib.sha256(buf.getvalue()).hexdigest()
    progress.save(progress_path(data))
    mode = 0o644 if shared else FILE_MODE
    atomic_write_bytes(data, buf.getvalue(), mode=mode)
    progress_path(data).unlink()
    corrected = [(r, int(site.samples.y[r]), int(a["label"]))
                 for r, a in sorted(progress.answers.items()) if a["verdict"] == "corrected"]
    mark = progress.mark
    return Written(data, mode, backup, counts, corrected, mark,
                   int(site.marked(mark).sum()), int(arrays[mark].sum()), len(site.samples.y))


def row_text(site: SiteData, row: int) -> str:
    """``row 417`` or, where DATA names its files, ``row 417 (benign/a.png)``."""
    return f"row {row}" + (f" ({site.sources[row]})" if site.sources is not None else "")


def describe(written: Written, site: SiteData) -> str:
    """The lines ``fedefc labels`` prints once it wrote DATA."""
    classes = site.classes
    c = written.counts
    lines = [f"fedefc labels: wrote {written.data} (mode {written.mode:04o})",
             f"  {c['drawn']} samples drawn: {c['checked']} checked ({c['correct']} correct, "
             f"{c['corrected']} corrected), {c['skipped']} skipped, {c['left']} not answered; "
             f"skipped and unanswered ones stay un{written.mark}",
             f"  {written.mark}: {written.marked_after} of {written.size} samples "
             f"({written.marked_after - written.marked_before} new, "
             f"{written.marked_before} before)"]
    lines += [f"  {row_text(site, r)}: label {old} ({classes[old]}) -> {new} ({classes[new]})"
              for r, old, new in written.corrected]
    if written.mark == "reviewed":
        lines += [f"  the original, unchanged: {written.backup}",
                  "the corrected labels are DATA's labels now: the next run trains on them. "
                  "Reviewed samples are not verified: the suspects are no random sample, and "
                  "the guard reads only a random draw's verified samples (fedefc labels DATA, "
                  "without --suspects; docs/OWN-DATA.md, \"Which labels to check first\")"]
        return "\n".join(lines)
    if written.marked_after == written.size:
        lines.append("  WARNING: every sample is verified now, and a run with "
                     "validation-labels=verified trains on none of its verified samples: it "
                     "refuses this file; restore the backup and check fewer per class")
    lines += [f"  the original, unchanged: {written.backup}",
              "the run: --set validation-labels=verified (with accuracy-signal=held-out, "
              "which auto chooses where every client trains every round): a node holding "
              "this file keeps its verified samples as its validation share, out of the "
              "training of the model the guard reads; the delivered model (the twin) "
              "trains on them too (docs/OWN-DATA.md, \"Verified labels\")"]
    return "\n".join(lines)


# -- the page and its server ---------------------------------------------------------------
def png(pixels: np.ndarray) -> bytes:
    """uint8 (C, H, W) pixels as PNG: gray, RGB or RGBA for 1, 3 or 4 channels, else the
    channels side by side in gray."""
    c = pixels.shape[0]
    if c in (1, 3, 4):
        img = Image.fromarray(np.ascontiguousarray(pixels[0] if c == 1 else
                                                   pixels.transpose(1, 2, 0)))
    else:
        img = Image.fromarray(np.ascontiguousarray(np.concatenate(list(pixels), axis=1)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class Conflict(ValueError):
    """An answer given for a sample whose answer changed meanwhile (in another tab)."""


class Session:
    """The check the page drives: answers saved as they come, one at a time, and every
    change announced to the tabs waiting for one (:meth:`wait`)."""

    def __init__(self, site: SiteData, progress: Progress, shared: bool):
        self.site, self.progress, self.shared = site, progress, shared
        self.changed = threading.Condition()  # guards everything below and the answers
        self.epoch = secrets.token_hex(4)  # a new command's versions never match an old one's
        self.version = 0
        self.closing = False  # the command is ending: waiting tabs are answered at once
        self.written: Written | None = None
        self.tabs: dict[str, float] = {}  # tab -> when it last polled (time.monotonic)
        self.told: set[str] = set()  # the tabs that were told the file is written

    def changes(self) -> dict:
        """:meth:`_changes`, taking the lock."""
        with self.changed:
            return self._changes()

    def _changes(self) -> dict:
        """The answers in the order shown, the counts, the version, and the written file's
        report once it is written; the caller holds ``changed``."""
        p = self.progress
        return {"version": f"{self.epoch}.{self.version}",
                "answers": [p.answers.get(r) for r in p.rows], "counts": p.counts(),
                "written": None if self.written is None else describe(self.written, self.site)}

    def state(self) -> dict:
        """What the page shows: the classes, their order and keys on screen, every sample
        drawn with its observed label, its file and (feature vectors) its features, how
        many samples DATA marked verified before, and :meth:`_changes`."""
        site, p = self.site, self.progress
        samples = [{"row": r, "observed": int(site.samples.y[r])} for r in p.rows]
        for s, observed_p in zip(samples, p.observed_p):
            s["observed_p"] = observed_p
        for s in samples:
            if site.sources is not None:
                s["source"] = site.sources[s["row"]]
            if site.kind == "features":
                s["features"] = [float(f"{v:.6g}") for v in site.samples.x[s["row"]]]
        verified = site.samples.verified
        changes = self.changes()
        return {"data": str(site.path), "kind": site.kind, "classes": site.classes,
                "order": screen_order(site.classes), "keys": class_keys(site.classes),
                "numbers": all(number_value(c) is not None for c in site.classes),
                "samples": samples, "size": len(site.samples.y), "ranking": p.ranking,
                "mark": p.mark, "model": p.model,
                "verified_before": 0 if verified is None else int(verified.sum()), **changes}

    def wait(self, since: str, timeout: float, tab: str = "") -> dict:
        """:meth:`_changes` for the page ``tab`` as soon as the version differs from
        ``since`` (a change, or another command's) or the command ends (:meth:`close`),
        or after ``timeout`` seconds unchanged."""
        with self.changed:
            self._seen(tab)
            self.changed.wait_for(lambda: self.closing or
                                  f"{self.epoch}.{self.version}" != since, timeout)
            self._seen(tab)
            if self.written is not None and tab:
                self.told.add(tab)
                self.changed.notify_all()
            return self._changes()

    def _seen(self, tab: str) -> None:
        if tab:
            self.tabs[tab] = time.monotonic()

    def everyone_told(self, timeout: float) -> bool:
        """Whether every tab that polled in the last :data:`SEEN_SECONDS` has been told
        that the file is written, waiting for it at most ``timeout`` seconds."""
        def told() -> bool:
            now = time.monotonic()
            return all(tab in self.told for tab, seen in self.tabs.items()
                       if now - seen < SEEN_SECONDS)

        with self.changed:
            return self.changed.wait_for(told, timeout)

    def close(self) -> None:
        """Answer every waiting tab now: the command is ending."""
        with self.changed:
            self.closing = True
            self.changed.notify_all()

    def answer(self, body: dict) -> dict:
        """Record ``body`` = {"index": i, "verdict": "correct" | "skipped" | "class" |
        "clear", "label": k (with "class"), "was": the answer the tab shows (optional)}
        for the i-th sample shown, and save. With "was", an answer that differs from the
        sample's answer now (another tab changed it) raises :class:`Conflict`."""
        rows, k = self.progress.rows, len(self.site.classes)
        index, verdict, label = body.get("index"), body.get("verdict"), body.get("label")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(rows):
            raise ValueError(f"index {index!r} is not a sample of this check (0..{len(rows) - 1})")
        row = rows[index]
        observed = int(self.site.samples.y[row])
        if verdict == "correct":
            label = observed
        elif verdict == "class":
            if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < k:
                raise ValueError(f"label {label!r} is not a class (0..{k - 1})")
            verdict = "correct" if label == observed else "corrected"
        elif verdict == "skipped":
            label = None
        elif verdict != "clear":
            raise ValueError(f"verdict {verdict!r} is not correct, class, skipped or clear")
        with self.changed:
            if self.written is not None:
                raise ValueError("the check is finished and written; nothing more is saved")
            now = self.progress.answers.get(row)
            if "was" in body and body["was"] != now:
                raise Conflict(f"sample {index + 1} was answered meanwhile, in another tab "
                               f"({answer_text(now, self.site.classes)}); this page shows "
                               "that answer now: answer again if you meant otherwise")
            if verdict == "clear":
                self.progress.answers.pop(row, None)
            else:
                self.progress.answers[row] = {"verdict": verdict, "label": label}
            self.progress.save(progress_path(self.site.path))
            self.version += 1
            self.changed.notify_all()
            return {"answer": self.progress.answers.get(row), **self._changes()}

    def finish(self) -> Written:
        with self.changed:
            if self.written is None:
                self.written = write_checked(self.site, self.progress, self.shared)
                self.version += 1
                self.changed.notify_all()
            return self.written


def answer_text(answer: dict | None, classes: list[str]) -> str:
    if answer is None:
        return "its answer cleared"
    if answer["verdict"] == "corrected":
        return f"corrected to {classes[answer['label']]}"
    return answer["verdict"]


class LabelServer(ThreadingHTTPServer):
    """The page's server: 127.0.0.1 only, every path under ``/TOKEN/``. Closing it waits
    for every request in progress (``block_on_close``), so that the tabs waiting when
    the file is written learn it before the command exits."""

    daemon_threads = False

    def __init__(self, port: int, token: str):
        super().__init__((HOST, port), Handler)
        self.token = token
        self.session: Session | None = None  # set once the check is open

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_port}/{self.token}/"

    def end_when_told(self) -> None:
        """Once the file is written: stop serving when every open tab knows it."""
        self.session.everyone_told(LINGER_SECONDS)
        self.shutdown()


# The page may load and send nothing but its own server's: a stray reference to anything
# else is blocked by the browser, not only absent from the page.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self' data:; "
                               "style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                               "connect-src 'self'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class BadRequest(ValueError):
    """A request the page never sends (its body, its length, its type)."""


class Handler(BaseHTTPRequestHandler):
    """GET ``/TOKEN/`` (the page), ``api/state``, ``api/changes?since=VERSION`` (a long
    poll), ``image/I.png``; POST ``api/answer``, ``api/finish``. A wrong token gets 404
    with :data:`STALE`; a Host header other than this server's (a page elsewhere reaching
    127.0.0.1 through its own DNS name) 403; a body that is not a JSON object of at most
    64 KiB with a Content-Length 400, without reading it."""

    server: LabelServer
    timeout = 10  # seconds a connection may stay silent (a browser's spare one is closed)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # the terminal shows what the check did, not every request

    def _route(self) -> str | None:
        port = self.server.server_port
        if self.headers.get("Host") not in (f"{HOST}:{port}", f"localhost:{port}"):
            self._send(HTTPStatus.FORBIDDEN, b"wrong Host", "text/plain")
            return None
        prefix = f"/{self.server.token}/"
        path = self.path.split("?", 1)[0]
        if hmac.compare_digest(path.encode(), prefix[:-1].encode()):  # the address without /
            self.send_response(HTTPStatus.MOVED_PERMANENTLY)
            self.send_header("Location", prefix)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if not hmac.compare_digest(path[:len(prefix)].encode(), prefix.encode()):
            self._send(HTTPStatus.NOT_FOUND, STALE.encode(), "text/plain; charset=utf-8")
            return None
        return path[len(prefix):]

    def _send(self, status: HTTPStatus, body: bytes, ctype: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in SECURITY_HEADERS.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the tab went away (reloaded, closed) while its poll waited

    def _json(self, obj: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _body(self) -> dict:
        """The request's JSON object; :class:`BadRequest` before reading anything when
        the type or the length is not one the page sends."""
        length = self.headers.get("Content-Length", "0")
        if self.headers.get_content_type() != "application/json" or \
                not re.fullmatch(r"[0-9]{1,9}", length) or int(length) > MAX_BODY:
            raise BadRequest(f"send a JSON object of at most {MAX_BODY // 1024} KiB, as "
                             "application/json with its Content-Length (got "
                             f"{self.headers.get_content_type()}, length {length[:20]!r})")
        try:
            body = json.loads(self.rfile.read(int(length)) or b"{}")
        except ValueError as err:
            raise BadRequest(f"the body is not JSON ({err})") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the body is JSON but not an object ({type(body).__name__}); "
                             'send e.g. {"index": 0, "verdict": "correct"}')
        return body

    def do_GET(self):  # noqa: N802 - http.server's name
        route = self._route()
        session = self.server.session
        if route is None or session is None:
            return
        if route == "":
            self._send(HTTPStatus.OK, PAGE.read_bytes(), "text/html; charset=utf-8")
        elif route == "api/state":
            self._json(session.state())
        elif route == "api/changes":
            query = parse_qs(self.path.split("?", 1)[1] if "?" in self.path else "")
            tab = query.get("tab", [""])[0]
            self._json(session.wait(query.get("since", [""])[0], POLL_SECONDS,
                                    tab if TAB.fullmatch(tab) else ""))
        elif route.startswith("image/") and route.endswith(".png") and \
                session.site.kind == "images":
            index = route[len("image/"):-len(".png")]
            rows = session.progress.rows
            if not index.isdigit() or int(index) >= len(rows):
                self._send(HTTPStatus.NOT_FOUND, b"no such sample", "text/plain")
                return
            self._send(HTTPStatus.OK, png(session.site.samples.x[rows[int(index)]]),
                       "image/png")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

    def do_POST(self):  # noqa: N802 - http.server's name
        route = self._route()
        session = self.server.session
        if route is None or session is None:
            return
        try:
            body = self._body()
            if route == "api/answer":
                self._json(session.answer(body))
            elif route == "api/finish":
                written = session.finish()
                self._json({"written": describe(written, session.site),
                            "backup": str(written.backup), "counts": written.counts})
                threading.Thread(target=self.server.end_when_told, daemon=True).start()
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        except Conflict as err:
            self._json({"error": str(err), **session.changes()}, HTTPStatus.CONFLICT)
        except (ValueError, LabelsError, OSError) as err:
            self._json({"error": str(err)}, HTTPStatus.BAD_REQUEST)


def bind(port: int, token: str, saved_port: int = 0) -> LabelServer:
    """The server on 127.0.0.1:``port`` (0: the check's ``saved_port`` where it is free,
    so that its address stays the same, else any free port), or an error naming the
    port."""
    if port == 0 and saved_port:
        with contextlib.suppress(OSError):
            return LabelServer(saved_port, token)
    try:
        return LabelServer(port, token)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise LabelsError(f"--port={port}: the port is in use on {HOST} (another fedefc "
                              f"labels, or another program); give another, e.g. --port "
                              f"{port + 1}, or --port 0 for any free port") from None
        raise LabelsError(f"--port={port}: cannot serve on {HOST}:{port} ({err}); give a "
                          "port from 1024 to 65535, or --port 0 for any free port") from None


# -- the command ---------------------------------------------------------------------------
def opening(site: SiteData, progress: Progress, kind: str) -> str:
    """The first line ``fedefc labels`` prints: the check, and, for a new one, how many
    samples DATA marks verified already (a check written before: not silently another)."""
    c, n = progress.counts(), len(site.samples.y)
    how = (f"{progress.per_class} per class, seed {progress.seed}"
           if progress.ranking == "random" else
           f"the most suspect first, under {progress.model}; answers mark them reviewed, "
           "not verified")
    what = {"continued": f"continuing: {c['answered']} answered, {c['left']} left",
            "new": "a new check",
            "written": "a new check (the one saved before was written into DATA already)"}
    line = (f"fedefc labels: {c['drawn']} samples of {n} in DATA={str(site.path)!r} "
            f"({how}, {len(site.classes)} classes); {what[kind]}")
    verified = int(site.marked("verified").sum())
    if kind != "continued" and verified and progress.ranking == "random":
        line += (f"\n  DATA marks {verified} of {n} samples verified already (checks written "
                 f"before; their originals are the {site.path.stem}.before-labels-*"
                 f"{site.path.suffix} beside it): this check draws {c['drawn']} more among "
                 "the others; Ctrl-C if you meant only the check already written")
    return line


def hold(data: Path):
    """DATA opened and locked (``flock``) for as long as the command serves its check:
    a second ``fedefc labels`` on the same DATA is refused, never two servers saving
    one progress file."""
    handle = open(data, "rb")  # noqa: SIM115 - held until the command ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise LabelsError(f"another fedefc labels serves the check of DATA={str(data)!r} now; "
                          "use the address it printed, or stop it (Ctrl-C in its terminal) "
                          "first") from None
    return handle


def cmd_labels(args: argparse.Namespace) -> int:
    """``fedefc labels DATA``: serves the page until the check is finished (exit 0) or the
    command is stopped with Ctrl-C (exit 130, every answer kept)."""
    data = Path(args.data).expanduser().resolve()
    site = load_site(data, Path(args.class_map).expanduser().resolve()
                     if args.class_map else None, args.num_classes)
    with hold(data):
        progress, kind = open_progress(
            site, args.per_class, args.seed,
            Path(args.suspects).expanduser().resolve() if args.suspects else None, args.top)
        server = bind(args.port, progress.token, progress.port)
        try:
            progress.port = server.server_port
            keep(site, progress)
            server.session = Session(site, progress, args.readable_by_others)
            print(opening(site, progress, kind), flush=True)
            print(f"  every answer is saved in {progress_path(data)} (deleted once DATA is "
                  "written)", flush=True)
            if data.stat().st_mode & 0o044 and not args.readable_by_others:
                print("  note: DATA is readable by others; the file written at the end is "
                      "owner-only (0600) unless --readable-by-others", flush=True)
            print(f"open this address in a browser on this machine (nothing leaves it):\n"
                  f"  {server.url}\n  from another computer: ssh -L {server.server_port}:"
                  f"{HOST}:{server.server_port} THIS-MACHINE, then open the same address "
                  "there\nCtrl-C stops; run the same command again to continue, at the same "
                  "address", flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                left = progress.counts()
                print(f"\nfedefc labels: stopped; {left['answered']} answers saved in "
                      f"{progress_path(data)}, {left['left']} left: run the same command "
                      "again to continue (the page reconnects by itself)", flush=True)
                return 130
        finally:
            if server.session is not None:
                server.session.close()
            server.server_close()  # after the answers to the tabs that were waiting
    print(describe(server.session.written, site), flush=True)
    return 0


def whole_number(low: int, high: int, fix: str):
    """An argparse type: a whole number from ``low`` to ``high``, or an error naming the
    value and ``fix``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} {fix}")
        return value
    return parse


def loopback(text: str) -> str:
    """``--host``: 127.0.0.1 (or localhost) only (argparse type)."""
    if text not in (HOST, "localhost"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: fedefc labels serves on {HOST} only, since the page shows the "
            "site's private images and labels to whoever reaches it; to check from another "
            f"computer, forward the port over SSH (ssh -L {DEFAULT_PORT}:{HOST}:"
            f"{DEFAULT_PORT} THIS-MACHINE) and open the printed address there")
    return HOST


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``labels`` command in ``fedefc``'s argparse tree."""
    cmd = sub.add_parser("labels", help="check a sample of a node's labels in the browser "
                                        "and mark them verified (docs/OWN-DATA.md)")
    cmd.add_argument("data", metavar="DATA",
                     help="the node's .npz (e.g. the data.npz fedefc data wrote)")
    per_class = whole_number(1, 1_000_000, "is not a whole number >= 1; give how many "
                             "samples of each class to check, e.g. 10")
    port = whole_number(0, 65535, f"is not a port; give a number from 1024 to 65535 "
                        f"(default {DEFAULT_PORT}), or 0 for any free port")
    cmd.add_argument("--per-class", type=per_class, default=None, metavar="N",
                     help=f"samples of each observed class to check (default "
                          f"{DEFAULT_PER_CLASS}; a check in progress keeps its own)")
    cmd.add_argument("--seed", type=int, default=None,
                     help="seed of the draw (default 0; a check in progress keeps its own)")
    cmd.add_argument("--suspects", default=None, metavar="MODEL",
                     help="instead of a random draw, the samples whose label is most likely "
                          "wrong under a run's model.pt (with its config.json beside it), "
                          "most suspect first, to fix labels: the answers mark them "
                          "reviewed, not verified (docs/OWN-DATA.md)")
    cmd.add_argument("--top", type=whole_number(1, 1_000_000, "is not a whole number >= 1; "
                                                "give how many suspects to check, e.g. 100"),
                     default=None, metavar="N",
                     help=f"with --suspects: how many (default {DEFAULT_TOP})")
    cmd.add_argument("--class-map", default=None,
                     help="class names, a JSON {name: index} (default: classes.json beside "
                          "DATA when there is one, else the class indices)")
    cmd.add_argument("--num-classes", type=int, default=0, metavar="K",
                     help="without a class map: offer classes 0..K-1 (default: up to the "
                          "largest label)")
    cmd.add_argument("--port", type=port, default=DEFAULT_PORT,
                     help="the page's port on 127.0.0.1 (default %(default)s; 0: any free)")
    cmd.add_argument("--host", type=loopback, default=HOST,
                     help=f"{HOST} only: the page shows private data (default %(default)s)")
    cmd.add_argument("--readable-by-others", action="store_true",
                     help="write DATA 0644 at the end, for a container whose user differs "
                          "from yours; default: owner-only (0600)")
    cmd.set_defaults(func=cmd_labels)
