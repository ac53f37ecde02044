"""The repairs of fedefc_cli/flower_repairs.py on Flower 1.42's own SuperNode and SuperExec
functions (no Flower process: the SuperNode's real message loop steps on its real
node state, the SuperExec's real executor); each test first shows Flower's own function
doing what the repair prevents. In real processes: tests/test_deployment_reliability.py
(a SuperLink killed while ClientApps run, the resumed run completing)."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.constant import Status, SubStatus
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run, RunNotRunningException
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode import start_client_internal
from flwr.supernode.nodestate import NodeStateFactory

from fedefc_cli import flower_repairs

RUN, NODE = 11, 7


@pytest.fixture
def node(monkeypatch):
    """A SuperNode's state and object store that know run RUN (an earlier message of it
    was received), as Flower's own SuperNode builds them."""
    for name, value in (("_run_id", RUN), ("_node_id", NODE), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)  # Message() reads the task's identity
    factory = NodeStateFactory(ObjectStoreFactory())
    state = factory.state()
    state.set_node_id(NODE)
    state.store_run(Run.create_empty(RUN))
    state.set_run_series_context(0, Context(run_id=RUN, node_id=NODE, node_config={},
                                            state=RecordDict(), run_config={}))
    return state, state.object_store


def train_message(first: float = 0.0) -> Message:
    msg = Message(RecordDict({"arrays": ArrayRecord([np.arange(first, first + 10,
                                                               dtype=np.float32)])}),
                  dst_node_id=NODE, message_type="train", group_id="3")
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def loop_steps(repaired: bool) -> types.SimpleNamespace:
    """Flower's two message-loop steps, as its SuperNode calls them, repaired or not."""
    steps = types.SimpleNamespace(
        _pull_and_store_message=start_client_internal._pull_and_store_message,
        _push_messages=start_client_internal._push_messages)
    if repaired:
        flower_repairs.repair_supernode(steps)
    return steps


def receive_refused(node, steps, refuse: str) -> int | None:
    """The node receives a train message while its run stops: the SuperLink refuses the
    ``refuse`` step (``object``: a download of its objects; ``confirm``: the last step,
    every object already there), as it refuses a run that is no longer running."""
    state, store = node
    msg = train_message()
    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}

    def pull_object(run_id, object_id):
        if refuse == "object":
            raise RunNotRunningException
        return objects[object_id]

    def confirm(run_id, message_id):
        if refuse == "confirm":
            raise RunNotRunningException

    bare = remove_content_from_message(msg)  # what the Fleet API hands over
    return steps._pull_and_store_message(
        state=state, object_store=store, node_config={},
        receive=lambda: (bare, get_object_tree(msg)), get_run=None, get_fab=None,
        pull_object=pull_object, confirm_message_received=confirm, trusted_entities=None)


@pytest.mark.parametrize("refuse", ["object", "confirm"])
def test_a_message_of_a_run_that_stopped_is_dropped_with_its_task(node, refuse):
    state, _ = node
    # Flower 1.42 alone: "Ignoring message", yet the message and a pending task stay, and
    # the node's SuperExec would start a ClientApp for them
    assert receive_refused(node, loop_steps(repaired=False), refuse) is None
    assert len(state.msg_store) == 1
    assert [t.status.status for t in state.get_tasks()] == [Status.PENDING]
    state.delete_messages()
    for task in state.get_tasks():
        state.finish_task(task.task_id, SubStatus.STOPPED, "")
    # repaired: the message is gone and its task finished as failed, naming the reason
    assert receive_refused(node, loop_steps(repaired=True), refuse) is None
    assert not state.msg_store
    new = [t for t in state.get_tasks() if t.status.sub_status != SubStatus.STOPPED]
    assert [(t.status.status, t.status.sub_status) for t in new] == [(Status.FINISHED,
                                                                       SubStatus.FAILED)]
    assert "is no longer running" in new[0].status.details


def reply_to(msg: Message, value: float) -> Message:
    reply = Message(RecordDict({"arrays": ArrayRecord([np.full(3, value, np.float32)])}),
                    reply_to=msg)
    reply.metadata.__dict__["_message_id"] = reply.object_id
    return reply


def store_reply(state, store, reply: Message) -> None:
    with start_client_internal.no_object_id_recompute():
        state.store_message(reply)
        store.preregister(reply.metadata.run_id, get_object_tree(reply))
        for oid, obj in get_all_nested_objects(reply).items():
            store.put(oid, obj.deflate())


@pytest.mark.parametrize("repaired", [False, True], ids=["flower", "repaired"])
def test_a_left_over_reply_never_takes_the_place_of_the_current_one(node, repaired):
    """A reply left from an earlier message (one whose ClientApp ran after the node had
    moved on) is in the store when the node receives message M: Flower sends it as the
    answer to M and goes on, M's own reply then waiting for the next message; repaired,
    the node sends both and waits for M's own before it goes on."""
    state, store = node
    steps = loop_steps(repaired)
    earlier, current = train_message(), train_message(first=1.0)
    assert earlier.metadata.message_id != current.metadata.message_id
    store_reply(state, store, reply_to(earlier, 1.0))  # the left-over reply
    tree = get_object_tree(current)
    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(current).items()}
    bare = remove_content_from_message(current)
    assert steps._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=lambda: (bare, tree),
        get_run=None, get_fab=None, pull_object=lambda run_id, oid: objects[oid],
        confirm_message_received=lambda run_id, mid: None, trusted_entities=None) == RUN
    sent: list[str] = []

    def send(message, object_tree, runtime):
        sent.append(message.metadata.reply_to_message_id)
        return set(), "session"

    # M's ClientApp answers 1.5 s later
    state.record_message_processing_start(current.metadata.message_id)
    answer = threading.Timer(1.5, store_reply, (state, store, reply_to(current, 2.0)))
    answer.start()
    try:
        steps._push_messages(state=state, object_store=store, send=send,
                             push_object=lambda *args: None)
    finally:
        answer.join()
    if repaired:
        assert sent == [earlier.metadata.message_id, current.metadata.message_id]
        assert not state.msg_store
    else:  # Flower: the left-over went out as M's answer; M's own waits in the store
        assert sent == [earlier.metadata.message_id]
        assert current.metadata.message_id in state.msg_store


# In a fresh interpreter (no other thread starts a process there, which would reap the
# app as a side effect): Flower's executor starts an app process that exits at once, the
# SuperExec's loop calls reconcile(); prints whether the exited process is still defunct.
SUPEREXEC_LOOP = """
import os, sys, time, types
from pathlib import Path
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor as module
from flwr.supercore.superexec.executor.types import ExecutionSpec
from fedefc_cli import flower_repairs

def defunct():
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found

if sys.argv[1] == "repaired":
    flower_repairs.repair_superexec(module)
# an app that exits soon, after Flower has dropped its Popen (a Popen dropped after its
# child exited may be reaped by its __del__, and Flower's leak would not show)
import tempfile
app = Path(tempfile.mkdtemp()) / "app"
app.write_text("#!/bin/sh\\nsleep 2\\n")
app.chmod(0o700)
module.TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] = str(app)
executor = module.SubprocessExecutor()
executor.launch(ExecutionSpec(TaskType.CLIENT_APP, "127.0.0.1:9094", "token", True, None,
                              False, None, True, 1))
deadline = time.monotonic() + 600
while not defunct() and time.monotonic() < deadline:
    time.sleep(0.05)
print("exited", bool(defunct()))
executor.reconcile()  # the SuperExec's loop, once a second
print("defunct after reconcile", bool(defunct()))
"""


@pytest.mark.parametrize("repaired", [False, True], ids=["flower", "repaired"])
def test_the_superexec_reaps_an_app_process_that_exited(repaired):
    """Flower's executor starts the app and drops it: the exited process stays defunct
    until the next start; repaired, the SuperExec's next look (once a second) reaps it."""
    out = subprocess.run([sys.executable, "-c", SUPEREXEC_LOOP,
                          "repaired" if repaired else "flower"], capture_output=True,
                         text=True, cwd=Path(__file__).parents[1])
    assert out.stdout.splitlines() == [
        "exited True", f"defunct after reconcile {not repaired}"], out.stdout + out.stderr


@pytest.mark.parametrize("repaired", [False, True], ids=["flower", "repaired"])
def test_a_superlink_writer_waits_out_a_writer_held_up_longer_than_5_s(tmp_path, monkeypatch,
                                                                       repaired):
    """Issue 60: under load a SuperLink's sqlite state failed with "database is locked".
    Another connection holds the write lock 7 s (a writer not scheduled for that long);
    a write through Flower's own state (its engine, its connect hook) fails after 5 s
    with Flower's pragmas and goes through, once the lock is free, with the repair."""
    import sqlite3

    from flwr.supercore import sql_mixin
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore

    monkeypatch.setattr(sql_mixin, "SQLITE_PRAGMAS", sql_mixin.SQLITE_PRAGMAS)  # restored after
    if repaired:
        flower_repairs.repair_superlink(sql_mixin)
    db = tmp_path / "state.db"
    store = SqlObjectStore(str(db))
    store.initialize()
    (row,) = store.query("PRAGMA busy_timeout")
    assert list(row.values()) == [60_000 if repaired else 5_000]  # sqlite's own word
    assert dict(sql_mixin.SQLITE_PRAGMAS)["journal_mode"] == "WAL"  # the rest kept

    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the write lock
    outcome = {}

    def write():
        try:
            store.clear()  # a write: it needs the lock
            outcome["done"] = True
        except Exception as err:  # noqa: BLE001 - what the SuperLink's request would get
            outcome["done"] = str(err)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(7.0)  # the lock holder is held up 7 s (or until the writer gave up)
    holder.execute("COMMIT")
    writer.join(120.0)
    if repaired:
        assert outcome == {"done": True}
    else:
        assert "database is locked" in str(outcome["done"])


def test_command_runs_flowers_own_process_with_the_repairs():
    """The entry points the repairs start are Flower's, and the names they patch exist
    (an upgrade of flwr that moves them fails here)."""
    assert flower_repairs.command("supernode", ["--insecure"])[1:] == [
        "-m", "fedefc_cli.flower_repairs", "supernode", "--insecure"]
    from flwr.supercore import sql_mixin
    assert "busy_timeout" in dict(sql_mixin.SQLITE_PRAGMAS)
    from flwr.superlink.cli import flower_superlink
    assert callable(flower_superlink)
    for name in ("_pull_and_store_message", "_push_messages"):
        assert callable(getattr(start_client_internal, name))
    assert subprocess_executor.SubprocessExecutor.reconcile
    from flwr.supercore.cli import flower_superexec
    from flwr.supernode.cli import flower_supernode
    assert callable(flower_supernode) and callable(flower_superexec)
