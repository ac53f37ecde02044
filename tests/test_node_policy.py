"""The node's own policy (fedefc_client/policy.py; docs/PRIVACY.md, "The node's own
policy"): a SuperNode's operator names a policy file in the node config, and the
ClientApp refuses every message of a run that breaks it, whatever the run config says;
the server records the refusal with its reason, and the run goes on without the node."""

import json
import stat

import pytest
from flwr.common import GetPropertiesIns

from common.dp_accounting import epsilon
from common.methods import load_run_config
from fedefc_client.client_app import app as client_app
from fedefc_client.policy import NodePolicy, PolicyError, load_policy
from tests.helpers import InProcessGrid
from tests.test_privacy import micro_config, secure_round


def write_policy(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def run(**keys):
    return load_run_config({"diagnostics": False, **keys})


def policy(**keys) -> NodePolicy:
    return NodePolicy.model_validate(keys)


def test_a_policy_file_is_read_and_validated(tmp_path):
    path = write_policy(tmp_path / "policy.toml", """
        require-secure-aggregation = true
        min-dp-noise-multiplier = 0.8
        max-epsilon = 10.0
        dp-delta = 1e-6
        max-rounds = 200
        methods = ["fedefc", "fedavg"]
        audit-dir = "/var/lib/fedefc/audit"
    """)
    p = load_policy(path)
    assert (p.require_secure_aggregation, p.min_dp_noise_multiplier, p.max_epsilon,
            p.dp_delta, p.max_rounds, p.methods, p.audit_dir) == (
        True, 0.8, 10.0, 1e-6, 200, ("fedefc", "fedavg"), "/var/lib/fedefc/audit")
    assert not p.allow_diagnostics and not p.allow_faults  # refused unless allowed


@pytest.mark.parametrize("text, mode, message", [
    ("require-secure-aggregaton = true", 0o600,
     "unknown key 'require-secure-aggregaton'; the keys are require-secure-aggregation"),
    ("min-dp-noise-multiplier = -1", 0o600,
     "min-dp-noise-multiplier = -1: Input should be greater than or equal to 0"),
    ("max-rounds = \"many\"", 0o600, "max-rounds = 'many': Input should be a valid integer"),
    ("methods = [\"fedsgd\"]", 0o600, "unknown method(s) 'fedsgd'; the methods are fedefc"),
    ("audit-dir = \"audit\"", 0o600, "'audit' is not an absolute path"),
    ("dp-delta = 1.0", 0o600, "dp-delta = 1.0: Input should be less than 1"),
    ("require-secure-aggregation = ", 0o600, "is not valid TOML"),
    ("max-rounds = 5", 0o666, "is writable by others than its owner (mode 0666)"),
    ("max-rounds = 5", 0o620, "chmod go-w"),
], ids=["typo", "negative", "type", "method", "relative-dir", "delta", "toml",
        "world-writable", "group-writable"])
def test_a_bad_policy_file_is_refused_naming_the_key_and_the_fix(tmp_path, text, mode,
                                                                 message):
    path = write_policy(tmp_path / "policy.toml", text, mode)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert message in str(err.value) and path in str(err.value)


def test_a_missing_policy_file_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read .* create the file"):
        load_policy(str(tmp_path / "absent.toml"))


def test_a_changed_policy_file_is_read_again(tmp_path):
    path = write_policy(tmp_path / "policy.toml", "max-rounds = 5")
    assert load_policy(path).max_rounds == 5
    write_policy(tmp_path / "policy.toml", "max-rounds = 50")
    assert load_policy(path).max_rounds == 50


@pytest.mark.parametrize("rule, keys, reason", [
    ({"require-secure-aggregation": True}, {},
     "secure-aggregation=false, but this node requires secure aggregation"),
    ({"min-dp-noise-multiplier": 0.5}, {"dp-clip": 1.0, "dp-noise-multiplier": 0.4},
     "dp-noise-multiplier=0.4 is below this node's minimum 0.5"),
    ({"max-rounds": 10}, {"rounds": 11}, "rounds=11 is above this node's max-rounds 10"),
    ({"methods": ["fedavg"]}, {"method": "fedefc"}, "method='fedefc' is not one this node runs"),
    ({}, {"diagnostics": True}, "diagnostics=true, but this node sends no simulation"),
    ({}, {"faults": "raise@0@1"}, "faults='raise@0@1', but this node injects no faults"),
], ids=["secure-aggregation", "noise", "rounds", "method", "diagnostics", "faults"])
def test_each_rule_refuses_the_run_that_breaks_it_and_only_that(rule, keys, reason):
    [got] = policy(**rule).violations(run(**keys))
    assert reason in got
    allowed = {"allow-diagnostics": True, "allow-faults": True}
    compliant = {"secure-aggregation": True, "dp-clip": 1.0, "dp-noise-multiplier": 0.5,
                 "rounds": 10, "method": "fedavg"}
    assert policy(**rule, **allowed).violations(run(**compliant)) == []


def test_max_epsilon_is_the_accountants_over_every_round_at_the_nodes_delta():
    """The node computes epsilon itself (no sampling amplification, its own delta): a
    run just above the bound is refused, just below accepted; without noise, inf."""
    bound = epsilon(1.0, 20, 1e-6)
    strict = policy(**{"max-epsilon": bound * 0.99, "dp-delta": 1e-6})
    loose = policy(**{"max-epsilon": bound * 1.01, "dp-delta": 1e-6})
    noisy = run(**{"dp-clip": 1.0, "dp-noise-multiplier": 1.0, "rounds": 20,
                   "dp-delta": 0.5})  # the run's own delta does not count
    [reason] = strict.violations(noisy)
    assert f"epsilon={bound:.4g} at delta=1e-06, above this node's max-epsilon" in reason
    assert loose.violations(noisy) == []
    assert "epsilon=inf" in loose.violations(run(rounds=20))[0]


def test_a_node_refuses_a_run_against_its_policy_and_the_round_goes_on_without_it(
        micro_mnist_dir, tmp_path):
    """Nodes 0-2 have a strict policy this secure run meets (and keep their own audit
    log); node 3's policy asks for DP noise the run does not add: it answers every message
    with an error naming why, never reads its data nor takes part in SecAgg+, and the
    server records why it is missing."""
    strict = write_policy(tmp_path / "strict.toml", f"""
        require-secure-aggregation = true
        min-dp-noise-multiplier = 0.01
        max-rounds = 3
        methods = ["fedefc"]
        audit-dir = "{tmp_path / 'node-audit'}"
    """)
    noisy = write_policy(tmp_path / "noisy.toml", "min-dp-noise-multiplier = 0.5")
    flat = micro_config(micro_mnist_dir, tmp_path / "out", diagnostics=False,
                        **{"secure-aggregation": True, "dp-clip": 1.0,
                           "dp-noise-multiplier": 0.01})
    configs = {k: {"policy-file": strict} for k in range(3)} | {3: {"policy-file": noisy}}
    grid = InProcessGrid(client_app, flat, 4, configs)
    fields, params = secure_round(flat, grid)
    assert params is not None and fields["partition_ids"] == [0, 1, 2]
    [missing] = fields["unanswered_nodes"]
    assert missing["node"] == "1003"
    assert ("this node's policy refuses the run: dp-noise-multiplier=0.01 is below this "
            "node's minimum 0.5") in missing["reason"]
    refusals = [m for m in grid.received if m.metadata.src_node_id == 1003]
    assert refusals and all(m.has_error() and m.error.code == 6 for m in refusals)
    assert len(grid.contexts[1003].state) == 0  # no SecAgg+ state, nothing of the run
    # the compliant nodes' own audit logs, though the run has audit=false
    assert not load_run_config(flat).audit
    audit = tmp_path / "node-audit"
    assert stat.S_IMODE(audit.stat().st_mode) == 0o700
    for k in range(3):
        log = audit / f"run-1-partition-{k}.jsonl"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        stages = [json.loads(x).get("stage") for x in log.read_text().splitlines()]
        assert stages[-4:] == ["setup", "share_keys", "collect_masked_vectors", "unmask"]


def test_an_unusable_policy_file_refuses_every_message_without_naming_its_path(
        micro_mnist_dir, tmp_path):
    (tmp_path / "private-site").mkdir()
    path = write_policy(tmp_path / "private-site" / "policy.toml", "x = 1")
    flat = micro_config(micro_mnist_dir, tmp_path / "out", 2, diagnostics=False)
    grid = InProcessGrid(client_app, flat, 2, {0: {"policy-file": path}})
    proxy = next(p for p in grid.manager().all().values() if p.node_id == 1000)
    with pytest.raises(ValueError, match="unknown key 'x'") as err:
        proxy.get_properties(GetPropertiesIns({}), None, 1)
    assert "private-site" not in str(err.value)
    assert "node policy <node-config:policy-file>" in str(err.value)
