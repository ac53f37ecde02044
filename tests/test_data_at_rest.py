"""Nothing private at rest or in the clear (docs/PRIVACY.md, "Data at rest and in the
clear"): owner-only files and folders for a node's cache, its audit log and a run's
results; error replies without private paths; under secure aggregation no per-client
value beyond the sample count (and the partition id) in the clear; no Q in a log
without diagnostics."""

import logging
import os
import stat
import sys

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitIns, FitRes, GetPropertiesIns, ndarrays_to_parameters
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from common.data_files import DatasetError
from common.disk_cache import DataCache
from common.errors import ConfigError
from common.methods import load_run_config
from common.params import get_weights
from common.private_files import make_private_dir, open_private
from common.results import RunRecorder
from common.runtime import initial_model
from common.secure_means import SCALE_KEY
from fedefc_cli.procs import Processes
from fedefc_client.client import MethodClient
from fedefc_client.client_app import app as client_app
from fedefc_client.local_data import partition_data
from fedefc_client.error_reply import error_reply_mod
from fedefc_client.mods import secure_tail_mod
from fedefc_client.scrub import PATH, exception_text, private_strings, scrub
from fedefc_server import checkpoint
from tests.helpers import OK, InProcessGrid
from tests.test_privacy import micro_config, secure_round


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    """The common umask 022, under which Python's defaults give 0644 files."""
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- owner-only files ---------------------------------------------------------------------
def test_a_runs_results_and_checkpoint_are_owner_only(tmp_path, open_umask):
    out = tmp_path / "new" / "run"
    rec = RunRecorder(out, {"seed": 0})
    rec.write_round({"round": 0, "test_acc": 0.1})
    rec.write_summary({})
    rec.write_model({"w": torch.zeros(2)})
    checkpoint.save(out, checkpoint.Checkpoint(1, [np.zeros(2)], {}, {}))
    files = ["config.json", "metrics.jsonl", "summary.json", "model.pt", checkpoint.FILE]
    assert {name: mode(out / name) for name in files} == {name: 0o600 for name in files}
    assert mode(out) == mode(tmp_path / "new") == 0o700


def test_a_nodes_cache_is_owner_only(tmp_path, open_umask):
    cache = DataCache(tmp_path / "cache" / "node-3")
    path = cache.store("private-abc", {"x": np.zeros(3), "labels": np.arange(3)})
    assert mode(path) == 0o600
    assert mode(tmp_path / "cache") == mode(tmp_path / "cache" / "node-3") == 0o700
    assert cache.load("private-abc")["labels"].tolist() == [0, 1, 2]


def test_a_process_log_is_owner_only(tmp_path, open_umask):
    """The logs of the processes the tooling starts (a SuperNode's holds the full text of
    its ClientApp's exceptions) and of ``flwr run``: a grid cell's run.log is in out-dir."""
    procs = Processes()
    log = tmp_path / "superexec.log"
    procs.start("echo", [sys.executable, "-c", "print('x')"], dict(os.environ), tmp_path,
                log).wait()
    assert mode(log) == 0o600 and log.read_text() == "x\n"


def test_an_existing_file_is_made_owner_only_and_an_existing_folder_left_alone(tmp_path,
                                                                              open_umask):
    log = tmp_path / "old.jsonl"
    log.write_text("a\n")
    log.chmod(0o644)
    with open_private(log, "a") as fh:
        fh.write("b\n")
    assert mode(log) == 0o600 and log.read_text() == "a\nb\n"
    tmp_path.chmod(0o755)
    assert make_private_dir(tmp_path) == tmp_path and mode(tmp_path) == 0o755
    with pytest.raises(ValueError, match="not mode 'r'"):
        open_private(log, "r")


# -- error text -----------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("data-path='/srv/site-a/labels.npz' does not exist",
     f"data-path='{PATH}' does not exist"),
    ("No such file: /home/alice/data (errno 2)", f"No such file: {PATH} (errno 2)"),
    ("cannot read ~/private/x.png", f"cannot read {PATH}"),
    ("cannot read ~bob/x.png", f"cannot read {PATH}"),
    (r"bad file C:\Users\alice\x.npz here", f"bad file {PATH} here"),
    ("see file:///srv/x.npz", f"see {PATH}"),
    ("accuracy 1/2 and/or the loss; https://flower.ai/docs",
     "accuracy 1/2 and/or the loss; https://flower.ai/docs"),
    # issue 29 (5): at 6a260ce these went through whole or in part
    ("cannot open site-a/img-017.png now", f"cannot open {PATH} now"),
    ("cannot open site-a/my scan 017.png, sorry", f"cannot open {PATH}, sorry"),
    ("folder images/train/cats missing", f"folder {PATH} missing"),
    ("[Errno 2] No such file or directory: '/srv/site a/my scan.png'",
     f"[Errno 2] No such file or directory: '{PATH}'"),
    ('cannot identify image file "scans/ward 3/x.png"', f'cannot identify image file "{PATH}"'),
], ids=["posix", "home", "tilde", "tilde-user", "windows", "url", "not-a-path", "relative",
        "relative-with-spaces", "relative-folders", "quoted-with-spaces", "double-quoted"])
def test_scrub_removes_paths_and_keeps_other_text(text, want):
    assert scrub(text, {}) == want


@pytest.mark.parametrize("err, want", [
    (KeyError("patient-0042"), "KeyError: '<text>'"),
    (ValueError("invalid literal for int() with base 10: 'malignant'"),
     "ValueError: invalid literal for int() with base <id>: '<text>'"),
    (FileNotFoundError(2, "No such file or directory", "/srv/site a/x y.png"),
     f"FileNotFoundError: [<id> <id>] <id> such file or directory: '{PATH}'"),
    (ConfigError("method 'fedavg' is not one of 'a', 'b'"),
     "ConfigError: method 'fedavg' is not one of 'a', 'b'"),
    (ValueError("unknown label Jane_Doe in row 42 (patient-0042)"),
     "ValueError: unknown label <id> in row <id> (<id>)"),
    (ValueError("unknown label \u2018Jane Doe\u2019 in \u201cward 7\u201d"),
     "ValueError: unknown label '<text>' in '<text>'"),
    (ValueError("no label for Jane Doe, born 1971-03-05, record 4711, jane.doe@ward.org"),
     "ValueError: no label for <id> <id>, born <id>, record <id>, <id>"),
], ids=["sample-id", "label", "path-with-spaces", "the-projects-own", "unquoted-identifiers",
        "curly-quotes", "name-date-record-email"])
def test_a_foreign_exception_quotes_no_data_and_the_projects_own_keep_their_text(err, want):
    """Issue 29 (5): a label or sample id quoted by another package's exception reached
    the server at 6a260ce; the project's own errors quote only what the project wrote
    (their values are the run's, which the server sent). Issue 47 (4): at 550afb3 an
    unquoted identifier and typographic quotes went through as they were. Issue 58: a
    name with a space, a date, a record number and an e-mail address went through; only
    lowercase English words are left of another package's unquoted text."""
    assert exception_text(err, {}) == want


def test_the_projects_own_error_carrying_another_packages_text_scrubs_that_text():
    """Issue 47 (4): a DatasetError quoting another package's exception (``({err})``,
    raised ``from None``, as common/data_files.py does) kept the label and the sample id
    at 550afb3; the project's own words stay."""
    try:
        try:
            raise ValueError("unknown label 'Jane Doe' in row 42 (patient-0042)")
        except ValueError as inner:
            raise DatasetError(f"labels of site.npz cannot be read ({inner})") from None
    except DatasetError as err:
        assert exception_text(err, {}) == ("DatasetError: labels of site.npz cannot be read "
                                           "(unknown label '<text>' in row <id> (<id>))")


def test_scrub_names_node_config_values_and_cuts_long_text(tmp_path):
    private = private_strings({"data-path": "relative/site-a.npz", "partition-id": 3,
                               "cache-dir": str(tmp_path)})
    got = scrub(f"bad relative/site-a.npz, cache {tmp_path}/private-1.npz", private)
    assert got == f"bad <node-config:data-path>, cache <node-config:cache-dir>{PATH}"
    assert len(scrub("x" * 2000, {})) == 500


def test_a_failing_client_does_not_tell_the_server_its_private_paths(micro_mnist_dir,
                                                                      tmp_path):
    """A node whose private data file is corrupt fails; Flower would send the exception's
    text, which names the file, to the server: the reply names the error, not the path."""
    site = tmp_path / "hospital-alice"
    site.mkdir()
    (site / "labels.npz").write_bytes(b"not a zip file")
    flat = micro_config(micro_mnist_dir, tmp_path / "out", 2, diagnostics=False)
    grid = InProcessGrid(client_app, flat, 2, {0: {"data-path": str(site / "labels.npz")}})
    proxy = next(p for p in grid.manager().all().values() if p.node_id == 1000)
    with pytest.raises(ValueError):
        proxy.get_properties(GetPropertiesIns({}), None, 1)
    [reply] = [m for m in grid.received if m.has_error()]
    reason = reply.error.reason
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "PrivateDataError" in reason and "<node-config:data-path>" in reason
    assert "hospital-alice" not in reason and str(tmp_path) not in reason


def test_a_failed_message_changes_nothing_on_the_node_and_an_error_reply_is_scrubbed():
    ctxt = Context(1, 1000, {"partition-id": 0, "data-path": "/srv/site"}, RecordDict(), {})
    ctxt.state["kept"] = ConfigRecord({"v": 1})
    ctxt.state["progress"] = ConfigRecord({"n": 1})
    before = dict(ctxt.state.items())
    msg = Message(RecordDict(), 1000, MessageType.TRAIN)

    def fails(m, c):
        c.state["progress"] = ConfigRecord({"n": 2})  # replaced, then the message fails
        c.state["new"] = ConfigRecord({"n": 3})
        raise OSError("cannot open /srv/site/img-017.png")

    out = error_reply_mod(msg, ctxt, fails)
    assert out.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert out.error.reason == f"OSError: cannot open <node-config:data-path>{PATH}"
    label = error_reply_mod(msg, ctxt, lambda m, c: {"benign": 0}["patient-0042 malignant"])
    assert label.error.reason == "KeyError: '<text>'"
    assert dict(ctxt.state.items()) == before
    inner = error_reply_mod(msg, ctxt, lambda m, c: Message(
        Error(ErrorCode.MOD_FAILED_PRECONDITION, "see /etc/site.toml"), reply_to=m))
    assert (inner.error.code, inner.error.reason) == (ErrorCode.MOD_FAILED_PRECONDITION,
                                                      f"see {PATH}")


# -- in the clear under secure aggregation --------------------------------------------
def secure_train(metrics: dict, diagnostics: bool) -> dict:
    """The clear metrics of a secure training reply carrying ``metrics``."""
    fitins = compat.fitins_to_recorddict(
        FitIns(ndarrays_to_parameters([np.zeros(2)]), {"round": 1, SCALE_KEY: 4.0}), True)
    ctxt = Context(1, 1000, {"partition-id": 0}, RecordDict(),
                   {"secure-aggregation": True, "diagnostics": diagnostics})

    def reply(m, c):
        res = FitRes(OK, ndarrays_to_parameters([np.ones(2, np.float32)]), 10, metrics)
        return Message(compat.fitres_to_recorddict(res, True), reply_to=m)

    out = secure_tail_mod(Message(fitins, 1000, MessageType.TRAIN), ctxt, reply)
    return compat.recorddict_to_fitres(out.content, True).metrics


def test_a_secure_reply_keeps_only_the_partition_and_the_loss_name_in_the_clear():
    sent = {"partition-id": 0, "loss": "cross-entropy", "accuracy": 0.5, "train-loss": 1.0,
            "fit-s": 3.2, "kept": 9, "removed": 1, "personal-acc": 0.7,
            "personal-updates": 2, "noise-rate": 0.2, "q-cos": 0.9, "q-l1": 0.1}
    assert secure_train(sent, diagnostics=False) == {"partition-id": 0,
                                                     "loss": "cross-entropy"}
    assert secure_train(sent, diagnostics=True) == {
        "partition-id": 0, "loss": "cross-entropy", "noise-rate": 0.2, "q-cos": 0.9,
        "q-l1": 0.1}


def fit_client(method: str, **extra):
    cfg = load_run_config({"method": method, "num-clients": 20, "fraction": 0.5,
                           "iid": True, "local-epochs": 1, "rho": 0.4, "zeta": 0.4, **extra})
    local = partition_data(cfg, 1, torch.device("cpu"))
    client = MethodClient(cfg, 1, lambda: local, RecordDict())
    return client, get_weights(initial_model(cfg, local.data.task))


def test_confident_learning_counts_its_declared_size_under_secure_aggregation():
    """The kept count would tell the server how many labels cleanlab flagged."""
    client, weights = fit_client("confident-learning", **{"secure-aggregation": True})
    _, n, metrics = client.fit(weights, {"phase": 2, "round": 3, "seed": 3})
    assert n == len(client.local) and 0 < metrics["kept"] < n  # kept stays on the node
    plain, weights = fit_client("confident-learning")
    _, n_plain, m_plain = plain.fit(weights, {"phase": 2, "round": 3, "seed": 3})
    assert n_plain == m_plain["kept"] == metrics["kept"]


def test_a_secure_fedditto_round_sends_nothing_per_client_but_the_sample_count(
        micro_mnist_dir, tmp_path):
    """FedDitto's replies carry fit-s, personal-updates and (in simulation) personal-acc:
    under secure aggregation none leaves a node; every clear count is a declared size."""
    flat = micro_config(micro_mnist_dir, tmp_path, diagnostics=False, method="fedditto",
                        **{"secure-aggregation": True})
    grid = InProcessGrid(client_app, flat, 4)
    fields, params = secure_round(flat, grid)
    assert params is not None and fields["partition_ids"] == [0, 1, 2, 3]
    assert fields["server_saw"]["per_client"] == ["loss", "num-examples", "partition-id"]
    collected = [m for m in grid.received if "fitres.metrics" in m.content.config_records]
    assert len(collected) == 4
    for msg in collected:
        clear = msg.content.config_records["fitres.metrics"]
        assert set(clear) == {"partition-id", "loss"}
        count = msg.content.metric_records["fitres.num_examples"]["num_examples"]
        assert count == fields["declared"][clear["partition-id"]]
        assert RECORD_KEY_CONFIGS in msg.content.config_records  # the masked vector


@pytest.mark.parametrize("diagnostics", [False, True])
def test_q_is_logged_only_as_a_simulation_diagnostic(caplog, diagnostics):
    client, weights = fit_client("fedefc", diagnostics=diagnostics)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="flwr"):
            client.fit(weights, {"phase": 2, "round": 3, "seed": 3})
    finally:
        flwr_logger.removeHandler(caplog.handler)
    logged = any("noise matrix diagonal" in r.getMessage() for r in caplog.records)
    assert logged == diagnostics
