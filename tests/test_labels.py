"""``fedefc labels`` (fedefc_cli/labels.py; docs/OWN-DATA.md, "Checking labels in the
browser"): the seeded draw, the progress file, the file it writes (backup, modes,
arrays, corrected labels), the page's server, the refusals, what a node then reads
with ``validation-labels = "verified"``, and a whole session in a real browser
(``browser`` marker: headless Chromium from Debian's packages, driven by Selenium)."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import urllib.request
import zipfile
from collections import Counter
from html.parser import HTMLParser
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.methods import load_run_config
from common.sample_roles import SampleRoles
from fedefc_cli import labels
from fedefc_cli.labels import (
    LabelsError,
    Session,
    describe,
    draw,
    keep,
    load_site,
    open_progress,
    progress_path,
    write_checked,
)
from fedefc_cli.main import main
from fedefc_client.local_data import node_data

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def write_images(folder: Path, labels, classes=("cat", "dog", "bird"), **extra) -> Path:
    """DATA as ``fedefc data`` writes it: uint8 images N x 3 x 6 x 5, each of its own
    colour (so that a shown image names its row), labels, and classes.json beside it."""
    n = len(labels)
    images = np.zeros((n, 3, 6, 5), dtype=np.uint8)
    images[:, 0] = np.arange(n)[:, None, None] * 7 % 256
    images[:, 1] = np.arange(n)[:, None, None] * 13 % 256
    images[:, 2, ::2] = 200
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.npz"
    with open(data, "wb") as fh:
        np.savez(fh, images=images, labels=labels if isinstance(labels, np.ndarray)
                 else np.asarray(labels, dtype=np.int64), **extra)
    data.chmod(0o600)
    if classes:
        (folder / "classes.json").write_text(json.dumps({c: i for i, c in enumerate(classes)}))
    return data


# -- the draw ------------------------------------------------------------------------------
def test_the_draw_takes_n_of_each_observed_class_among_the_unverified_rows():
    """Hand-counted: class 0 has rows 0-5, class 1 rows 6-7, class 2 rows 8-12 of which
    8, 9 and 10 are verified already. With N = 3: three of rows 0-5, both of 6-7, both
    of 11-12; never a verified row; every row once."""
    labels = np.array([0] * 6 + [1] * 2 + [2] * 5)
    verified = np.zeros(13, dtype=bool)
    verified[[8, 9, 10]] = True
    rows = draw(labels, verified, 3, seed=0)
    assert len(rows) == len(set(rows.tolist())) == 7
    assert Counter(labels[rows].tolist()) == {0: 3, 1: 2, 2: 2}
    assert set(rows.tolist()) >= {6, 7, 11, 12} and set(rows.tolist()) - {6, 7, 11, 12} <= set(
        range(6))
    assert not verified[rows].any()
    # N above every class's count: every unverified row, each once
    assert sorted(draw(labels, verified, 99, seed=5).tolist()) == [0, 1, 2, 3, 4, 5, 6, 7, 11,
                                                                   12]
    assert len(draw(labels, np.ones(13, dtype=bool), 3, seed=0)) == 0


def test_the_draw_is_seeded_and_shows_the_classes_mixed():
    labels = np.repeat(np.arange(5), 40)  # 200 rows, classes in blocks
    first = draw(labels, None, 10, seed=3)
    np.testing.assert_array_equal(first, draw(labels, None, 10, seed=3))
    assert set(first.tolist()) != set(draw(labels, None, 10, seed=4).tolist())
    shown = labels[first]
    assert Counter(shown.tolist()) == {c: 10 for c in range(5)}
    assert (np.diff(shown) != 0).sum() > 10  # not 5 blocks of one class: 4 changes


# -- the progress file ---------------------------------------------------------------------
def begin(site, per_class: int | None, seed: int | None):
    """A check of ``site`` opened and saved, as the command opens it."""
    progress, kind = open_progress(site, per_class, seed)
    keep(site, progress)
    return progress, kind


def test_every_answer_is_saved_owner_only_next_to_the_data_and_a_new_command_continues(
        tmp_path):
    data = write_images(tmp_path / "site", [0, 1, 2] * 4)
    site = load_site(data)
    progress, kind = begin(site, 2, 0)
    path = progress_path(data)
    assert kind == "new" and path == tmp_path / "site" / "data.npz.labels-progress.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    session = Session(site, progress, shared=False)
    rows = progress.rows
    observed = [int(site.samples.y[r]) for r in rows]
    other = (observed[1] + 1) % 3
    session.answer({"index": 0, "verdict": "correct"})
    session.answer({"index": 1, "verdict": "class", "label": other})
    session.answer({"index": 2, "verdict": "class", "label": observed[2]})  # = correct
    session.answer({"index": 3, "verdict": "skipped"})
    session.answer({"index": 4, "verdict": "skipped"})
    session.answer({"index": 4, "verdict": "clear"})
    saved = json.loads(path.read_text())  # on disk after each answer, no finish needed
    assert saved["answers"] == {
        str(rows[0]): {"verdict": "correct", "label": observed[0]},
        str(rows[1]): {"verdict": "corrected", "label": other},
        str(rows[2]): {"verdict": "correct", "label": observed[2]},
        str(rows[3]): {"verdict": "skipped", "label": None}}
    again, kind = open_progress(load_site(data), None, None)
    assert kind == "continued" and again.rows == rows and again.answers == progress.answers
    assert again.counts() == {"correct": 2, "corrected": 1, "skipped": 1, "checked": 3,
                              "answered": 4, "left": 2, "drawn": 6}


@pytest.mark.parametrize("flags, named", [((3, None), "--per-class=3"),
                                          ((None, 7), "--seed=7")])
def test_a_check_in_progress_refuses_another_draw_and_says_how_to_continue(tmp_path, flags,
                                                                          named):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    begin(load_site(data), 2, 0)
    with pytest.raises(LabelsError, match=re.escape(named) + ".*leave .* out"):
        open_progress(load_site(data), *flags)


def test_a_check_of_data_that_changed_since_is_refused_and_a_broken_file_named(tmp_path):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    begin(load_site(data), 2, 0)
    write_images(tmp_path, [0, 1, 2] * 5)
    with pytest.raises(LabelsError, match="changed since the check saved .* delete"):
        open_progress(load_site(data), None, None)
    progress_path(data).write_text("{not json")
    with pytest.raises(LabelsError, match="progress file .* cannot be read"):
        open_progress(load_site(data), None, None)


# -- the file it writes -------------------------------------------------------------------
def answered(data: Path, answers: dict[int, tuple[str, int | None]], per_class: int = 2,
             seed: int = 0):
    """A check of ``data`` with ``answers`` {index shown: (verdict, label)} given."""
    site = load_site(data)
    progress, _ = begin(site, per_class, seed)
    session = Session(site, progress, shared=False)
    for index, (verdict, label) in answers.items():
        session.answer({"index": index, "verdict": verdict, "label": label})
    return site, progress


@pytest.mark.parametrize("shared, mode", [(False, 0o600), (True, 0o644)])
def test_finishing_backs_up_then_writes_verified_and_the_corrected_labels(tmp_path, shared,
                                                                         mode):
    """Hand-built: 12 rows, labels uint8 (0, 1, 2, 0, 1, 2, ...), an extra array, row 11
    verified before. The answers: correct, corrected to another class, skipped, and
    three unanswered; the file then holds exactly those two rows verified besides row
    11, the one label changed, every other array byte for byte, the labels' dtype."""
    labels = np.array([0, 1, 2] * 4, dtype=np.uint8)
    before = np.zeros(12, dtype=bool)
    before[11] = True
    ids = np.arange(100, 112)
    data = write_images(tmp_path, labels, ids=ids, verified=before)
    original = data.read_bytes()
    site = load_site(data)
    progress, _ = begin(site, 2, 0)
    a, b, c = progress.rows[:3]
    wrong = (int(labels[b]) + 1) % 3
    session = Session(site, progress, shared=False)
    for index, verdict, label in ((0, "correct", None), (1, "class", wrong),
                                  (2, "skipped", None)):
        session.answer({"index": index, "verdict": verdict, "label": label})
    written = write_checked(site, progress, shared=shared, stamp="20261204T200000Z")

    backup = tmp_path / "data.before-labels-20261204T200000Z.npz"
    assert written.backup == backup and backup.read_bytes() == original
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == mode
    assert not progress_path(data).exists()
    with np.load(data) as new, np.load(backup) as old:
        assert sorted(new.files) == ["ids", "images", "labels", "verified"]
        expected_labels = labels.copy()
        expected_labels[b] = wrong
        assert new["labels"].dtype == np.uint8
        np.testing.assert_array_equal(new["labels"], expected_labels)
        assert sorted(np.flatnonzero(new["verified"]).tolist()) == sorted([a, b, 11])
        np.testing.assert_array_equal(new["images"], old["images"])
        np.testing.assert_array_equal(new["ids"], ids)
    assert written.counts["checked"] == 2 and written.counts["skipped"] == 1
    assert written.counts["left"] == 3
    assert written.corrected == [(b, int(labels[b]), wrong)]
    assert (written.mark, written.marked_before, written.marked_after) == ("verified", 1, 3)
    text = describe(written, site)
    assert f"row {b}: label {labels[b]} (" in text and "2 checked (1 correct, 1 corrected)" \
        in text and str(backup) in text


def test_a_second_backup_never_replaces_the_first_and_compression_is_kept(tmp_path):
    data = tmp_path / "data.npz"
    np.savez_compressed(data, features=np.arange(24, dtype=np.float32).reshape(8, 3),
                        labels=np.array([0, 1] * 4))
    first = tmp_path / "data.before-labels-S.npz"
    first.write_bytes(b"an older backup")
    site, progress = answered(data, {0: ("correct", None)}, per_class=1)
    written = write_checked(site, progress, stamp="S")
    assert first.read_bytes() == b"an older backup"
    assert written.backup == tmp_path / "data.before-labels-S-2.npz"
    assert "WARNING" not in describe(written, site)
    site, progress = answered(data, {i: ("correct", None) for i in range(7)}, per_class=4)
    assert "WARNING: every sample is verified now" in describe(write_checked(site, progress),
                                                               site)
    with zipfile.ZipFile(data) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}


def test_finishing_with_nothing_checked_or_after_the_data_changed_writes_nothing(tmp_path):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    original = data.read_bytes()
    site, progress = answered(data, {0: ("skipped", None)})
    with pytest.raises(LabelsError, match=r"no label is checked yet \(1 skipped, 5 not "
                                          "answered\\)"):
        write_checked(site, progress)
    assert data.read_bytes() == original and not list(tmp_path.glob("*before-labels*"))
    site, progress = answered(data, {1: ("correct", None)})
    other = write_images(tmp_path / "other", [0, 1] * 6)
    shutil.copyfile(other, data)
    with pytest.raises(LabelsError, match="changed while the page was open; nothing was "
                                          "written"):
        write_checked(site, progress)
    assert data.read_bytes() == other.read_bytes()
    assert not list(tmp_path.glob("*before-labels*"))
    assert progress_path(data).exists()  # the answers are kept


def test_the_node_keeps_the_checked_samples_as_its_verified_share(tmp_path):
    """What a SuperNode holding the written file reads with validation-labels =
    "verified" (its own loader, fedefc_client/local_data.py: node_data): the share is
    the checked rows the federated-evaluation hold-out leaves it, with the corrected
    label; with the coordinator's test set (no hold-out) every checked row."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(60, 4)).astype(np.float32)
    labels = np.repeat(np.arange(3), 20)
    data = tmp_path / "node.npz"
    np.savez(data, features=features, labels=labels)
    site, progress = answered(data, {i: ("correct", None) for i in range(8)}, per_class=5)
    fix_index = 8
    fixed_row = progress.rows[fix_index]
    new_label = (int(labels[fixed_row]) + 1) % 3
    Session(site, progress, False).answer({"index": fix_index, "verdict": "class",
                                           "label": new_label})
    write_checked(site, progress, stamp="S")
    checked = set(progress.rows[:9])
    for evaluation in ("federated", "server"):
        keys = {"dataset": "npz", "num-classes": 3, "input-shape": "4", "num-clients": 3,
                "fraction": 1.0, "validation-labels": "verified", "evaluation": evaluation}
        if evaluation == "server":
            keys.update({"test-path": str(data), "normalization": "none"})
        cfg = load_run_config(keys)
        local = node_data(cfg, 1, {"data-path": str(data)}, "node", torch.device("cpu"))
        train = SampleRoles.build(cfg, 1, 60, 3).train
        share_rows = {int(train[i]) for i in local.validation}
        assert share_rows == checked & set(train.tolist())
        if evaluation == "server":
            assert share_rows == checked
        if fixed_row in share_rows:
            position = int(np.flatnonzero(train == fixed_row)[0])
            assert local.labels[position] == new_label


# -- the command's refusals ----------------------------------------------------------------
@pytest.mark.parametrize("make, argv, message", [
    (None, ["{tmp}/none.npz"], "DATA='{tmp}/none.npz' does not exist"),
    ("text", ["{tmp}/data.npz"], "is not a readable .npz file"),
    ("folder", ["{tmp}/folder"], "is a folder: a folder of images cannot mark"),
    ("images", ["{tmp}/site/data.npz", "--class-map", "{tmp}/missing.json"],
     "--class-map='{tmp}/missing.json' cannot be read"),
], ids=["missing", "not-npz", "folder", "class-map"])
def test_bad_data_is_refused_naming_it_and_loads_neither_torch_nor_flower(tmp_path, make, argv,
                                                                       message):
    if make == "text":
        (tmp_path / "data.npz").write_text("labels,x\n0,1\n")
    elif make == "folder":
        (tmp_path / "folder" / "0").mkdir(parents=True)
    elif make == "images":
        write_images(tmp_path / "site", [0, 1, 2])
    probe = ("import sys; from fedefc_cli.main import main\ncode = main(sys.argv[1:])\n"
             "print('LOADED', sorted(m for m in ('torch', 'flwr') if m in sys.modules), code)")
    out = subprocess.run([sys.executable, "-c", probe, "labels",
                          *(a.format(tmp=tmp_path) for a in argv)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "LOADED [] 2", out.stderr
    assert message.format(tmp=tmp_path) in out.stderr
    assert not list(tmp_path.rglob("*labels-progress*"))


@pytest.mark.parametrize("flag, value, message", [
    ("--per-class", "0", "'0' is not a whole number >= 1"),
    ("--host", "0.0.0.0", "serves on 127.0.0.1 only"),
    ("--port", "70000", "'70000' is not a port"),
])
def test_bad_flags_are_refused_naming_the_value_and_the_fix(tmp_path, capsys, flag, value,
                                                            message):
    data = write_images(tmp_path, [0, 1, 2])
    with pytest.raises(SystemExit) as err:
        main(["labels", str(data), flag, value])
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert not progress_path(data).exists()


def test_a_port_in_use_is_refused_before_anything_is_written(tmp_path, capsys):
    data = write_images(tmp_path, [0, 1, 2])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["labels", str(data), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port={port}: the port is in use on 127.0.0.1" in err and "--port 0" in err
    assert not progress_path(data).exists()


# -- the server ------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(data: Path):
    """The page's server on a free port, in a thread, over a check of 2 per class."""
    site = load_site(data)
    progress = begin(site, 2, 0)[0]
    server = labels.bind(0, progress.token)
    server.session = Session(site, progress, False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.session.close()
        server.server_close()


@pytest.fixture
def served(tmp_path):
    with serving(write_images(tmp_path, [0, 1, 2] * 4)) as server:
        yield server


def request(server, method: str, path: str, body=None, host: str | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port)
    headers = {"Host": host or f"127.0.0.1:{server.server_port}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


class References(HTMLParser):
    """Every src, href and action attribute of a page."""

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        self.found += [(tag, k, v) for k, v in attrs if k in ("src", "href", "action")]


def test_the_page_references_nothing_outside_its_own_server(served):
    status, headers, page = request(served, "GET", f"/{served.token}/")
    assert status == 200
    text = page.decode()
    refs = References()
    refs.feed(text)
    assert refs.found == [("link", "href", "data:,")]  # the empty icon: no request at all
    assert not re.search(r"(https?|wss?|ftp):|[\"'(]//|@import|url\(", text, re.I)
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "http" not in policy
    assert served.url.startswith("http://127.0.0.1:")


def test_the_server_answers_its_token_and_host_only_and_refuses_bad_answers(served):
    token = served.token
    assert request(served, "GET", "/api/state")[0] == 404
    status, _, stale = request(served, "GET", f"/{'x' * len(token)}/api/state")
    assert status == 404 and b"A check keeps its address when the command is started" in stale
    assert request(served, "GET", f"/{token}/api/state", host="evil.example:80")[0] == 403
    assert request(served, "GET", f"/{token}")[1]["Location"] == f"/{token}/"
    status, _, body = request(served, "GET", f"/{token}/api/state")
    state = json.loads(body)
    assert status == 200 and state["classes"] == ["cat", "dog", "bird"]
    assert [s["row"] for s in state["samples"]] == served.session.progress.rows
    status, headers, png = request(served, "GET", f"/{token}/image/0.png")
    assert headers["Content-Type"] == "image/png" and png.startswith(b"\x89PNG")
    for bad, said in (({"index": 6, "verdict": "correct"}, "index 6 is not a sample"),
                      ({"index": 0, "verdict": "class", "label": 3}, "label 3 is not a class"),
                      ({"index": 0, "verdict": "maybe"}, "verdict 'maybe'")):
        status, _, body = request(served, "POST", f"/{token}/api/answer", bad)
        assert status == 400 and said in json.loads(body)["error"]
    status, _, body = request(served, "POST", f"/{token}/api/finish", {})
    assert status == 400 and "no label is checked yet" in json.loads(body)["error"]
    assert not served.session.progress.answers


def raw_post(server, head: str, body: bytes = b"{}") -> bytes:
    """A POST as bytes on a socket left open, and all the server sends before it closes
    (the page's server speaks HTTP/1.0: it closes after its answer)."""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=60) as sock:
        sock.sendall(f"POST /{server.token}/api/answer HTTP/1.1\r\nHost: 127.0.0.1:"
                     f"{server.server_port}\r\n{head}\r\n".encode() + body)
        reply = b""
        while chunk := sock.recv(65536):  # a server still reading would leave this waiting
            reply += chunk
    return reply


@pytest.mark.parametrize("body", [b"[1, 2]", b"5", b"null", b'"correct"'])
def test_a_body_that_is_not_a_json_object_gets_a_reason_not_a_dropped_connection(served,
                                                                                   body):
    """Issue 58, lows: such a body raised in the handler (a traceback, the connection
    dropped without an answer)."""
    reply = raw_post(served, f"Content-Type: application/json\r\nContent-Length: "
                             f"{len(body)}\r\n", body)
    assert reply.startswith(b"HTTP/1.0 400 ")
    assert b"the body is JSON but not an object" in reply
    assert request(served, "GET", f"/{served.token}/api/state")[0] == 200
    assert not served.session.progress.answers


@pytest.mark.parametrize("length", ["-1", "abc", "+5", str(64 * 1024 + 1)])
def test_a_bad_content_length_is_refused_without_reading_the_body(served, length):
    """Issue 58, lows: ``Content-Length: -1`` read until the client closed the
    connection; a length that is not a number raised in the handler."""
    reply = raw_post(served, f"Content-Type: application/json\r\nContent-Length: {length}\r\n")
    assert reply.startswith(b"HTTP/1.0 400 ") and b"with its Content-Length" in reply
    assert not served.session.progress.answers


def test_a_silent_connection_is_closed_so_the_command_can_end(tmp_path, monkeypatch):
    """Closing the server waits for every request in progress (so that waiting tabs
    learn of the write); a connection a browser opened ahead and never used must not
    hold it: the server closes a silent one after ``Handler.timeout`` (1 s here)."""
    monkeypatch.setattr(labels.Handler, "timeout", 1)
    with serving(write_images(tmp_path, [0, 1, 2] * 4)) as server:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=60) as sock:
            assert sock.recv(1024) == b""  # closed by the server, nothing sent


def test_two_tabs_see_each_others_answers_and_a_stale_answer_is_refused(served):
    """Tab B waits for a change (``api/changes``); tab A answers sample 1: B gets it. B,
    still showing sample 1 unanswered, skips it: refused (409) with A's answer, which
    stays; B, now showing A's answer, changes it: accepted."""
    token = served.token
    rows = served.session.progress.rows
    observed = int(served.session.site.samples.y[rows[0]])
    since = json.loads(request(served, "GET", f"/{token}/api/state")[2])["version"]
    seen = []
    tab_b = threading.Thread(target=lambda: seen.append(
        request(served, "GET", f"/{token}/api/changes?since={since}")))
    tab_b.start()
    status, _, body = request(served, "POST", f"/{token}/api/answer",
                              {"index": 0, "verdict": "correct", "was": None})
    tab_b.join()
    assert status == 200
    changes = json.loads(seen[0][2])
    assert changes["version"] != since and changes["counts"]["answered"] == 1
    assert changes["answers"][0] == {"verdict": "correct", "label": observed}
    status, _, body = request(served, "POST", f"/{token}/api/answer",
                              {"index": 0, "verdict": "skipped", "was": None})
    refused = json.loads(body)
    assert status == 409 and "answered meanwhile, in another tab (correct)" in refused["error"]
    assert refused["answers"][0] == {"verdict": "correct", "label": observed}
    assert served.session.progress.answers[rows[0]]["verdict"] == "correct"
    status, _, _ = request(served, "POST", f"/{token}/api/answer",
                           {"index": 0, "verdict": "skipped", "was": refused["answers"][0]})
    assert status == 200 and served.session.progress.answers[rows[0]]["verdict"] == "skipped"


def test_a_waiting_tab_learns_that_another_wrote_the_file(tmp_path):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    site, progress = answered(data, {0: ("correct", None)})
    session = Session(site, progress, shared=False)
    since = session.changes()["version"]
    seen = []
    tab = threading.Thread(target=lambda: seen.append(session.wait(since, 60, "a")))
    tab.start()
    session.wait(since, 0, "b")  # a tab that polls now and then
    session.finish()
    tab.join()
    assert seen[0]["written"].startswith(f"fedefc labels: wrote {data}")
    assert not progress_path(data).exists()
    assert not session.everyone_told(0)  # tab b polled a moment ago: the command waits
    assert session.wait(since, 60, "b")["written"] == seen[0]["written"]
    assert session.everyone_told(0)


def test_a_check_keeps_its_address_when_the_command_is_started_again(tmp_path):
    """The token and (with --port 0) the port are saved with the check: the same address
    after a restart; a port taken meanwhile gives another, an explicit one is refused."""
    data = write_images(tmp_path, [0, 1, 2] * 4)
    site = load_site(data)
    first, _ = open_progress(site, 2, 0)
    server = labels.bind(0, first.token, first.port)
    first.port = server.server_port
    keep(site, first)
    url = server.url
    server.server_close()
    again, kind = open_progress(load_site(data), None, None)
    assert kind == "continued" and (again.token, again.port) == (first.token, first.port)
    server = labels.bind(0, again.token, again.port)
    assert server.url == url
    try:
        assert labels.bind(0, again.token, again.port).server_port != first.port
        with pytest.raises(LabelsError, match=f"--port={first.port}: the port is in use"):
            labels.bind(first.port, again.token)
    finally:
        server.server_close()
    assert open_progress(load_site(data), None, None)[0].token == first.token
    progress_path(data).unlink()  # started over: another address
    assert open_progress(load_site(data), None, None)[0].token != first.token


def test_a_new_check_after_a_written_one_says_how_many_are_verified(tmp_path):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    site, progress = answered(data, {0: ("correct", None), 1: ("skipped", None),
                                      2: ("correct", None)})
    write_checked(site, progress, stamp="S")
    site = load_site(data)
    progress, kind = open_progress(site, None, None)
    text = labels.opening(site, progress, kind)
    assert kind == "new" and len(progress.rows) == 10  # the 10 unverified, 10 per class
    assert "DATA marks 2 of 12 samples verified already" in text
    assert "data.before-labels-*.npz beside it): this check draws 10 more" in text


def test_a_second_command_on_the_same_data_is_refused(tmp_path):
    """The command holds DATA locked while it serves (cmd_labels: ``with hold(data)``):
    a second one on the same file is refused; another file is free."""
    data = write_images(tmp_path, [0, 1, 2] * 4)
    other = write_images(tmp_path / "other", [0, 1, 2] * 4)
    with labels.hold(data), labels.hold(other):
        with pytest.raises(LabelsError, match="another fedefc labels serves the check of "
                                              "DATA="):
            labels.hold(data)
    labels.hold(data).close()  # free again once the first has ended


def test_a_link_planted_at_the_backups_temporary_name_is_never_written_through(tmp_path):
    """Issue 58, lows: the backup was copied through ``.NAME.tmp``, opened without
    O_EXCL | O_NOFOLLOW: a link planted there had its target overwritten and made 0600.
    A dangling link at the backup's own name counts as taken."""
    data = write_images(tmp_path / "site", [0, 1, 2] * 4)
    original = data.read_bytes()
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file")
    victim.chmod(0o644)
    first = tmp_path / "site" / "data.before-labels-S.npz"
    (first.parent / f".{first.name}.tmp").symlink_to(victim)
    second = first.with_name("data.before-labels-S-2.npz")
    (second.parent / f".{second.name}.tmp").symlink_to(victim)
    first.symlink_to(tmp_path / "nowhere")
    site, progress = answered(data, {0: ("correct", None)})
    written = write_checked(site, progress, stamp="S")
    assert victim.read_text() == "someone else's file"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert written.backup == second and second.read_bytes() == original
    assert first.is_symlink() and not first.exists()


def test_the_keys_follow_the_numbers_the_names_say_and_the_order_on_screen():
    """Issue 60: with the classes one, three, two (fedefc data's map sorts them by
    name) the key "1" meant index 1, "three". Keys are the names' numbers where all
    are numbers 0..9, else the position on screen; the screen lists numbers by value."""
    words = "zero one two three four five six seven eight nine".split()
    by_name = sorted(words)  # eight = 0, five = 1, four = 2, ...
    assert [by_name[k] for k in labels.screen_order(by_name)] == words
    keys = labels.class_keys(by_name)
    assert {by_name[k]: keys[k] for k in range(10)} == {w: str(i) for i, w in enumerate(words)}
    assert labels.screen_order(["one", "three", "two"]) == [0, 2, 1]
    assert labels.class_keys(["one", "three", "two"]) == ["1", "3", "2"]
    assert labels.class_keys(["Two", "One"]) == ["2", "1"]
    assert labels.screen_order(["cat", "dog", "bird"]) == [0, 1, 2]
    assert labels.class_keys(["cat", "dog", "bird"]) == ["0", "1", "2"]
    assert labels.screen_order(["30", "10", "20"]) == [1, 2, 0]
    assert labels.class_keys(["30", "10", "20"]) == ["2", "0", "1"]  # positions on screen
    assert labels.class_keys([str(k) for k in range(11)]) == [None] * 11


def test_the_data_names_its_classes_and_files_and_a_map_that_contradicts_it_is_refused(
        tmp_path):
    """DATA as fedefc data writes it carries its class names and each row's file; the
    page shows the file, the report names it; a classes.json naming the classes
    otherwise is refused, a list of the wrong length named."""
    files = np.array(["ant/a.png", "bee/b.png", "cat/c.png", "bee/d.png"] * 3)
    data = write_images(tmp_path, np.array([0, 1, 2, 1] * 3), classes=None, sources=files,
                        class_names=np.array(["ant", "bee", "cat"]))
    site = load_site(data)
    assert site.classes == ["ant", "bee", "cat"] and site.sources == files.tolist()
    row = open_progress(site, 2, 0)[0].rows[0]  # the first sample the check shows
    other = (int(site.samples.y[row]) + 1) % 3
    site, progress = answered(data, {0: ("class", other), 1: ("correct", None)})
    with serving(data) as server:
        shown = json.loads(request(server, "GET", f"/{server.token}/api/state")[2])
    assert [s["source"] for s in shown["samples"]] == [files[r] for r in progress.rows]
    text = describe(write_checked(site, progress, stamp="S"), site)
    assert f"row {row} ({files[row]}): label {site.samples.y[row]} (" in text
    (tmp_path / "classes.json").write_text('{"bee": 0, "ant": 1, "cat": 2}')
    with pytest.raises(LabelsError, match="names the classes bee, ant, cat, but DATA's own "
                                          "class_names are ant, bee, cat"):
        load_site(data)
    (tmp_path / "classes.json").write_text('{"ant": 0, "bee": 1, "cat": 2}')
    assert load_site(data).classes == ["ant", "bee", "cat"]
    bad = write_images(tmp_path / "bad", [0, 1, 2], classes=None, sources=np.array(["a", "b"]))
    with pytest.raises(LabelsError, match="array 'sources' is not a list of 3 names"):
        load_site(bad)


def test_a_check_of_the_suspects_shows_the_most_suspect_first_and_marks_them_reviewed(
        tmp_path, monkeypatch):
    """``--suspects``: the model's ranking (here a hand-made one: rows 7, 2, 9, 4 the
    most suspect, row 2 verified before), the top 3 among the rows neither verified nor
    reviewed, in that order; the answers set ``reviewed`` and the corrected labels,
    never ``verified`` (the guard reads only a random draw). Flags of the other kind of
    check are refused, naming it."""
    from fedefc_cli import suspects

    labels_ = np.array([0, 1, 2] * 4)
    before = np.zeros(12, dtype=bool)
    before[2] = True
    data = write_images(tmp_path, labels_, verified=before)
    observed_p = np.linspace(0.5, 0.7, 12)  # the others: row 0 before row 1 ...
    observed_p[[7, 2, 9, 4]] = [0.01, 0.02, 0.03, 0.1]
    order = np.argsort(observed_p, kind="stable")
    ranked = suspects.Ranked(order, observed_p, np.full((12, 3), 1 / 3), np.eye(3))
    asked = []
    monkeypatch.setattr(labels, "rank_site", lambda d, m: asked.append((d, m)) or ranked)
    site = load_site(data)
    model = tmp_path / "run" / "model.pt"
    progress, kind = open_progress(site, None, None, model, 3)
    assert asked == [(data, model)] and kind == "new"
    assert progress.rows == [7, 9, 4] and progress.mark == "reviewed"
    assert progress.observed_p == [0.01, 0.03, 0.1]
    keep(site, progress)
    with pytest.raises(LabelsError, match="is a check of the suspects: finish it first"):
        open_progress(load_site(data), 5, None)
    session = Session(site, progress, shared=False)
    shown = session.state()  # what the page shows beside each sample
    assert (shown["ranking"], shown["mark"]) == ("suspects", "reviewed")
    assert [s["observed_p"] for s in shown["samples"]] == [0.01, 0.03, 0.1]
    session.answer({"index": 0, "verdict": "class", "label": 2})  # row 7: 1 -> 2
    session.answer({"index": 1, "verdict": "correct"})  # row 9
    written = write_checked(site, progress, stamp="S")
    with np.load(data) as new:
        np.testing.assert_array_equal(new["verified"], before)
        assert np.flatnonzero(new["reviewed"]).tolist() == [7, 9]
        assert new["labels"][7] == 2 and (np.delete(new["labels"], 7) ==
                                          np.delete(labels_, 7)).all()
    text = describe(written, site)
    assert "reviewed: 2 of 12 samples (2 new, 0 before)" in text
    assert "Reviewed samples are not verified" in text
    again, _ = open_progress(load_site(data), None, None, model, 3)  # reviewed: not again
    assert again.rows == [4, 0, 1]
    with pytest.raises(LabelsError, match="--top=3 counts the suspects"):
        open_progress(load_site(data), None, None, None, 3)
    with pytest.raises(LabelsError, match="leave --per-class and --seed out"):
        open_progress(load_site(data), 2, None, model, None)


def test_a_served_image_is_the_samples_pixels(served):
    site = served.session.site
    for index in (0, 5):
        _, _, png = request(served, "GET", f"/{served.token}/image/{index}.png")
        shown = np.asarray(Image.open(BytesIO(png)))
        row = served.session.progress.rows[index]
        np.testing.assert_array_equal(shown, site.samples.x[row].transpose(1, 2, 0))


# -- a whole session in a real browser --------------------------------------------------------
def chromium(profile: Path):
    """Debian's headless Chromium under Selenium, its performance log on (every request
    the page makes); skips, saying what is missing, where it is not installed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: "
                                    "pip install -e '.[dev]'")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not path.exists():
            pytest.skip(f"{path} is missing: apt-get install -y {package} (.ci/run does)")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


class Command:
    """``fedefc labels DATA ARGS`` as a steward runs it, in its own process: its printed
    address, then its exit code and the rest of what it printed."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "fedefc_cli", "labels", *argv],
                                     cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.printed = []
        for line in self.proc.stdout:
            self.printed.append(line)
            if line.strip().startswith("http://"):
                self.url = line.strip()
                return
        pytest.fail("fedefc labels printed no address: " + "".join(self.printed))

    def end(self, interrupt: bool = False) -> tuple[int, str]:
        if interrupt:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C
        rest = self.proc.communicate()[0]
        return self.proc.returncode, "".join(self.printed) + rest


@pytest.mark.browser
def test_a_stewards_whole_session_in_chromium(tmp_path):
    """Issue 60's steward, in one browser session, with only the page's keys and buttons:
    DATA as fedefc data writes it (its class names "one", "three", "two" in the order of
    the alphabet, each row's file), 2 per class. Enter; Enter after clicking a strip
    square; the key of the observed class's number ("1" on a "one") records "correct";
    another class's key asks first (Enter goes back, nothing recorded; the same key
    again records it); a second tab sees the first's answers and the first the
    second's; Ctrl-C and the same command again: the same address, the page reconnects
    and reloads; a click on another class, confirmed; Finish in one tab, and the other
    tab shows the file written; the same command again says how many are verified, and
    the old address says what happened. Then the file against the answers and every
    request against 127.0.0.1."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    names = ["one", "three", "two"]  # fedefc data's map of --classes one,two,three
    labels_ = np.array([0, 1, 2] * 5)
    sources = np.array([f"{names[y]}/scan-{i:02d}.png" for i, y in enumerate(labels_)])
    data = write_images(tmp_path / "site", labels_, classes=None, sources=sources,
                        class_names=np.array(names))
    original = data.read_bytes()
    number = {"one": 1, "two": 2, "three": 3}
    command = Command(str(data), "--per-class", "2", "--port", "0")
    url = command.url
    drawn = json.loads(urllib.request.urlopen(url + "api/state").read())["samples"]
    driver = chromium(tmp_path / "chromium-profile")
    wait = WebDriverWait(driver, 120)  # a wait until, never a measured duration
    clicks = {}  # row -> the label answered (None: skipped)
    try:
        def ready():
            wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute(
                "data-ready") == "yes")

        def shown():
            el = driver.find_element(By.ID, "sample")
            return int(el.get_attribute("data-index")), int(el.get_attribute("data-observed"))

        def answered():
            return int(driver.find_element(By.ID, "count-text").get_attribute("data-answered"))

        def after(n, action):
            action()
            wait.until(lambda d: answered() == n)

        def press(key):  # to whatever has focus, as a steward's keyboard does
            ActionChains(driver).send_keys(key).perform()

        def square(index):
            driver.find_elements(By.CSS_SELECTOR, "#strip button")[index].click()
            wait.until(lambda d: shown()[0] == index)

        def unanswered(observed=None):
            verdicts = [b.get_attribute("data-verdict")
                        for b in driver.find_elements(By.CSS_SELECTOR, "#strip button")]
            return next(i for i, s in enumerate(drawn) if verdicts[i] == "open" and
                        (observed is None or s["observed"] in observed))

        def confirm_shown():
            return driver.find_element(By.ID, "confirm-dialog").is_displayed()

        driver.get(url)
        ready()
        tab_a = driver.current_window_handle
        index, observed = shown()
        assert driver.find_element(By.ID, "sample").get_attribute("data-source") == \
            sources[drawn[index]["row"]]
        clicks[drawn[index]["row"]] = observed
        after(1, lambda: press(Keys.ENTER))

        index = unanswered()  # Enter after a click on a strip square (the square has focus)
        square(index)
        clicks[drawn[index]["row"]] = drawn[index]["observed"]
        after(2, lambda: press(Keys.ENTER))

        index = unanswered({0, 1})  # a "one" or a "three": its number's key is not its index
        square(index)
        observed = drawn[index]["observed"]
        clicks[drawn[index]["row"]] = observed
        after(3, lambda: press(str(number[names[observed]])))
        assert not confirm_shown()

        index = unanswered()
        square(index)
        observed = drawn[index]["observed"]
        other = (observed + 1) % 3
        key = str(number[names[other]])
        press(key)
        wait.until(lambda d: confirm_shown())
        assert driver.find_element(By.ID, "confirm-from").text == names[observed]
        assert driver.find_element(By.ID, "confirm-to").text == names[other]
        press(Keys.ENTER)  # the reflex: goes back, records nothing
        wait.until(lambda d: not confirm_shown())
        assert answered() == 3 and shown()[0] == index
        press(key)
        wait.until(lambda d: confirm_shown())
        clicks[drawn[index]["row"]] = other
        after(4, lambda: press(key))  # the same key again: confirmed

        driver.switch_to.new_window("tab")  # a second tab on the same check
        tab_b = driver.current_window_handle
        driver.get(url)
        ready()
        assert answered() == 4
        index = unanswered()
        square(index)
        clicks[drawn[index]["row"]] = None
        after(5, lambda: press("s"))
        driver.switch_to.window(tab_a)
        wait.until(lambda d: answered() == 5)  # the first tab sees the second's answer

        code, printed = command.end(interrupt=True)  # Ctrl-C
        assert code == 130, printed
        error = driver.find_element(By.ID, "error")
        wait.until(lambda d: error.is_displayed() and "not answering" in error.text)
        command = Command(str(data), "--port", "0")  # the same command again
        assert command.url == url and "continuing: 5 answered, 1 left" in "".join(
            command.printed)
        wait.until(lambda d: not error.is_displayed())  # reconnected by itself
        driver.refresh()
        ready()
        index, observed = shown()
        assert answered() == 5 and drawn[index]["row"] not in clicks
        other = (observed + 2) % 3
        driver.find_element(By.CSS_SELECTOR, f"#classes button[data-label='{other}']").click()
        wait.until(lambda d: confirm_shown())
        clicks[drawn[index]["row"]] = other
        after(6, lambda: driver.find_element(By.ID, "confirm-yes").click())

        driver.switch_to.window(tab_b)
        wait.until(lambda d: answered() == 6)
        driver.switch_to.window(tab_a)
        driver.find_element(By.ID, "finish").click()
        wait.until(lambda d: d.find_element(By.ID, "finish-dialog").is_displayed())
        counts = {k: driver.find_element(By.ID, f"f-{k}").text
                  for k in ("correct", "corrected", "skipped", "left")}
        assert counts == {"correct": "3", "corrected": "2", "skipped": "1", "left": "0"}
        driver.find_element(By.ID, "write").click()
        wait.until(lambda d: d.find_element(By.ID, "done").is_displayed())
        driver.switch_to.window(tab_b)  # the other tab learns that the file was written
        wait.until(lambda d: d.find_element(By.ID, "done").is_displayed())
        done = driver.find_element(By.ID, "done-text").text
        code, printed = command.end()
        assert code == 0, printed

        command = Command(str(data), "--port", url.split(":")[2].split("/")[0])
        assert "DATA marks 5 of 15 samples verified already" in "".join(command.printed)
        assert command.url != url
        driver.refresh()  # the old address, to a new check
        assert "not the check that fedefc labels serves now" in driver.find_element(
            By.TAG_NAME, "body").text
        assert command.end(interrupt=True)[0] == 130
        requests = [json.loads(entry["message"])["message"]
                    for entry in driver.get_log("performance")]
    finally:
        driver.quit()
        if command.proc.poll() is None:
            command.proc.kill()
    assert "wrote " + str(data) in printed and "3 correct, 2 corrected" in done
    corrected = [r for r, label in clicks.items() if label is not None and label != labels_[r]]
    assert all(f"row {r} ({sources[r]}): label" in done for r in corrected)

    sent = [m["params"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    origin = "/".join(url.split("/", 3)[:3]) + "/"  # http://127.0.0.1:PORT/
    # the browser's own pages (the new-tab page of Chromium 150 is chrome-untrusted:) and
    # inline data: no network
    local = ("chrome:", "chrome-untrusted:", "data:", "about:")
    mine = [p["request"]["url"] for p in sent if p.get("documentURL", "").startswith(origin)]
    assert len(mine) > 10, mine
    assert all(u.startswith((origin, "data:")) for u in mine), mine
    web = [p["request"]["url"] for p in sent if not p["request"]["url"].startswith(local)]
    assert all(u.startswith(origin) for u in web), web  # the browser's own: none either

    backup = next(tmp_path.glob("site/*before-labels*"))
    with np.load(data) as new, np.load(backup) as old:
        expected = old["labels"].copy()
        for row, label in clicks.items():
            if label is not None:
                expected[row] = label
        np.testing.assert_array_equal(new["labels"], expected)
        assert sorted(np.flatnonzero(new["verified"]).tolist()) == sorted(
            r for r, label in clicks.items() if label is not None)
        np.testing.assert_array_equal(new["images"], old["images"])
        np.testing.assert_array_equal(new["sources"], sources)
    assert backup.read_bytes() == original
    assert stat.S_IMODE(data.stat().st_mode) == 0o600
    assert progress_path(data).exists()  # the new check's, begun by the last command


def test_the_documented_session_prints_what_the_page_says(tmp_path, capsys):
    """docs/OWN-DATA.md, "Checking labels in the browser": the first 300 of
    scikit-learn's bundled digits with a class map of their names, 2 per class; the
    page's answers: 18 correct, the 19th corrected to seven, the 20th skipped. What the
    command prints is the page's two blocks (paths, port, token and time aside)."""
    from sklearn.datasets import load_digits

    from tests.test_own_data_docs import DOC, section

    shown = re.findall(r"```\n(fedefc labels: .*?)```",
                       section(DOC.read_text(), "Checking labels in the browser"), re.S)
    digits = load_digits()
    folder = tmp_path / "prepared"
    write_images(folder, digits.target[:300], classes=None)
    names = "zero one two three four five six seven eight nine".split()
    np.savez(folder / "data.npz", images=(digits.images[:300] * 15).astype(np.uint8),
             labels=digits.target[:300],
             sources=np.array([f"{names[y]}/img-{i:03d}.png"
                               for i, y in enumerate(digits.target[:300])]))
    (folder / "classes.json").write_text(json.dumps({n: i for i, n in enumerate(names)}))
    (folder / "data.npz").chmod(0o600)
    code = []
    command = threading.Thread(target=lambda: code.append(main(
        ["labels", str(folder / "data.npz"), "--per-class", "2", "--port", "0"])))
    command.start()
    printed = ""
    while command.is_alive() and not printed.endswith("address\n"):
        command.join(0.05)  # until the command has printed its address
        printed += capsys.readouterr().out
    assert command.is_alive(), printed + capsys.readouterr().err
    host, token = re.search(r"http://(127\.0\.0\.1:\d+)/([^/]+)/", printed).groups()
    answers = [{"verdict": "correct"}] * 18 + [{"verdict": "class", "label": 7},
                                                {"verdict": "skipped"}]
    conn = http.client.HTTPConnection(host)
    for index, answer in enumerate(answers):
        conn.request("POST", f"/{token}/api/answer", json.dumps({"index": index, **answer}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().read()
    conn.request("POST", f"/{token}/api/finish", "{}", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    command.join()
    printed += capsys.readouterr().out
    assert code == [0]
    printed = re.sub(r"(127\.0\.0\.1:|-L |:127\.0\.0\.1:)\d+", r"\g<1>8765",
                     printed.replace(str(folder), "/data/prepared").replace(token,
                                                                           "IP2MaLUgJU26XrPXOegwMw"))
    printed = re.sub(r"before-labels-\d{8}T\d{6}Z", "before-labels-20261204T204021Z", printed)
    assert printed.splitlines() == "".join(shown).splitlines()


def test_feature_rows_are_shown_as_their_values_and_have_no_image(tmp_path):
    data = tmp_path / "data.npz"
    features = np.arange(30, dtype=np.float32).reshape(10, 3) / 7
    np.savez(data, features=features, labels=np.array([0, 1] * 5))
    with serving(data) as server:
        state = json.loads(request(server, "GET", f"/{server.token}/api/state")[2])
        assert request(server, "GET", f"/{server.token}/image/0.png")[0] == 404
    assert state["kind"] == "features" and state["classes"] == ["0", "1"]
    assert len(state["samples"]) == 4
    for sample in state["samples"]:
        np.testing.assert_allclose(sample["features"], features[sample["row"]], rtol=1e-5)


def test_class_names_come_from_the_map_beside_the_data_or_are_the_indices(tmp_path):
    data = write_images(tmp_path, [0, 1, 2, 1])
    assert load_site(data).classes == ["cat", "dog", "bird"]
    (tmp_path / "classes.json").unlink()
    assert load_site(data).classes == ["0", "1", "2"]
    assert load_site(data, num_classes=5).classes == ["0", "1", "2", "3", "4"]
    small = tmp_path / "two.json"
    small.write_text('{"cat": 0, "dog": 1}')
    with pytest.raises(LabelsError, match="DATA holds label 2, but the class map .*two.json' "
                                          "names 2 classes"):
        load_site(data, small)
    with pytest.raises(LabelsError, match="--num-classes=5 but the class map"):
        load_site(data, small, num_classes=5)
