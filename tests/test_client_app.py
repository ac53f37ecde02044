"""The ClientApp's own checks come before the run's code (fedefc_client/client_app.py):
a run that is not for the node is refused in a fresh process that never imports torch
or the run-config schema (docs/RELIABILITY.md, "A run that trained nothing fails");
a run that is for it goes on to the run's mods and client. Each case runs in its own
interpreter, as Flower's SuperExec starts a ClientApp process per message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from flwr.common.constant import ErrorCode

from fedefc_cli.run_configs import APP_DIR

PROBE = textwrap.dedent("""
    import json, sys
    from flwr.app import Context, Message, RecordDict
    from flwr.app.message_type import MessageType
    from flwr.supercore.task_identity import TaskIdentity
    from fedefc_client.client_app import app
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1000, 1, 1
    node_config, run_config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    reply = app(Message(RecordDict(), 1000, MessageType.TRAIN, group_id="1"),
                Context(1, 1000, node_config, RecordDict(), run_config))
    print(json.dumps({
        "code": reply.error.code if reply.has_error() else None,
        "reason": reply.error.reason if reply.has_error() else "",
        "imported": sorted(m for m in ("torch", "common.config", "common.methods",
                                        "fedefc_client.run_client") if m in sys.modules)}))
""")


def answer(node_config: dict, run_config: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(node_config),
                          json.dumps(run_config)], cwd=APP_DIR, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("node_config, expected", [
    ({"partition-id": 0, "num-partitions": 3},
     "num-partitions=3 differs from the run's num-clients=4; make them equal"),
    ({"partition-id": 4, "num-partitions": 4}, "partition-id=4 is outside 0..3"),
    ({"num-partitions": 4}, "node config has no 'partition-id'"),
])
def test_a_run_not_for_the_node_is_refused_before_torch_is_imported(node_config, expected):
    """The refusal is Flower's code for a ClientApp that raised, its text the node's
    identity check (:func:`fedefc_client.node.partition_of`), and neither torch nor the
    run's part of the ClientApp was imported to say it (the run config was validated,
    by the audit and the policy mods before it)."""
    out = answer(node_config, {"num-clients": 4})
    assert out["code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "ConfigError" in out["reason"] and expected in out["reason"]
    assert out["imported"] == ["common.config", "common.methods"]


def test_a_run_for_the_node_goes_on_to_the_runs_mods_and_client():
    """The same process with a matching identity reaches the run's part: its mods and
    client are imported (here to fail on an empty training message, which no check
    before them reads)."""
    out = answer({"partition-id": 0, "num-partitions": 4}, {"num-clients": 4})
    assert out["code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "num-partitions" not in out["reason"] and "partition-id" not in out["reason"]
    assert out["imported"] == ["common.config", "common.methods", "fedefc_client.run_client",
                               "torch"]


def test_a_bad_run_config_is_named_before_torch_is_imported():
    """The run config's validation (in the audit and policy mods, before the identity
    check) names a bad ``num-clients``, still without torch."""
    out = answer({"partition-id": 0, "num-partitions": 4}, {"num-clients": "four"})
    assert out["code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and "num-clients" in out["reason"]
    assert out["imported"] == ["common.config", "common.methods"]


def test_a_run_against_the_nodes_policy_is_refused_before_torch_is_imported(tmp_path):
    """A node's policy (docs/PRIVACY.md §5) refuses a run it does not allow as a mod's
    failed precondition naming the rule, and the run's training code stays unimported."""
    policy = tmp_path / "policy.toml"
    policy.write_text("max-rounds = 10\n")
    policy.chmod(0o600)
    out = answer({"partition-id": 0, "num-partitions": 4, "policy-file": str(policy)},
                 {"num-clients": 4, "rounds": 11})
    assert out["code"] == ErrorCode.MOD_FAILED_PRECONDITION
    assert "rounds=11 is above this node's max-rounds 10" in out["reason"]
    assert out["imported"] == ["common.config", "common.methods"]
