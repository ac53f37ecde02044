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
import socket
import stat
import subprocess
import sys
import threading
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
from fedefc_cli import labels
from fedefc_cli.labels import (
    LabelsError,
    Session,
    describe,
    draw,
    load_site,
    open_progress,
    progress_path,
    write_checked,
)
from fedefc_cli.main import main
from fedefc_client.local_data import held_out_positions, node_data

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
def test_every_answer_is_saved_owner_only_next_to_the_data_and_a_new_command_continues(
        tmp_path):
    data = write_images(tmp_path / "site", [0, 1, 2] * 4)
    site = load_site(data)
    progress, kind = open_progress(site, 2, 0)
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
    open_progress(load_site(data), 2, 0)
    with pytest.raises(LabelsError, match=re.escape(named) + ".*leave .* out"):
        open_progress(load_site(data), *flags)


def test_a_check_of_data_that_changed_since_is_refused_and_a_broken_file_named(tmp_path):
    data = write_images(tmp_path, [0, 1, 2] * 4)
    open_progress(load_site(data), 2, 0)
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
    progress, _ = open_progress(site, per_class, seed)
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
    progress, _ = open_progress(site, 2, 0)
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
    assert (written.verified_before, written.verified_after) == (1, 3)
    text = describe(written, site.classes)
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
    assert "WARNING" not in describe(written, site.classes)
    site, progress = answered(data, {i: ("correct", None) for i in range(7)}, per_class=4)
    assert "WARNING: every sample is verified now" in describe(write_checked(site, progress),
                                                               site.classes)
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
        split = held_out_positions(cfg, 1, 60)
        train = np.arange(60) if split is None else split[0]
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
    server = labels.bind(0)
    server.session = Session(site, open_progress(site, 2, 0)[0], False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
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
    assert request(served, "GET", f"/{'x' * len(token)}/api/state")[0] == 404
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


@pytest.mark.browser
def test_a_stewards_whole_session_in_chromium(tmp_path):
    """Open the page, answer three samples (Enter, S, a click on another class), reload
    (the three still there), answer the other three (a digit key: a correction; the
    Correct button; Enter), finish; then the file against the clicks, the backup against
    the original, and every request the page made against 127.0.0.1."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    data = write_images(tmp_path / "site", [0, 1, 2] * 5)
    original = data.read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "fedefc_cli", "labels", str(data),
                             "--per-class", "2", "--port", "0"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.strip().startswith("http://"):
            url = line.strip()
            break
    else:
        pytest.fail("fedefc labels printed no address: " + "".join(printed))
    driver = chromium(tmp_path / "chromium-profile")
    wait = WebDriverWait(driver, 120)  # a wait until, never a measured duration
    body = (By.TAG_NAME, "body")
    clicks = {}  # row -> the label answered (None: skipped)
    finished = False
    try:
        def ready():
            wait.until(lambda d: d.find_element(*body).get_attribute("data-ready") == "yes")

        def shown():
            el = driver.find_element(By.ID, "sample")
            return int(el.get_attribute("data-row")), int(el.get_attribute("data-observed"))

        def answered():
            return int(driver.find_element(By.ID, "count-text").get_attribute("data-answered"))

        def after(n, action):
            action()
            wait.until(lambda d: answered() == n)

        def press(key):
            driver.find_element(*body).send_keys(key)

        driver.get(url)
        ready()
        row, observed = shown()
        clicks[row] = observed
        after(1, lambda: press(Keys.ENTER))
        row, observed = shown()
        clicks[row] = None
        after(2, lambda: press("s"))
        row, observed = shown()
        clicks[row] = (observed + 2) % 3
        after(3, lambda: driver.find_element(
            By.CSS_SELECTOR, f"#classes button[data-label='{clicks[row]}']").click())

        driver.refresh()
        ready()
        strip = [b.get_attribute("data-verdict")
                 for b in driver.find_elements(By.CSS_SELECTOR, "#strip button")]
        assert answered() == 3 and sorted(strip) == ["correct", "corrected", "open", "open",
                                                     "open", "skipped"]
        row, observed = shown()
        assert row not in clicks  # the page opens at the first unanswered sample
        clicks[row] = (observed + 1) % 3
        after(4, lambda: press(str(clicks[row])))
        row, observed = shown()
        clicks[row] = observed
        after(5, lambda: driver.find_element(By.ID, "correct").click())
        row, observed = shown()
        clicks[row] = observed
        after(6, lambda: press(Keys.ENTER))

        driver.find_element(By.ID, "finish").click()
        wait.until(lambda d: d.find_element(By.ID, "finish-dialog").is_displayed())
        counts = {k: driver.find_element(By.ID, f"f-{k}").text
                  for k in ("correct", "corrected", "skipped", "left")}
        assert counts == {"correct": "3", "corrected": "2", "skipped": "1", "left": "0"}
        driver.find_element(By.ID, "write").click()
        wait.until(lambda d: d.find_element(By.ID, "done").is_displayed())
        done = driver.find_element(By.ID, "done-text").text
        finished = True
        driver.save_screenshot(str(tmp_path / "done.png"))
        requests = [json.loads(entry["message"])["message"]
                    for entry in driver.get_log("performance")]
    finally:
        driver.quit()
        if not finished:
            proc.kill()
        rest = proc.communicate()[0]
    assert proc.returncode == 0, "".join(printed) + rest
    assert "wrote " + str(data) in rest and "3 correct, 2 corrected" in done

    sent = [m["params"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    origin = "/".join(url.split("/", 3)[:3]) + "/"  # http://127.0.0.1:PORT/
    # the browser's own pages (the new-tab page of Chromium 150 is chrome-untrusted:) and
    # inline data: no network
    local = ("chrome:", "chrome-untrusted:", "data:")
    mine = [p["request"]["url"] for p in sent if p.get("documentURL", "").startswith(origin)]
    assert len(mine) > 10, mine
    assert all(u.startswith((origin, "data:")) for u in mine), mine
    web = [p["request"]["url"] for p in sent if not p["request"]["url"].startswith(local)]
    assert all(u.startswith(origin) for u in web), web  # the browser's own: none either

    with np.load(data) as new, np.load(next(tmp_path.glob("site/*before-labels*"))) as old:
        expected = old["labels"].copy()
        for row, label in clicks.items():
            if label is not None:
                expected[row] = label
        np.testing.assert_array_equal(new["labels"], expected)
        assert sorted(np.flatnonzero(new["verified"]).tolist()) == sorted(
            r for r, label in clicks.items() if label is not None)
        np.testing.assert_array_equal(new["images"], old["images"])
    assert next(tmp_path.glob("site/*before-labels*")).read_bytes() == original
    assert stat.S_IMODE(data.stat().st_mode) == 0o600
    assert not progress_path(data).exists()


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
    np.savez(folder / "data.npz", images=(digits.images[:300] * 15).astype(np.uint8),
             labels=digits.target[:300])
    names = "zero one two three four five six seven eight nine".split()
    (folder / "classes.json").write_text(json.dumps({n: i for i, n in enumerate(names)}))
    (folder / "data.npz").chmod(0o600)
    code = []
    command = threading.Thread(target=lambda: code.append(main(
        ["labels", str(folder / "data.npz"), "--per-class", "2", "--port", "0"])))
    command.start()
    printed = ""
    while command.is_alive() and not printed.endswith("continue\n"):
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
