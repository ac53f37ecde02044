"""The suite's own guards: an unmarked test cannot start a Flower executable, and the
in-process nodes of tests/helpers.py run one message at a time."""

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from flwr.app import Message, RecordDict

from fedefc_cli.flower import flower_bin
from tests.helpers import InProcessGrid


def test_an_unmarked_test_cannot_start_flower():
    for name in ("flwr", "flower-superlink"):
        with pytest.raises(RuntimeError, match="not marked @pytest.mark.flower"):
            subprocess.run([flower_bin(name), "--help"], capture_output=True)


def test_other_programs_still_start():
    assert subprocess.run(["true"]).returncode == 0


def test_in_process_nodes_handle_one_message_at_a_time_when_sent_from_threads():
    """Flower's ``fit_clients`` sends from a thread per node; in-process nodes share
    torch's global state, so :class:`tests.helpers.InProcessGrid` runs one at a time."""
    running, most = [0], [0]
    lock = threading.Lock()

    def app(msg: Message, context) -> Message:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, {}, 3)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(
            lambda nid: grid.send_and_receive([Message(RecordDict(), nid, "query")]),
            grid.get_node_ids()))
    assert [len(r) for r in replies] == [1, 1, 1] and len(grid.received) == 3
    assert most[0] == 1
