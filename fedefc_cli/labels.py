"""``fedefc labels``: a site's data steward checks labels in the browser (docs/OWN-DATA.md,
"Checking labels in the browser").

    fedefc labels DATA.npz [--per-class 10] [--seed 0] [--port 8765]

- Samples (:func:`draw`): ``--per-class`` N of each observed class (all of a class with
  fewer), among the samples DATA does not yet mark ``verified``, drawn without
  replacement by a generator seeded by ``--seed``, and shown in a seeded order that
  mixes the classes.
- The page (``labels_page.html``: inline style and script, no other file, nothing from
  outside the machine) is served on 127.0.0.1 only, under a random token that the
  command prints, so that another user of the machine cannot read it: per sample the
  image (or the feature row), the observed label, and the steward's answer, "correct",
  the right class, or "skip" (unsure). Class names come from ``--class-map`` or the
  ``classes.json`` that ``fedefc data`` wrote beside DATA.
- Progress (:class:`Progress`): every answer is saved at once in an owner-only file next
  to DATA (``DATA.labels-progress.json``), so a closed tab or a stopped command loses
  nothing: the same command continues where it stopped. The file holds DATA's SHA-256;
  a DATA that changed meanwhile is refused.
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
import errno
import hashlib
import hmac
import io
import json
import os
import secrets
import shutil
import threading
import time
import zipfile
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image  # Pillow comes with torchvision

from common.data_files import DatasetError, Samples, read_samples
from common.private_files import FILE_MODE, open_private
from common.results import atomic_write_bytes, atomic_write_json
from common.seeds import derive_seed

from .errors import UsageError
from .prepare_data import read_class_map

HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_PER_CLASS = 10
PROGRESS_SUFFIX = ".labels-progress.json"
PROGRESS_FORMAT = 1
PAGE = Path(__file__).with_name("labels_page.html")
VERDICTS = ("correct", "corrected", "skipped")
MAX_BODY = 64 * 1024  # an answer is a few dozen bytes


class LabelsError(UsageError):
    """DATA, its class map, its progress file or a flag of ``fedefc labels`` is unusable;
    the message names it and the fix."""


# -- the site's data ---------------------------------------------------------------------
@dataclass(frozen=True)
class SiteData:
    """DATA as read by the run's own reader, its class names and its SHA-256."""

    path: Path
    samples: Samples
    classes: list[str]
    sha256: str

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


def load_site(data: Path, class_map: Path | None = None, num_classes: int = 0) -> SiteData:
    """DATA read and checked as a node reads it (``common/data_files.py``), with its class
    names: from ``class_map``, else from ``classes.json`` beside DATA when there is one."""
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
    map_path = class_map or data.with_name("classes.json")
    mapping = read_class_map(map_path) if class_map or map_path.is_file() else None
    names = class_names(samples.y, mapping, num_classes, repr(str(map_path)))
    return SiteData(data, samples, names, file_sha256(data))


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
    replaces DATA (a command stopped between the two finds its check done)."""

    data: str
    sha256: str
    per_class: int
    seed: int
    rows: list[int]
    answers: dict[int, dict] = field(default_factory=dict)
    written_sha256: str = ""
    format: int = PROGRESS_FORMAT

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


def open_progress(site: SiteData, per_class: int | None, seed: int | None
                  ) -> tuple[Progress, str]:
    """(the check of ``site``, what it is: "continued", "new", or "written": new, the one
    saved before having been written into DATA). The saved progress when there is one for
    this DATA, else a new draw, saved at once (so that a folder where nothing can be
    written is found now, not at the first answer)."""
    path = progress_path(site.path)
    kind = "new"
    if path.exists():
        saved = Progress.read(path)
        if saved.written_sha256 and saved.written_sha256 == site.sha256:
            path.unlink()  # its check was written; the command stopped before this
            kind = "written"
        elif saved.sha256 != site.sha256:
            raise LabelsError(
                f"DATA={str(site.path)!r} changed since the check saved in {str(path)!r} "
                f"began ({len(saved.answers)} answers); put the data it was started on back "
                f"to continue, or delete {str(path)!r} to start over on the new data")
        else:
            for flag, given, kept in (("--per-class", per_class, saved.per_class),
                                      ("--seed", seed, saved.seed)):
                if given is not None and given != kept:
                    raise LabelsError(
                        f"{flag}={given}, but the check saved in {str(path)!r} was started "
                        f"with {flag} {kept}; leave {flag} out (or give {kept}) to continue "
                        f"it, or delete {str(path)!r} to start over")
            return saved, "continued"
    per_class = DEFAULT_PER_CLASS if per_class is None else per_class
    seed = 0 if seed is None else seed
    rows = draw(site.samples.y, site.samples.verified, per_class, seed)
    if not len(rows):
        raise LabelsError(f"DATA={str(site.path)!r} marks every sample verified already: "
                          "there is nothing left to check")
    progress = Progress(str(site.path), site.sha256, per_class, seed,
                        [int(r) for r in rows])
    try:
        progress.save(path)
    except OSError as err:
        raise LabelsError(f"the progress file {str(path)!r} cannot be written ({err}); "
                          "run fedefc labels as a user who may write in DATA's folder") from None
    return progress, kind


# -- finishing -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """What :func:`write_checked` wrote: DATA's path and mode, its backup, the counts of
    the answers, the corrections (row, observed, checked) and the verified total."""

    data: Path
    mode: int
    backup: Path
    counts: dict[str, int]
    corrected: list[tuple[int, int, int]]
    verified_before: int
    verified_after: int
    size: int


def backup_path(data: Path, stamp: str) -> Path:
    """``NAME.before-labels-STAMP.npz`` beside DATA; ``-2``, ``-3`` ... when taken."""
    for n in range(1, 1000):
        candidate = data.with_name(f"{data.stem}.before-labels-{stamp}"
                                   f"{'' if n == 1 else f'-{n}'}{data.suffix}")
        if not candidate.exists():
            return candidate
    raise LabelsError(f"999 backups of DATA={str(data)!r} exist for {stamp}; move them away")


def copy_private(src: Path, dst: Path) -> None:
    """``src`` copied to ``dst`` (a new file, owner-only), via a temporary name."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    try:
        with open(src, "rb") as fin, open_private(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checked_arrays(data: Path, progress: Progress) -> tuple[dict[str, np.ndarray], bool]:
    """Every array of DATA, ``labels`` with the corrections in place and ``verified``
    True where it was or where the answer checked the label; and whether DATA's arrays
    were compressed (``numpy.savez_compressed``)."""
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
    verified = np.zeros(len(labels), dtype=bool)
    if "verified" in arrays:
        verified |= arrays["verified"]
    verified[rows] = True
    return {**arrays, "labels": new, "verified": verified}, compressed


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
    before = site.samples.verified
    corrected = [(r, int(site.samples.y[r]), int(a["label"]))
                 for r, a in sorted(progress.answers.items()) if a["verdict"] == "corrected"]
    return Written(data, mode, backup, counts, corrected,
                   0 if before is None else int(before.sum()), int(arrays["verified"].sum()),
                   len(site.samples.y))


def describe(written: Written, classes: list[str]) -> str:
    """The lines ``fedefc labels`` prints once it wrote DATA."""
    c = written.counts
    lines = [f"fedefc labels: wrote {written.data} (mode {written.mode:04o})",
             f"  {c['drawn']} samples drawn: {c['checked']} checked ({c['correct']} correct, "
             f"{c['corrected']} corrected), {c['skipped']} skipped, {c['left']} not answered; "
             "skipped and unanswered ones stay unverified",
             f"  verified: {written.verified_after} of {written.size} samples "
             f"({written.verified_after - written.verified_before} new, "
             f"{written.verified_before} before)"]
    lines += [f"  row {r}: label {old} ({classes[old]}) -> {new} ({classes[new]})"
              for r, old, new in written.corrected]
    if written.verified_after == written.size:
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


class Session:
    """The check the page drives: answers saved as they come, one at a time."""

    def __init__(self, site: SiteData, progress: Progress, shared: bool):
        self.site, self.progress, self.shared = site, progress, shared
        self.lock = threading.Lock()
        self.written: Written | None = None

    def state(self) -> dict:
        """What the page shows: the classes, every sample drawn with its observed label,
        its answer and (feature vectors) its features, and the counts."""
        p, y = self.progress, self.site.samples.y
        with self.lock:
            samples = [{"row": r, "observed": int(y[r]), "answer": p.answers.get(r)}
                       for r in p.rows]
            counts = p.counts()
        if self.site.kind == "features":
            for s in samples:
                s["features"] = [float(f"{v:.6g}") for v in self.site.samples.x[s["row"]]]
        return {"data": str(self.site.path), "kind": self.site.kind,
                "classes": self.site.classes, "samples": samples, "counts": counts}

    def answer(self, body: dict) -> dict:
        """Record ``body`` = {"index": i, "verdict": "correct" | "skipped" | "class" |
        "clear", "label": k (with "class")} for the i-th sample shown, and save."""
        rows, k = self.progress.rows, len(self.site.classes)
        index, verdict, label = body.get("index"), body.get("verdict"), body.get("label")
        if not isinstance(index, int) or not 0 <= index < len(rows):
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
        with self.lock:
            if self.written is not None:
                raise ValueError("the check is finished and written; nothing more is saved")
            if verdict == "clear":
                self.progress.answers.pop(row, None)
            else:
                self.progress.answers[row] = {"verdict": verdict, "label": label}
            self.progress.save(progress_path(self.site.path))
            return {"answer": self.progress.answers.get(row), "counts": self.progress.counts()}

    def finish(self) -> Written:
        with self.lock:
            if self.written is None:
                self.written = write_checked(self.site, self.progress, self.shared)
            return self.written


class LabelServer(ThreadingHTTPServer):
    """The page's server: 127.0.0.1 only, every path under ``/TOKEN/``."""

    daemon_threads = True

    def __init__(self, port: int, token: str):
        super().__init__((HOST, port), Handler)
        self.token = token
        self.session: Session | None = None  # set once the check is open

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_port}/{self.token}/"


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


class Handler(BaseHTTPRequestHandler):
    """GET ``/TOKEN/`` (the page), ``api/state``, ``image/I.png``; POST ``api/answer``,
    ``api/finish``. A wrong token or a Host header other than this server's (a page
    elsewhere reaching 127.0.0.1 through its own DNS name) gets 404 or 403."""

    server: LabelServer

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
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
            return None
        return path[len(prefix):]

    def _send(self, status: HTTPStatus, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in SECURITY_HEADERS.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def do_GET(self):  # noqa: N802 - http.server's name
        route = self._route()
        session = self.server.session
        if route is None or session is None:
            return
        if route == "":
            self._send(HTTPStatus.OK, PAGE.read_bytes(), "text/html; charset=utf-8")
        elif route == "api/state":
            self._json(session.state())
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
        if route is None:
            return
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get_content_type() != "application/json" or length > MAX_BODY:
            self._json({"error": "send a JSON body of at most 64 KiB"},
                       HTTPStatus.BAD_REQUEST)
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if route == "api/answer":
                self._json(self.server.session.answer(body))
            elif route == "api/finish":
                written = self.server.session.finish()
                self._json({"written": describe(written, self.server.session.site.classes),
                            "backup": str(written.backup), "counts": written.counts})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        except (ValueError, LabelsError, OSError) as err:
            self._json({"error": str(err)}, HTTPStatus.BAD_REQUEST)


def bind(port: int) -> LabelServer:
    """The server on 127.0.0.1:``port`` (0: any free port), or an error naming the port."""
    try:
        return LabelServer(port, secrets.token_urlsafe(16))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise LabelsError(f"--port={port}: the port is in use on {HOST} (another fedefc "
                              f"labels, or another program); give another, e.g. --port "
                              f"{port + 1}, or --port 0 for any free port") from None
        raise LabelsError(f"--port={port}: cannot serve on {HOST}:{port} ({err}); give a "
                          "port from 1024 to 65535, or --port 0 for any free port") from None


# -- the command ---------------------------------------------------------------------------
def cmd_labels(args: argparse.Namespace) -> int:
    """``fedefc labels DATA``: serves the page until the check is finished (exit 0) or the
    command is stopped with Ctrl-C (exit 130, every answer kept)."""
    data = Path(args.data).expanduser().resolve()
    site = load_site(data, Path(args.class_map).expanduser().resolve()
                     if args.class_map else None, args.num_classes)
    server = bind(args.port)
    try:
        progress, kind = open_progress(site, args.per_class, args.seed)
        server.session = Session(site, progress, args.readable_by_others)
        c = progress.counts()
        print(f"fedefc labels: {c['drawn']} samples of {len(site.samples.y)} in "
              f"DATA={str(data)!r} ({progress.per_class} per class, seed {progress.seed}, "
              f"{len(site.classes)} classes); "
              + {"continued": f"continuing: {c['answered']} answered, {c['left']} left",
                 "new": "a new check", "written": "a new check (the one saved before was "
                 "written into DATA already)"}[kind], flush=True)
        print(f"  every answer is saved in {progress_path(data)}", flush=True)
        if data.stat().st_mode & 0o044 and not args.readable_by_others:
            print("  note: DATA is readable by others; the file written at the end is "
                  "owner-only (0600) unless --readable-by-others", flush=True)
        print(f"open this address in a browser on this machine (nothing leaves it):\n"
              f"  {server.url}\n  from another computer: ssh -L {server.server_port}:{HOST}:"
              f"{server.server_port} THIS-MACHINE, then open the same address there\n"
              "Ctrl-C stops; run the same command again to continue", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            left = progress.counts()
            print(f"\nfedefc labels: stopped; {left['answered']} answers saved in "
                  f"{progress_path(data)}, {left['left']} left: run the same command again "
                  "to continue", flush=True)
            return 130
    finally:
        server.server_close()
    print(describe(server.session.written, site.classes), flush=True)
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
