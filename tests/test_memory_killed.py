"""A simulation's ClientApp killed by Ray's memory monitor is named as such, with the fix
(docs/RELIABILITY.md, "A ClientApp killed by Ray's memory monitor").

The failure is made the way a run meets it: Ray's ``OutOfMemoryError`` with the raylet's
text (Ray 2.55's format strings, in its raylet binary, filled in) is raised where Flower
1.42's Ray backend raises what ``ray.get`` raised; Flower's own Simulation Runtime worker
(``vce_api.worker``) turns it into the error reply, and Flower's own ``GridClientProxy``
into the exception the ServerApp's round sees.
"""

import json
import threading
from queue import Queue

import pytest
from flwr.app import Context, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.superlink.fleet.vce.metrics import VceMetrics
from flwr.server.superlink.fleet.vce.vce_api import worker
from ray.exceptions import OutOfMemoryError

from fedefc_server.failures import (MEMORY_FIX, MEMORY_KILLED, RunFailed, describe_failure,
                                    memory_killed)
from tests.test_round_loop import TrainingNode, run_loop

# "%d worker(s) were killed due to the node running low on memory. %s, %s": the count,
# the details ("Memory on the node ... Top 10 memory users: %s"), the suggestions
RAYLET_TEXT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node "
    "(IP: 10.0.0.5, ID: 4cb25bc084ae) was 7.61GB / 7.77GB (0.979412), which exceeds the "
    "memory usage threshold of 0.950000; Object store memory usage: [- objects in use: "
    "3]; Ray killed 1 worker(s) based on the killing policy: [(Actor: ClientAppActor, "
    "pid=4242, actual memory used=2.10GB)]; To see more information about memory usage "
    "on this node, use `ray logs raylet.out -ip 10.0.0.5`; Top 10 memory users: "
    "PID\tMEM(GB)\tCOMMAND\n4242\t2.10\tray::ClientAppActor.run, Refer to the "
    "documentation on how to address the out of memory issue: "
    "https://docs.ray.io/en/latest/ray-core/scheduling/ray-oom-prevention.html. Consider "
    "provisioning more memory on this node or reducing task parallelism by requesting "
    "more CPUs per task. To adjust the kill threshold, set the environment variable "
    "`RAY_memory_usage_threshold` when starting Ray. To disable worker killing, set the "
    "environment variable `RAY_memory_monitor_refresh_ms` to zero.")


class KilledActor:
    """Flower's Ray backend whose actor the memory monitor killed: ``ray.get`` of the
    task raises Ray's OutOfMemoryError, which ``process_message`` re-raises."""

    def process_message(self, message, context):
        raise OutOfMemoryError(RAYLET_TEXT)


class NodeStore:
    """The node's run context, as Flower's DeprecatedRunInfoStore hands it out."""

    def retrieve_context(self, run_id):
        return Context(run_id, 1, {}, RecordDict(), {"partition-id": 0})


class SimulationGrid:
    """Each message goes through Flower's Simulation Runtime worker; its reply returns."""

    def send_and_receive(self, messages, timeout=None):
        ins, out, stop = Queue(), Queue(), threading.Event()
        for message in messages:
            ins.put(message)
        thread = threading.Thread(target=worker, args=(
            ins, out, {1: NodeStore()}, KilledActor(), stop, VceMetrics()))
        thread.start()
        try:
            return [out.get(timeout=30)]
        finally:
            stop.set()
            thread.join()


def killed_fit(ins):
    """What the ServerApp's round gets from a fit whose ClientApp Ray killed for memory."""
    with pytest.raises(Exception) as err:
        GridClientProxy(1, SimulationGrid(), 0).fit(ins, None, None)
    return err.value


def test_an_oom_kill_is_described_with_the_memory_figures_and_the_fix():
    ins = FitIns(ndarrays_to_parameters([]), {})
    described = describe_failure(killed_fit(ins))
    assert described == (
        f"error reply: {MEMORY_KILLED} (the machine's memory at 7.61 of 7.77 GB, 97.9 %, "
        f"over its threshold of 95 %): {MEMORY_FIX}")
    assert "Top 10 memory users" not in described
    assert "client-resources-num-cpus" in MEMORY_FIX and "RAY_memory_usage_threshold" \
        in MEMORY_FIX and "batch-size" in MEMORY_FIX


def test_other_failures_are_not_taken_for_an_oom_kill():
    assert memory_killed("<class 'RuntimeError'>:<'data.npz is malformed'>") is None
    # Ray before 2.55 began "Task was killed due to the node running low on memory."
    assert memory_killed("Task was killed due to the node running low on memory.") == \
        f"{MEMORY_KILLED}: {MEMORY_FIX}"


class OomKilledNode(TrainingNode):
    """Partitions 1-3 are killed by Ray's memory monitor; partition 0 fails otherwise
    first (listed first), as a node whose own data is broken."""

    def fit(self, ins, timeout, group_id):
        if self.partition_id == 0:
            raise RuntimeError("partition 0: data.npz is malformed")
        return GridClientProxy(1, SimulationGrid(), 0).fit(ins, timeout, group_id)


def test_a_round_the_memory_monitor_emptied_fails_the_run_naming_it_and_the_fix(tmp_path):
    with pytest.raises(RunFailed, match="round 1: no node trained") as err:
        run_loop(tmp_path, "fedavg", rounds=2, node=OomKilledNode)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failure"] == str(err.value)
    assert "4 sampled; 4 failed, e.g. node node-" in summary["failure"]
    assert MEMORY_KILLED in summary["failure"] and MEMORY_FIX in summary["failure"]
    reasons = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])[
        "failure_reasons"]
    assert sum(MEMORY_KILLED in r for r in reasons) == 3
